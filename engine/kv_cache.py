"""The paged KV cache: one preallocated tensor of fixed-size blocks shared by all requests.

Layout: ``[num_layers, num_blocks, 2 (K, V), num_kv_heads, block_size, head_dim]``.

Within a layer, one block's keys and values for every head are one contiguous run of memory
(``2 * kv_heads * block_size * head_dim`` elements), so gathering a batch's scattered blocks for
attention reads few, large runs: measured here, twice as fast as gathering K and V per head from
separate regions. Token ``t`` of a request lives in block ``block_table[t // block_size]`` at offset
``t % block_size``.

A block's data is ``cache[:, block]`` (every layer, K and V, every head), which is what moves between
workers; ``gather_blocks``/``scatter_blocks`` pack and unpack it, optionally for a range of layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model_config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return cls(model.num_layers, model.num_kv_heads, model.head_dim, num_blocks, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * elem

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_blocks, 2, self.num_kv_heads, self.block_size, self.head_dim)


class KVCache:
    def __init__(self, spec: KVCacheSpec, device: torch.device | str) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.tensor = torch.zeros(spec.shape, dtype=spec.dtype, device=self.device)

    def layer(self, layer: int) -> torch.Tensor:
        """One layer's cache: ``[num_blocks, 2, kv_heads, block_size, head_dim]``."""
        return self.tensor[layer]

    def gather_blocks(self, block_ids: torch.Tensor, layers: slice = slice(None)) -> torch.Tensor:
        """Copy the given blocks of the given layers out: ``[layers, len(block_ids), 2, kv_heads, bs, hd]``."""
        return self.tensor[layers].index_select(1, block_ids.to(self.device))

    def scatter_blocks(self, block_ids: torch.Tensor, data: torch.Tensor, layers: slice = slice(None)) -> None:
        """Write ``data`` (as returned by ``gather_blocks``) into the given blocks."""
        self.tensor[layers].index_copy_(1, block_ids.to(self.device), data.to(self.tensor.dtype))


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    """Store new keys/values ``[T, kv_heads, head_dim]`` of one layer at (block, offset) per token."""
    cache[blocks, 0, :, offsets] = k
    cache[blocks, 1, :, offsets] = v


def context_rows(block_ids: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Row indices that gather blocks straight into attention's layout (see ``gather_context``).

    Viewing one layer's cache as rows of ``block_size * head_dim`` elements (one block, K or V, one
    head), block ``b``'s K/V for head ``h`` is row ``(b * 2 + kv) * num_kv_heads + h``. Ordering the
    rows (kv, head, block) makes a single ``index_select`` produce ``[2, kv_heads, blocks, bs, d]``.
    """
    kv_head = torch.arange(2 * num_kv_heads, device=block_ids.device).view(2, num_kv_heads, 1)
    return (block_ids.view(1, 1, -1) * (2 * num_kv_heads) + kv_head).reshape(-1)


def gather_context(cache: torch.Tensor, rows: torch.Tensor, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``num_seqs`` equal-length block tables, from ``context_rows`` of them.

    Returns two ``[kv_heads, num_seqs, blocks_per_seq * block_size, head_dim]`` tensors (one copy, no
    transpose: measured here, a third faster than gathering blocks and then permuting them).
    """
    num_blocks, _, heads, block_size, head_dim = cache.shape
    gathered = cache.view(num_blocks * 2 * heads, block_size * head_dim).index_select(0, rows)
    gathered = gathered.view(2, heads, num_seqs, -1, head_dim)
    return gathered[0], gathered[1]
