"""Small tokenizer folders for tests, trained in milliseconds with the `tokenizers` library."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Frequent words merge into whole tokens; the rare characters at the end (emoji, rare CJK) stay split
# into several byte tokens, which is what the detokenizer tests need.
CORPUS = [
    "Hello world, hello there! The quick brown fox jumps over the lazy dog.",
    "Streaming text to a client token by token, one delta at a time.",
    "héllo wörld, naïve café, crème brûlée, façade, Ångström, smörgåsbord",
    "你好，世界。今天天气很好。我们去公园散步吧。",
    "こんにちは世界。日本語のテキストです。",
    "Привет, мир! Как дела?",
    "∑ ∫ √ ∞ ≈ ≠ ≤ ≥ → ← ↑ ↓",
    "🙂 🚀 👍🏽 🎉 🧪 🐍",
] * 8 + ["龘 𝄞 🦜 🫠"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)


def make_byte_level_backend(vocab_size: int = 500) -> BackendTokenizer:
    """A byte-level BPE (the GPT-2 / Llama 3 / Qwen family) trained on CORPUS."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    return backend


def make_byte_level_tokenizer_dir(tmp_path: Path) -> Path:
    """Writes tokenizer.json, tokenizer_config.json (eos "<|im_end|>", a chat template) and
    generation_config.json (eos ids: <|im_end|>, <|endoftext|>) into `tmp_path`; returns it."""
    backend = make_byte_level_backend()
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    eos_ids = [backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return tmp_path
