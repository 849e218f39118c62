"""Text <-> token ids for one Hugging Face model folder, without torch.

The router imports this module, so it (and everything it imports) must stay torch-free.

Files read by `Tokenizer.from_model_dir`:

    tokenizer.json            required   the `tokenizers` pipeline: encode, decode, added tokens
    tokenizer_config.json     optional   chat_template, bos_token, eos_token, add_bos_token
    chat_template.jinja       optional   overrides tokenizer_config's chat_template (as transformers does)
    generation_config.json    optional   eos_token_id (int or list), bos_token_id
    config.json               optional   eos_token_id, bos_token_id: fallback when generation_config lacks them

Encoding follows transformers 5 for a tokenizer.json folder: the post-processor stored in tokenizer.json
alone decides which special tokens `encode(add_special_tokens=True)` adds. transformers drops
`add_bos_token`/`add_eos_token` from tokenizer_config.json in that case, and so do we; `add_bos_token` is
only compared with what the post-processor does, and a disagreement is logged.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token facts that serving needs.

    Takes ownership of `backend` (its truncation and padding are turned off) and is not changed afterwards.
    `encode`/`decode` are thin passthroughs to `backend`; ids the backend does not know are dropped by
    `decode` (a model's embedding may be padded past the tokenizer's size). `all_special_ids` are exactly
    the ids that `decode(..., skip_special_tokens=True)` drops.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        # A serving tokenizer must never cut or pad a prompt behind the caller's back.
        backend.no_truncation()
        backend.no_padding()
        self.backend = backend
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.bos_token_id = bos_token_id
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.all_special_ids: frozenset[int] = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Loads the tokenizer of the model folder `path` (see the module docstring for the files).

        Raises FileNotFoundError naming tokenizer.json when it is missing, and ValueError naming the file
        when a file is malformed or a field has the wrong type.
        """
        model_dir = Path(path)
        tokenizer_file = model_dir / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tokenizer_file}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"{tokenizer_file}: cannot load tokenizer: {e}") from e

        tokenizer_config = _read_json(model_dir / TOKENIZER_CONFIG_FILE)
        generation_config = _read_json(model_dir / GENERATION_CONFIG_FILE)
        model_config = _read_json(model_dir / MODEL_CONFIG_FILE)
        config_file = model_dir / TOKENIZER_CONFIG_FILE
        bos_token = _token_content(tokenizer_config, "bos_token", config_file)
        eos_token = _token_content(tokenizer_config, "eos_token", config_file)
        # transformers registers bos/eos as special added tokens, which changes how text containing them
        # encodes and makes decode(skip_special_tokens=True) drop them. Tokens outside the vocabulary are
        # not added: the model has no embedding for them.
        named = [t for t in (bos_token, eos_token) if t is not None and backend.token_to_id(t) is not None]
        if named:
            backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in named])

        eos_token_ids = _first_ids(
            [
                (generation_config, "eos_token_id", model_dir / GENERATION_CONFIG_FILE),
                (model_config, "eos_token_id", model_dir / MODEL_CONFIG_FILE),
            ]
        )
        if eos_token_ids is None:
            eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
            eos_token_ids = [] if eos_id is None else [eos_id]
        bos_token_ids = _first_ids(
            [
                (generation_config, "bos_token_id", model_dir / GENERATION_CONFIG_FILE),
                (model_config, "bos_token_id", model_dir / MODEL_CONFIG_FILE),
            ]
        )
        if bos_token_ids:
            bos_token_id: int | None = bos_token_ids[0]
        else:
            bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None

        tokenizer = cls(
            backend,
            eos_token_ids=eos_token_ids,
            bos_token_id=bos_token_id,
            bos_token=bos_token,
            eos_token=eos_token,
            chat_template=_chat_template(model_dir, tokenizer_config),
        )
        add_bos_token = tokenizer_config.get("add_bos_token")
        if add_bos_token is not None and bos_token_id is not None:
            adds_bos = tokenizer.encode("")[:1] == [bos_token_id]
            if bool(add_bos_token) != adds_bos:
                logger.warning(
                    "%s: add_bos_token=%s but the post-processor of %s %s; following %s as transformers does",
                    config_file,
                    add_bos_token,
                    TOKENIZER_FILE,
                    "adds bos" if adds_bos else "does not add bos",
                    TOKENIZER_FILE,
                )
        return tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, the ones tokenizer.json's post-processor adds.

        Raises ValueError when `text` holds a lone surrogate (JSON "\\ud800" decodes to one), which has
        no UTF-8 form.
        """
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            if not isinstance(text, str):
                raise
            text.encode("utf-8")  # raises UnicodeEncodeError (a ValueError) naming the position
            raise

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`. A partial UTF-8 character decodes as U+FFFD; unknown ids are dropped."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: malformed JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(config: dict[str, Any], key: str, path: Path) -> str | None:
    """A special token given as a string or as an AddedToken dict {"content": ...}; None when absent."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{path}: {key} must be a string or a dict with a string 'content', got {value!r}")
    return value


def _first_ids(sources: list[tuple[dict[str, Any], str, Path]]) -> list[int] | None:
    """The ids under the first (config, key) that holds a non-null value: an int or a list of ints."""
    for config, key, path in sources:
        value = config.get(key)
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        # bool is an int subclass; `true` is never a token id.
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"{path}: {key} must be a non-negative int or a list of them, got {value!r}")
        return ids
    return None


def _chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """chat_template.jinja if present, else tokenizer_config's chat_template (a string, or a list of
    {"name", "template"} dicts of which the one named "default" is used)."""
    template_file = model_dir / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    value = tokenizer_config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    config_file = model_dir / TOKENIZER_CONFIG_FILE
    if not isinstance(value, list) or not all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    ):
        raise ValueError(f"{config_file}: chat_template must be a string or a list of {{name, template}} dicts")
    return next((t["template"] for t in value if t["name"] == "default"), None)
