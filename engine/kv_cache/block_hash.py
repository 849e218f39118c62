"""Stable, chained hashes of full KV-cache blocks: the prefix-cache key.

Torch-free on purpose: the router imports this module to compute the same hashes as the workers, so
it can tell which prefill worker already holds a prompt's prefix.

A block's hash covers its own token ids and, through ``parent_hash``, every token before it, so equal
hashes mean equal prefixes, not just equal blocks. The value depends only on the token ids (never on
Python's per-process ``hash()`` salt, the platform's byte order or the process), so every process on
every node agrees.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence

#: Parent hash of a sequence's first block.
ROOT_HASH = 0

_MAX_TOKEN_ID = 2**32 - 1


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash one block of token ids chained onto ``parent_hash``; returns an unsigned 64-bit int."""
    if any(t < 0 or t > _MAX_TOKEN_ID for t in token_ids):
        raise ValueError(f"token ids must lie in [0, 2**32); got {list(token_ids)!r}")
    payload = struct.pack(f"<QI{len(token_ids)}I", parent_hash, len(token_ids), *token_ids)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def iter_block_hashes(token_ids: Sequence[int], block_size: int, parent_hash: int = ROOT_HASH) -> Iterator[int]:
    """Yield the chained hash of every *full* block of ``token_ids`` (a trailing partial block has none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size])
        yield parent_hash


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of all full blocks of ``token_ids``, first block first."""
    return list(iter_block_hashes(token_ids, block_size))
