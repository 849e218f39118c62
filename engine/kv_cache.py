"""The paged KV cache: one preallocated tensor of fixed-size blocks shared by all requests.

Layout: ``[num_layers, 2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]``.

Heads sit outside blocks so that gathering a batch's blocks for decode attention
(``index_select`` on the block dim) directly yields ``[kv_heads, batch, context, head_dim]``, the
operand layout of a batched matmul, with no transpose copy. Token ``t`` of a request lives at
*slot* ``block_table[t // block_size] * block_size + t % block_size``.

A block's data is ``cache[:, :, :, block]`` (every layer, K and V, every head), which is what moves
between workers; ``gather_blocks``/``scatter_blocks`` pack and unpack it.
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
        return (self.num_layers, 2, self.num_kv_heads, self.num_blocks, self.block_size, self.head_dim)


class KVCache:
    def __init__(self, spec: KVCacheSpec, device: torch.device | str) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.tensor = torch.zeros(spec.shape, dtype=spec.dtype, device=self.device)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each ``[kv_heads, num_blocks, block_size, head_dim]``."""
        return self.tensor[layer, 0], self.tensor[layer, 1]

    def gather_blocks(self, block_ids: torch.Tensor, layers: slice = slice(None)) -> torch.Tensor:
        """Copy the given blocks of the given layers out: ``[layers, 2, kv_heads, len(block_ids), bs, hd]``."""
        return self.tensor[layers].index_select(3, block_ids.to(self.device))

    def scatter_blocks(self, block_ids: torch.Tensor, data: torch.Tensor, layers: slice = slice(None)) -> None:
        """Write ``data`` (as returned by ``gather_blocks``) into the given blocks."""
        self.tensor[layers].index_copy_(3, block_ids.to(self.device), data.to(self.tensor.dtype))


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values ``[T, kv_heads, head_dim]`` at their slots in one layer's cache."""
    heads, _, _, head_dim = k_cache.shape
    k_cache.view(heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))
