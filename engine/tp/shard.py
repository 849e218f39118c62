"""What one tensor-parallel rank holds of the model, Megatron-style; torch-free.

With ``t`` ranks, rank ``r`` holds (heads from ``splitserve.engine.tp.layout``):

- column-parallel (output rows split, no communication): the fused ``qkv_proj`` rows of its query
  heads and of its KV heads (a KV head replicated on ``t/H`` ranks when ``H < t``), and the fused
  ``gate_up_proj`` rows ``[r*I/t, (r+1)*I/t)`` of both gate and up;
- row-parallel (input columns split, one sum all-reduce after): ``o_proj`` over its query heads'
  columns and ``down_proj`` over its intermediate columns. Their bias is held by rank 0 only, so the
  all-reduce adds it exactly once;
- replicated: the embedding, the norms and the LM head (full logits on every rank).

``t = 1`` is the unsharded model: every range is the whole dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.tp.layout import HeadRange, check_tp_size, kv_head_range, query_head_range


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``tp_size``: its heads and MLP columns, and the checkpoint rows they come from."""

    tp_size: int
    rank: int
    head_dim: int
    q_heads: HeadRange
    kv_heads: HeadRange
    intermediate: range  # this rank's columns of the MLP's intermediate dimension

    @classmethod
    def for_model(cls, cfg: ModelConfig, tp_size: int = 1, rank: int = 0) -> TPShard:
        """Raise ValueError naming ``tensor_parallel_size`` (or ``tensor_parallel_rank``) unless the model
        splits into ``tp_size`` whole shards."""
        check_tp_size(cfg.num_heads, cfg.num_kv_heads, tp_size)
        if not 0 <= rank < tp_size:
            raise ValueError(f"tensor_parallel_rank: must be 0 to {tp_size - 1}, got {rank}")
        if cfg.intermediate_size % tp_size:
            raise ValueError(
                f"tensor_parallel_size: {tp_size} does not divide the model's intermediate size {cfg.intermediate_size}"
            )
        per_rank = cfg.intermediate_size // tp_size
        return cls(
            tp_size=tp_size,
            rank=rank,
            head_dim=cfg.head_dim,
            q_heads=query_head_range(cfg.num_heads, tp_size, rank),
            kv_heads=kv_head_range(cfg.num_kv_heads, tp_size, rank),
            intermediate=range(rank * per_rank, (rank + 1) * per_rank),
        )

    @property
    def is_sharded(self) -> bool:
        return self.tp_size > 1

    @property
    def num_heads(self) -> int:
        return self.q_heads.count

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads.count

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def intermediate_size(self) -> int:
        return len(self.intermediate)

    @property
    def holds_row_parallel_bias(self) -> bool:
        """Whether this rank adds ``o_proj``'s and ``down_proj``'s bias (rank 0: once per all-reduce)."""
        return self.rank == 0

    def q_rows(self) -> range:
        """This rank's rows of the checkpoint's ``q_proj`` (and its columns of ``o_proj``)."""
        return range(self.q_heads.start * self.head_dim, self.q_heads.stop * self.head_dim)

    def kv_rows(self) -> range:
        """This rank's rows of the checkpoint's ``k_proj`` and ``v_proj`` (a replicated head's, too)."""
        return range(self.kv_heads.start * self.head_dim, self.kv_heads.stop * self.head_dim)
