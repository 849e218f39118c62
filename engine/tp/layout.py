"""Which attention heads each rank of a tensor-parallel worker holds. Torch-free.

A worker of tensor-parallel size ``t`` splits every layer's query heads evenly: rank ``r`` holds query
heads ``[r*Q/t, (r+1)*Q/t)``. KV heads follow their query groups so that each rank holds whole heads:

- ``kv_heads >= t``: rank ``r`` holds KV heads ``[r*H/t, (r+1)*H/t)`` (``t`` divides ``H``);
- ``kv_heads < t``: each KV head is replicated on ``t/H`` consecutive ranks (``H`` divides ``t``), and
  rank ``r`` holds the one head ``r // (t/H)``, as vLLM does.

The KV cache of a rank holds exactly its KV heads, so a KV transfer between workers of different sizes
moves, for each pair of ranks whose ranges overlap, the overlapping heads (``transfer_pairs``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadRange:
    """KV heads ``[start, stop)`` of the model, as held by one rank."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"heads: [{self.start}, {self.stop}) is not a non-empty range")

    @property
    def count(self) -> int:
        return self.stop - self.start

    def overlap(self, other: HeadRange) -> HeadRange | None:
        start, stop = max(self.start, other.start), min(self.stop, other.stop)
        return HeadRange(start, stop) if start < stop else None


def check_tp_size(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Raise ValueError naming ``tensor_parallel_size`` unless ``tp_size`` splits the model into whole heads."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {tp_size}")
    if num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size: {tp_size} does not divide the model's {num_heads} attention heads")
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        raise ValueError(f"tensor_parallel_size: {tp_size} does not divide the model's {num_kv_heads} KV heads")
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size: {tp_size} is not a multiple of the model's {num_kv_heads} KV heads "
            "(each KV head must be replicated on a whole number of ranks)"
        )


def query_head_range(num_heads: int, tp_size: int, rank: int) -> HeadRange:
    """The query heads rank ``rank`` of ``tp_size`` computes."""
    per_rank = num_heads // tp_size
    return HeadRange(rank * per_rank, (rank + 1) * per_rank)


def kv_head_range(num_kv_heads: int, tp_size: int, rank: int) -> HeadRange:
    """The KV heads rank ``rank`` of ``tp_size`` holds (one replicated head when ``num_kv_heads < tp_size``)."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank: must be 0 to {tp_size - 1}, got {rank}")
    if num_kv_heads >= tp_size:
        per_rank = num_kv_heads // tp_size
        return HeadRange(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (tp_size // num_kv_heads)
    return HeadRange(head, head + 1)


@dataclass(frozen=True)
class TransferPair:
    """One (sender rank, receiver rank) pair of a KV transfer and the heads it moves."""

    sender_rank: int
    receiver_rank: int
    heads: HeadRange


def transfer_pairs(num_kv_heads: int, sender_tp: int, receiver_tp: int) -> tuple[TransferPair, ...]:
    """The pairs a KV transfer from a worker of size ``sender_tp`` to one of size ``receiver_tp`` uses.

    Every receiver rank gets each of its heads exactly once: from the first sender rank that holds it
    (a replicated head is sent by one of its holders only), so no head moves twice to the same rank."""
    pairs: list[TransferPair] = []
    for receiver in range(receiver_tp):
        wanted = kv_head_range(num_kv_heads, receiver_tp, receiver)
        for sender in range(sender_tp):
            shared = wanted.overlap(kv_head_range(num_kv_heads, sender_tp, sender))
            if shared is None or any(
                p.receiver_rank == receiver and p.heads.overlap(shared) is not None for p in pairs
            ):
                continue
            pairs.append(TransferPair(sender, receiver, shared))
    return tuple(pairs)
