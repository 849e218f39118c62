"""Log-probabilities through the OpenAI API of a served fp32 model (a prefill and a decode worker):
completions' ``logprobs`` and ``echo`` (the prompt's, computed by the prefill worker), chat's ``logprobs`` and
``top_logprobs``, streamed and not, against transformers' log_softmax on the same checkpoint."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
import torch

from splitserve.router.openai.chat_template import ChatTemplate

TOL = 1e-4
PROMPT = [5, 17, 99, 1000, 7, 42, 300, 12, 64]
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def hf(serving_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(serving_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def offline(serving_model):
    from splitserve.engine import LLM

    return LLM(serving_model, dtype="float32", num_blocks=256)


@torch.inference_mode()
def hf_rows(hf, tokens: list[int]) -> torch.Tensor:
    """log_softmax at every position: row i scores tokens[i + 1]."""
    return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


def greedy(offline, prompt, n: int) -> list[int]:
    from splitserve.engine import SamplingParams

    sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return offline.generate([prompt], sampling)[0].token_ids


def name(offline, token_id: int) -> str:
    """How the API names a token: its own decoded text."""
    return offline.tokenizer.decode([token_id], skip_special_tokens=False)


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{served.openai_address}/v1", api_key="unused", max_retries=0, timeout=60)


def post(served, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://{served.openai_address}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def stream(served, path: str, body: dict) -> list[dict]:
    request = urllib.request.Request(
        f"http://{served.openai_address}{path}",
        json.dumps({**body, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = [line.decode().strip() for line in response]
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def joined(chunks: list[dict]) -> dict:
    """A streamed completion's logprobs objects, concatenated."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        logprobs = chunk["choices"][0]["logprobs"] if chunk["choices"] else None
        for key in out:
            out[key] += (logprobs or {}).get(key, [])
    return out


def assert_same(a: dict, b: dict) -> None:
    """Two completions' logprobs objects alike: the same tokens, values to TOL (a second request may be
    served partly from the prefix cache, which rounds differently)."""
    assert (a["tokens"], a["text_offset"]) == (b["tokens"], b["text_offset"])
    assert [v is None for v in a["token_logprobs"]] == [v is None for v in b["token_logprobs"]]
    assert [v or 0.0 for v in a["token_logprobs"]] == pytest.approx([v or 0.0 for v in b["token_logprobs"]], abs=TOL)
    for x, y in zip(a["top_logprobs"], b["top_logprobs"]):
        assert (x is None and y is None) or (x.keys() == y.keys() and x == pytest.approx(y, abs=TOL))


def check_completion_entries(logprobs: dict, tokens: list[int], first: int, rows: torch.Tensor, names, k: int):
    """Entries for tokens[first:], each scored by the row before it (None for position 0)."""
    n = len(tokens) - first
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == n
    assert logprobs["tokens"] == [names(t) for t in tokens[first:]]
    offsets = [0]
    for name in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(name))
    assert logprobs["text_offset"] == offsets
    for j, (value, top) in enumerate(zip(logprobs["token_logprobs"], logprobs["top_logprobs"])):
        position = first + j
        if position == 0:
            assert value is None and top is None
            continue
        row = rows[position - 1]
        assert value == pytest.approx(float(row[tokens[position]]), abs=TOL)
        assert k + 1 >= len(top) >= max(k, 1)  # the chosen token and the k most likely
        assert top[names(tokens[position])] == pytest.approx(value, abs=1e-6)
        ref = row.topk(k).values.tolist() if k else []
        assert sorted(top.values(), reverse=True)[:k] == pytest.approx(ref, abs=TOL)


def test_completion_logprobs_match_transformers_streamed_or_not(served, hf, offline):
    output = greedy(offline, PROMPT, 6)
    rows = hf_rows(hf, PROMPT + output)
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    whole = post(served, "/v1/completions", body)
    (choice,) = whole["choices"]
    check_completion_entries(choice["logprobs"], PROMPT + output, len(PROMPT), rows, lambda t: name(offline, t), 3)
    # Greedy: each chosen token is the most likely one.
    assert all(
        v == max(top.values())
        for v, top in zip(choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"])
    )
    chunks = stream(served, "/v1/completions", body)
    assert_same(joined(chunks), choice["logprobs"])
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_returns_the_prompt_with_its_logprobs(served, hf, offline, max_tokens):
    """lm-eval's scoring request (echo, logprobs 1, max_tokens 1) and the one without generation (0)."""
    output = greedy(offline, PROMPT, 1)[:max_tokens]
    tokens = PROMPT + output
    rows = hf_rows(hf, PROMPT + greedy(offline, PROMPT, 1))
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1, "echo": True}
    whole = post(served, "/v1/completions", body)
    (choice,) = whole["choices"]
    check_completion_entries(choice["logprobs"], tokens, 0, rows, lambda t: name(offline, t), 1)
    prompt_text = offline.tokenizer.decode(PROMPT, skip_special_tokens=False)
    assert choice["text"].startswith(prompt_text)
    assert (choice["text"] == prompt_text) == (max_tokens == 0)
    assert choice["finish_reason"] == "length"
    chunks = stream(served, "/v1/completions", body)
    assert_same(joined(chunks), choice["logprobs"])
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]


def test_echo_of_a_text_prompt_and_echo_without_logprobs(served, offline):
    text = "The quick brown fox"
    ids = offline.tokenizer.encode(text)
    response = client(served).completions.create(
        model=served.router.model_name, prompt=text, max_tokens=3, temperature=0, echo=True, logprobs=0
    )
    (choice,) = response.choices
    assert choice.text.startswith(text)
    assert choice.logprobs.tokens[: len(ids)] == [name(offline, t) for t in ids]
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == len(ids) + 3
    assert all(len(top) == 1 for top in choice.logprobs.top_logprobs[1:])  # logprobs 0: the chosen token only
    plain = client(served).completions.create(
        model=served.router.model_name, prompt=text, max_tokens=3, temperature=0, echo=True
    )
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None


def test_chat_logprobs_match_transformers_streamed_or_not(served, hf, offline):
    template = ChatTemplate.from_tokenizer(offline.tokenizer)
    prompt = offline.tokenizer.encode(template.render(CHAT, add_generation_prompt=True), add_special_tokens=False)
    output = greedy(offline, prompt, 5)
    rows = hf_rows(hf, prompt + output)
    body = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": True}
    response = client(served).chat.completions.create(
        model=served.router.model_name,
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = response.choices[0].logprobs.content
    assert [e.token for e in content] == [name(offline, t) for t in output]
    for i, entry in enumerate(content):
        row = rows[len(prompt) - 1 + i]
        assert entry.logprob == pytest.approx(float(row[output[i]]), abs=TOL)
        assert entry.bytes == list(entry.token.encode())
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(2).values.tolist(), abs=TOL)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the top-1 entry
    chunks = stream(served, "/v1/chat/completions", {**body, "top_logprobs": 2})
    streamed = [
        e
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert [e["token"] for e in streamed] == [e.token for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e.logprob for e in content], abs=TOL)
    bare = post(served, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    assert [e["top_logprobs"] for e in bare] == [[]] * 5  # top_logprobs unset: none


def test_requests_without_logprobs_are_unchanged(served):
    response = post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert response["choices"][0]["logprobs"] is None
    chunks = stream(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "temperature": 0})
    assert all(c["choices"][0]["logprobs"] is None for c in chunks if c["choices"])


def test_each_of_n_choices_carries_its_own_logprobs(served):
    """n: 2 with echo: every choice echoes the prompt with its log-probabilities (scored once) and carries
    its own tokens', each as the single request with seed + i; streamed alike, and chat's per choice."""
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": 5, "logprobs": 2, "echo": True}
    whole = post(served, "/v1/completions", {**body, "n": 2})
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    singles = [post(served, "/v1/completions", {**body, "seed": 5 + i})["choices"][0] for i in range(2)]
    chunks = stream(served, "/v1/completions", {**body, "n": 2})
    for i, single in enumerate(singles):
        choice = whole["choices"][i]
        assert choice["text"] == single["text"]
        assert_same(choice["logprobs"], single["logprobs"])
        assert len(choice["logprobs"]["tokens"]) == len(PROMPT) + 4
        assert_same(joined([c for c in chunks if c["choices"] and c["choices"][0]["index"] == i]), single["logprobs"])
    chat = {"messages": CHAT, "max_tokens": 3, "temperature": 1.0, "seed": 9, "logprobs": True, "top_logprobs": 1}
    choices = post(served, "/v1/chat/completions", {**chat, "n": 2})["choices"]
    for i in range(2):
        single = post(served, "/v1/chat/completions", {**chat, "seed": 9 + i})["choices"][0]["logprobs"]["content"]
        content = choices[i]["logprobs"]["content"]
        assert [e["token"] for e in content] == [e["token"] for e in single] and len(content) == 3
        assert [e["logprob"] for e in content] == pytest.approx([e["logprob"] for e in single], abs=TOL)
