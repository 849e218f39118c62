from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
from tokenizers import processors

from splitserve.engine.text.tokenizer import Tokenizer
from tests.engine.tokenizer_fixtures import CHAT_TEMPLATE, make_byte_level_backend, make_byte_level_tokenizer_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "",
    "Hello world",
    " leading space and  double  spaces\n\ttabs",
    "你好，世界 🙂🚀👍🏽 𝄞 龘 naïve café",
    "<|im_start|>user\nhi<|im_end|>\n",
    "unseen words: xylophone quizzically",
]


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data))


def test_from_model_dir_reads_special_tokens_and_template(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_model_dir(make_byte_level_tokenizer_dir(tmp_path))
    im_end, endoftext = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.eos_token_ids == (im_end, endoftext)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.bos_token_id is None
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.vocab_size == 500
    assert tokenizer.all_special_ids == {0, 1, 2}
    assert isinstance(tokenizer.backend, tokenizers.Tokenizer)
    assert tokenizer.id_to_token(im_end) == "<|im_end|>"
    assert tokenizer.token_to_id("no such token") is None


@pytest.mark.parametrize("text", TEXTS)
def test_decode_inverts_encode(tmp_path: Path, text: str) -> None:
    tokenizer = Tokenizer.from_model_dir(make_byte_level_tokenizer_dir(tmp_path))
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_decode_skips_special_tokens(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_model_dir(make_byte_level_tokenizer_dir(tmp_path))
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == tokenizer.token_to_id("<|im_start|>")
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def make_variant_dir(tmp_path: Path, variant: str) -> Path:
    """Folders whose special-token setup transformers handles in different ways."""
    model_dir = make_byte_level_tokenizer_dir(tmp_path)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    if variant == "bos_post_processor":
        backend = make_byte_level_backend()
        backend.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
        )
        backend.save(str(model_dir / "tokenizer.json"))
        config.update(bos_token="<|endoftext|>", add_bos_token=True)
    elif variant == "add_bos_token_ignored":
        config.update(bos_token={"__type": "AddedToken", "content": "<|endoftext|>"}, add_bos_token=True)
    elif variant == "vocab_word_as_eos":
        config.update(eos_token="Hello")  # a plain vocabulary token; transformers makes it special
    write_json(model_dir / "tokenizer_config.json", config)
    return model_dir


@pytest.mark.parametrize("variant", ["plain", "bos_post_processor", "add_bos_token_ignored", "vocab_word_as_eos"])
def test_encode_matches_transformers(tmp_path: Path, variant: str) -> None:
    transformers = pytest.importorskip("transformers")
    model_dir = make_variant_dir(tmp_path, variant)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    reference = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    for text in TEXTS + ["Hello there, Hello"]:
        assert tokenizer.encode(text) == reference(text)["input_ids"], text
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        ids = reference(text)["input_ids"]
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
    if variant == "bos_post_processor":
        assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id == 0
    if variant == "vocab_word_as_eos":
        assert tokenizer.token_to_id("Hello") in tokenizer.all_special_ids


def test_add_bos_token_disagreeing_with_post_processor_is_logged(tmp_path: Path, caplog) -> None:
    model_dir = make_variant_dir(tmp_path, "add_bos_token_ignored")
    with caplog.at_level(logging.WARNING, logger="splitserve.engine.text.tokenizer"):
        tokenizer = Tokenizer.from_model_dir(model_dir)
    assert tokenizer.bos_token_id == 0
    assert tokenizer.encode("hi")[0] != 0
    assert "add_bos_token" in caplog.text


def test_truncation_and_padding_in_tokenizer_json_are_ignored(tmp_path: Path) -> None:
    model_dir = make_byte_level_tokenizer_dir(tmp_path)
    backend = make_byte_level_backend()
    backend.enable_truncation(max_length=2)
    backend.enable_padding(length=64)
    backend.save(str(model_dir / "tokenizer.json"))
    tokenizer = Tokenizer.from_model_dir(model_dir)
    text = "Hello world, hello there! The quick brown fox"
    assert tokenizer.encode(text) == make_byte_level_backend().encode(text).ids


def test_eos_falls_back_to_config_json_then_tokenizer_config(tmp_path: Path) -> None:
    model_dir = make_byte_level_tokenizer_dir(tmp_path)
    (model_dir / "generation_config.json").unlink()
    write_json(model_dir / "config.json", {"eos_token_id": 1, "bos_token_id": 0, "vocab_size": 512})
    tokenizer = Tokenizer.from_model_dir(model_dir)
    assert tokenizer.eos_token_ids == (1,)
    assert tokenizer.bos_token_id == 0

    write_json(model_dir / "config.json", {"eos_token_id": None, "vocab_size": 512})
    tokenizer_config = {"eos_token": {"content": "<|im_end|>"}, "bos_token": "<|endoftext|>"}
    write_json(model_dir / "tokenizer_config.json", tokenizer_config)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.bos_token_id == 0
    assert tokenizer.chat_template is None


def test_eos_ids_from_generation_config_win_and_are_deduplicated(tmp_path: Path) -> None:
    model_dir = make_byte_level_tokenizer_dir(tmp_path)
    write_json(model_dir / "generation_config.json", {"eos_token_id": [2, 0, 2, 1], "bos_token_id": 1})
    write_json(model_dir / "config.json", {"eos_token_id": 0, "bos_token_id": 0})
    tokenizer = Tokenizer.from_model_dir(model_dir)
    assert tokenizer.eos_token_ids == (2, 0, 1)
    assert tokenizer.bos_token_id == 1


def test_chat_template_file_and_named_templates(tmp_path: Path) -> None:
    model_dir = make_byte_level_tokenizer_dir(tmp_path)
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    write_json(model_dir / "tokenizer_config.json", {"chat_template": templates})
    assert Tokenizer.from_model_dir(model_dir).chat_template == "D"
    (model_dir / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_model_dir(model_dir).chat_template == "J"


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)


@pytest.mark.parametrize(
    "file_name, content",
    [
        ("tokenizer_config.json", "{not json"),
        ("generation_config.json", "[1, 2]"),
        ("config.json", '{"eos_token_id": "2"}'),
        ("generation_config.json", '{"eos_token_id": [2, true]}'),
        ("tokenizer_config.json", '{"eos_token": 2}'),
        ("tokenizer_config.json", '{"chat_template": [{"name": "default"}]}'),
        ("tokenizer.json", '{"truncated":'),
    ],
)
def test_malformed_files_name_the_file(tmp_path: Path, file_name: str, content: str) -> None:
    model_dir = make_byte_level_tokenizer_dir(tmp_path)
    if file_name == "config.json":
        (model_dir / "generation_config.json").unlink()
    (model_dir / file_name).write_text(content)
    with pytest.raises(ValueError, match=re.escape(f"/{file_name}:")):
        Tokenizer.from_model_dir(model_dir)


def test_router_modules_do_not_import_torch() -> None:
    code = (
        "import sys; import splitserve.engine.text.tokenizer, splitserve.engine.text.detokenizer, "
        "splitserve.engine.text.stop_strings; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout


def test_encode_rejects_lone_surrogate_with_value_error(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_model_dir(make_byte_level_tokenizer_dir(tmp_path))
    with pytest.raises(ValueError, match="position 2"):
        tokenizer.encode(json.loads('"ab\\ud800"'))
