"""Our chat-template renderer against transformers' ``apply_chat_template``: the same text and the
same token ids, on make-model's ChatML template and on a template using more of what transformers
offers templates (bos_token, raise_exception, loop controls, tojson, namespace, generation tags)."""

from __future__ import annotations

import json
import shutil

import jinja2
import pytest
import transformers

from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.router.openai.chat_template import ChatTemplate, ChatTemplateError

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Write a haiku about the sea, héllo 你好 🙂\n\nthanks"},
    ],
    [{"role": "user", "content": "A turn <|im_end|> inside <|im_start|>assistant text"}],  # stays special
]

# Llama-3-like: bos_token, namespace, loop controls, tojson, raise_exception, a generation block.
RICH_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(turns=0) %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% if message['content'] == '' %}{% continue %}{% endif %}"
    "{% set ns.turns = ns.turns + 1 %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% if message.meta is defined %} {{ message.meta | tojson }}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant ({{ ns.turns }} turns)\n{% endif %}"
)


def ours_and_theirs(model_dir):
    return Tokenizer.from_model_dir(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)


def render_both(ours: Tokenizer, theirs, messages, add_generation_prompt=True):
    template = ChatTemplate.from_tokenizer(ours)
    text = template.render(messages, add_generation_prompt=add_generation_prompt)
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=False)
    return text, expected, ours.encode(text, add_special_tokens=False), list(ids)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_make_model_chatml_renders_and_encodes_as_transformers(tiny_model_dir, messages, add_generation_prompt):
    ours, theirs = ours_and_theirs(tiny_model_dir)
    text, expected, ids, expected_ids = render_both(ours, theirs, messages, add_generation_prompt)
    assert text == expected and ids == expected_ids
    im_start, im_end = ours.token_to_id("<|im_start|>"), ours.token_to_id("<|im_end|>")
    assert ids[0] == im_start and ids.count(im_end) == len(messages) + (messages[0]["role"] != "system") + (
        "<|im_end|>" in messages[-1]["content"]
    )  # the special tokens are single ids, typed ones too


@pytest.fixture(scope="module")
def rich_model_dir(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("rich") / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|endoftext|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(RICH_TEMPLATE)  # overrides tokenizer_config's, as in transformers
    return folder


def test_a_richer_template_renders_as_transformers(rich_model_dir):
    ours, theirs = ours_and_theirs(rich_model_dir)
    messages = [
        {"role": "system", "content": ""},
        {"role": "user", "content": "Hi", "meta": {"lang": "fr", "q": "é<"}},
        {"role": "assistant", "content": "Salut"},
        {"role": "user", "content": "Again"},
    ]
    text, expected, ids, expected_ids = render_both(ours, theirs, messages)
    assert text == expected and ids == expected_ids
    assert text.startswith('<|endoftext|><|im_start|>user\nHi {"lang": "fr", "q": "é<"}')
    assert text.endswith("<|im_start|>assistant (3 turns)\n")


def test_template_errors_carry_the_templates_message(rich_model_dir):
    ours, theirs = ours_and_theirs(rich_model_dir)
    bad = [{"role": "tool", "content": "42"}]
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        ChatTemplate.from_tokenizer(ours).render(bad)
    with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
        theirs.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_the_sandbox_keeps_templates_from_python_internals():
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):  # immutable: a template cannot change the messages
        ChatTemplate("{{ messages.append(1) }}").render([])


def test_no_template_means_none(untemplated_model_dir):
    assert ChatTemplate.from_tokenizer(Tokenizer.from_model_dir(untemplated_model_dir)) is None
