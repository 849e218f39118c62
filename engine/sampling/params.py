"""Sampling parameters: what a request asks for, validated once at the edge.

Torch-free: the router validates with the same class before a request reaches any worker.
Defaults follow vLLM's ``SamplingParams`` (and so OpenAI's API where they overlap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

#: Bounds on stop strings, so one request cannot make stop matching expensive for everyone.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
#: The most top entries a request may ask for per position (vLLM's default ``max_logprobs``; OpenAI's limit).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprobs:
    """What ``logprobs`` and ``prompt_logprobs`` return for one position (computed by
    ``splitserve.engine.sampling.logprobs``; defined here, torch-free, for the wire): the token there, its
    log-probability and rank (1: the most likely token), and the ``k`` most likely tokens as (token id,
    log-probability), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; ``field`` names it (the router maps this to INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    - ``temperature == 0`` is greedy decoding; the filters below then do not matter.
    - ``top_k``: keep the k most likely tokens (0 or -1: all). ``top_p``: keep the smallest set whose
      probability reaches p. ``min_p``: drop tokens below ``min_p`` times the top probability.
    - ``seed``: makes sampling reproducible. The random draw for the token at position n comes from a
      generator keyed by (seed, n), so a request's output never depends on its batch neighbours and a
      request moved to another worker continues the same stream. Unseeded requests get a random seed.
    - Penalties as in vLLM: ``repetition_penalty`` (> 1 discourages) over prompt and output tokens;
      ``presence_penalty`` and ``frequency_penalty`` (OpenAI semantics) over output tokens.
    - Stops: ``max_tokens`` new tokens, any EOS id of the model (unless ``ignore_eos``), any of
      ``stop_token_ids``, or a ``stop`` string (matched on detokenized text, never shown to the client
      unless ``include_stop_str_in_output``). ``min_tokens`` suppresses EOS and stop ids until reached.
    - Log-probabilities (``splitserve.engine.sampling.logprobs``: of the raw logits, as vLLM's default):
      ``logprobs`` k returns, for each generated token, its own and the k most likely tokens'; ``prompt_logprobs``
      k the same for each prompt token but the first. None: not computed. k is at most ``MAX_LOGPROBS``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers; store tuples so the params stay hashable and immutable.
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamsError naming the first bad field."""
        _int("max_tokens", self.max_tokens, low=1)
        _float("temperature", self.temperature, low=0.0)
        _float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p}")
        _int("top_k", self.top_k, low=-1)
        _float("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _int("seed", self.seed, low=-(2**63), high=2**64 - 1)
        _float("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0.0:
            raise SamplingParamsError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        _float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), low=0, high=MAX_LOGPROBS)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop", "stop strings must be non-empty strings")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise SamplingParamsError("stop", f"a stop string is longer than {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, low=0, high=None if vocab_size is None else vocab_size - 1)

    @classmethod
    def from_dict(cls, values: dict) -> SamplingParams:
        """Build from a plain dict, refusing unknown keys by name."""
        known = {f.name for f in fields(cls)}
        for key in values:
            if key not in known:
                raise SamplingParamsError(key, "unknown sampling parameter")
        return cls(**values)


def _int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"must be an integer, got {value!r}")
    if low is not None and value < low:
        raise SamplingParamsError(name, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise SamplingParamsError(name, f"must be <= {high}, got {value}")


def _float(name: str, value: object, low: float | None = None, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamsError(name, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise SamplingParamsError(name, f"must be finite, got {value}")
    if low is not None and value < low:
        raise SamplingParamsError(name, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise SamplingParamsError(name, f"must be <= {high}, got {value}")
