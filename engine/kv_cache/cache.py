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

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.tp.layout import kv_head_range


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    dtype: torch.dtype
    # How a block's row is laid out: False, this package's ``[2, kv_heads, block_size, head_dim]``; True, heads
    # outermost (``[kv_heads, block_size * 2 * head_dim]``, vLLM's CPU cache, wrapped for its connector), where
    # a head's K and V are one contiguous run (``head_rows``).
    heads_outer: bool = False

    @classmethod
    def for_model(
        cls,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        tp_size: int = 1,
        rank: int = 0,
    ) -> KVCacheSpec:
        """The cache of tensor-parallel rank ``rank`` of ``tp_size``: it holds only that rank's KV heads."""
        num_kv_heads = kv_head_range(model.num_kv_heads, tp_size, rank).count
        return cls(model.num_layers, num_kv_heads, model.head_dim, num_blocks, block_size, dtype)

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

    @classmethod
    def wrap(cls, spec: KVCacheSpec, tensor: torch.Tensor) -> KVCache:
        """A cache over memory that another engine allocated (vLLM's, for its connector), ``spec.shape``
        elements laid out as this class lays them out: a block's row is moved whole, never read by head
        unless the two ends' layouts match."""
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype or not tensor.is_contiguous():
            raise ValueError(
                f"tensor: {tuple(tensor.shape)} {tensor.dtype} is not a contiguous {spec.shape} {spec.dtype}"
            )
        cache = cls.__new__(cls)
        cache.spec, cache.device, cache.tensor = spec, tensor.device, tensor
        return cache

    def layer(self, layer: int) -> torch.Tensor:
        """One layer's cache: ``[num_blocks, 2, kv_heads, block_size, head_dim]``."""
        return self.tensor[layer]

    def row_index(self, block_ids: torch.Tensor, layers: range) -> torch.Tensor:
        """The row of each (layer, block) pair in ``rows()``, layer-major (the order ``gather_blocks`` packs
        them in): ``[len(layers) * len(block_ids)]``, on the cache's device."""
        layer_ids = torch.arange(layers.start, layers.stop, device=self.device)
        return (layer_ids[:, None] * self.spec.num_blocks + block_ids.to(self.device)[None, :]).reshape(-1)

    def rows(self) -> torch.Tensor:
        """The cache with one row per (layer, block): ``[num_layers * num_blocks, 2, kv_heads, block_size,
        head_dim]``, a view (a write lands in the cache). What moves only some of a block's heads selects
        rows with ``row_index`` and slices dimension 2 (``splitserve.kv_transfer.tp.heads``)."""
        spec = self.spec
        return self.tensor.view(-1, 2, spec.num_kv_heads, spec.block_size, spec.head_dim)

    def head_rows(self) -> torch.Tensor:
        """A heads-outer cache (``spec.heads_outer``) with one row per (layer, block) and one run per head:
        ``[num_layers * num_blocks, kv_heads, 2 * block_size * head_dim]``, a view."""
        spec = self.spec
        if not spec.heads_outer:
            raise ValueError("head_rows: this cache keeps K and V apart in a block ([2, kv_heads, ...]): use rows()")
        return self.tensor.view(-1, spec.num_kv_heads, 2 * spec.block_size * spec.head_dim)

    def gather_blocks(
        self, block_ids: torch.Tensor, layers: range | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Copy blocks out: ``[len(layers), len(block_ids), 2, kv_heads, block_size, head_dim]``.

        One ``index_select`` over (layer, block) rows: measured here, it is 2x faster than selecting on
        the block dimension of a 6-d tensor, and writing into a reused ``out`` (same dtype, enough
        elements) avoids page-faulting fresh memory, which costs more than the copy for large sets.
        """
        layers = layers or range(self.spec.num_layers)
        rows = self.row_index(block_ids, layers)
        flat = self.tensor.view(-1, self._row_elems)
        shape = (len(layers), len(block_ids), *self.spec.shape[2:])
        if out is None:
            return flat.index_select(0, rows).view(shape)
        target = out.view(-1)[: rows.numel() * self._row_elems].view(rows.numel(), self._row_elems)
        torch.index_select(flat, 0, rows, out=target)
        return target.view(shape)

    def scatter_blocks(self, block_ids: torch.Tensor, data: torch.Tensor, layers: range | None = None) -> None:
        """Write ``data`` (shaped as ``gather_blocks`` returns it) into the given blocks."""
        layers = layers or range(self.spec.num_layers)
        rows = self.row_index(block_ids, layers)
        self.tensor.view(-1, self._row_elems).index_copy_(0, rows, data.reshape(rows.numel(), self._row_elems))

    @property
    def _row_elems(self) -> int:
        return 2 * self.spec.num_kv_heads * self.spec.block_size * self.spec.head_dim


def write_kv(
    cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
) -> None:
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
