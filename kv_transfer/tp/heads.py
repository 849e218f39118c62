"""Packing and unpacking part of a rank's KV heads, for transfers between workers of different TP sizes.

A rank's cache is ``[layers, blocks, 2, local_heads, block_size, head_dim]`` (or, ``spec.heads_outer``, vLLM's
CPU cache: each block heads first, a head's K and V one run); a transfer between ranks whose head ranges differ
moves only the heads both hold, ``[h0, h1)`` in the cache's local numbering, packed in the cache's own order
(both ends have the same layout: a vLLM worker's fingerprint, with vLLM's weights checksum, pairs only with
vLLM workers). When that is every local head, ``KVCache.gather_blocks``/``scatter_blocks`` do the work
unchanged (one contiguous run per (layer, block)); otherwise each (layer, block) row is selected whole
and the heads sliced out of it, which costs one more copy of the part moved.
"""

from __future__ import annotations

import torch

from splitserve.engine.kv_cache.cache import KVCache
from splitserve.kv_transfer.descriptor import LayoutFingerprint


def check_cache_heads(cache: KVCache, fingerprint: LayoutFingerprint) -> None:
    """Raise ValueError unless the cache holds exactly the heads the fingerprint says this rank holds."""
    if cache.spec.num_kv_heads != fingerprint.heads.count:
        raise ValueError(
            f"fingerprint: heads [{fingerprint.heads_start}, {fingerprint.heads_stop}) are "
            f"{fingerprint.heads.count}, but the KV cache holds {cache.spec.num_kv_heads}"
        )


def gather_heads(
    cache: KVCache, block_ids: torch.Tensor, layers: range, h0: int, h1: int, out: torch.Tensor
) -> torch.Tensor:
    """Heads ``[h0, h1)`` of the given blocks and layers, packed into ``out``:
    ``[len(layers), len(block_ids), 2, h1 - h0, block_size, head_dim]``."""
    spec = cache.spec
    if (h0, h1) == (0, spec.num_kv_heads):
        return cache.gather_blocks(block_ids, layers, out=out)
    rows = cache.row_index(block_ids, layers)
    if spec.heads_outer:  # each head one run of the row: [rows, h1 - h0, 2 * block_size * head_dim], strided
        part = cache.head_rows().index_select(0, rows)[:, h0:h1]
    else:
        part = cache.rows().index_select(0, rows)[:, :, h0:h1]  # [rows, 2, h1 - h0, block_size, head_dim], strided
    target = out.view(-1)[: part.numel()].view(part.shape)
    target.copy_(part)
    return target.view(len(layers), len(block_ids), 2, h1 - h0, spec.block_size, spec.head_dim)


def scatter_heads(cache: KVCache, block_ids: torch.Tensor, data: torch.Tensor, layers: range, h0: int, h1: int) -> None:
    """Write ``data`` (shaped as ``gather_heads`` returns it) into heads ``[h0, h1)`` of the given blocks."""
    spec = cache.spec
    if (h0, h1) == (0, spec.num_kv_heads):
        cache.scatter_blocks(block_ids, data, layers)
        return
    rows = cache.row_index(block_ids, layers)
    if spec.heads_outer:
        cache.head_rows()[rows, h0:h1] = data.reshape(rows.numel(), h1 - h0, 2 * spec.block_size * spec.head_dim)
    else:
        cache.rows()[rows, :, h0:h1] = data.reshape(rows.numel(), 2, h1 - h0, spec.block_size, spec.head_dim)
