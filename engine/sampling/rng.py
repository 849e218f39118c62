"""Counter-based randomness for sampling: one uniform draw per (seed, position).

A request's draw for the token at position n is a pure function of (seed, n): it does not depend on
which other requests share the batch, on the device, or on the process, so a request re-prefilled on
another worker (preemption, migration) keeps producing the same stream. Torch-free.
"""

from __future__ import annotations

import secrets

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_uniform(seed: int, position: int) -> float:
    """A uniform float in [0, 1) determined by (seed, position) alone, with 53 random bits."""
    x = _splitmix64((seed & _MASK64) ^ _splitmix64(position & _MASK64))
    return (x >> 11) * (1.0 / (1 << 53))


def sample_seed(seed: int, sample: int) -> int:
    """The seed of sample ``sample`` of a request with ``n`` > 1 samples: ``seed + sample`` modulo 2**64, so
    sample 0 is the request's own stream and each sample equals a single request with its seed."""
    return (seed + sample) & _MASK64


def random_seed() -> int:
    """A fresh seed for a request that did not ask for one."""
    return secrets.randbits(63)
