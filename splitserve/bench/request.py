"""One benchmark request and the token ids its prompt is drawn from: what every dataset produces,
``splitserve.bench.datasets`` and ``splitserve.bench.mooncake`` alike (so neither imports the other's
module for them). Both names are also importable from ``splitserve.bench.datasets``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int
    arrival_s: float | None = None  # from a trace; None: the arrival process decides

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


@dataclass(frozen=True)
class TokenRange:
    """Token ids ``[low, high)`` that avoid the lowest ids (often control tokens, e.g. Mistral's) and
    the top of the vocabulary, where tokenizers put their special and EOS ids."""

    low: int
    high: int

    @classmethod
    def for_vocab(cls, vocab_size: int) -> TokenRange:
        if vocab_size < 128:
            raise ValueError(f"--vocab-size: must be at least 128, got {vocab_size}")
        return cls(vocab_size // 10, vocab_size - max(64, vocab_size // 100))

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        return rng.integers(self.low, self.high, size=n).tolist()
