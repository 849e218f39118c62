"""Chat templates: a checkpoint's Jinja template rendered as transformers' ``apply_chat_template``
renders it, without transformers (the router is torch-free).

The template comes from the model folder (``chat_template.jinja``, else ``tokenizer_config.json``'s
``chat_template``; splitserve.engine.text.tokenizer reads both). It is the operator's code, run in jinja2's immutable
sandbox with what transformers provides: ``trim_blocks``, ``lstrip_blocks``, loop controls, a
``tojson`` that does not escape HTML, ``raise_exception``, ``strftime_now``, the ``{% generation %}``
tag, and the tokenizer's ``bos_token`` and ``eos_token``. Messages are the client's data: special
tokens written in their text stay special tokens when the rendered prompt is encoded (transformers'
and vLLM's default too), so a message can imitate a turn boundary.

The rendered text is encoded without adding special tokens (the template writes them), as
``apply_chat_template(tokenize=True)`` does.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from splitserve.engine.text.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    """The template cannot render these messages (or does not compile)."""


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; rendering
    only keeps its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None) -> None:
        try:
            self.template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token}

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> ChatTemplate | None:
        """The model's template, or None when its folder has none."""
        if not tokenizer.chat_template:
            return None
        return cls(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text; raises ChatTemplateError with the template's own message."""
        values = {
            **self.special_tokens,
            **kwargs,
            "messages": messages,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self.template.render(values)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise ChatTemplateError(str(e) or type(e).__name__) from None
