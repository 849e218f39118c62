"""Which transfers a KV hand-off between tensor-parallel workers is made of. Torch-free.

A hand-off from a worker of TP size ``p`` to one of size ``d`` is one transfer per receiving rank,
with its own id (``rank_transfer_id``): the receiving rank expects that id in its own leased blocks,
and every sending rank that holds some of its heads (``sends_for``) starts that id towards it with
those heads. A receiving rank's transfer is DONE once each of its heads has landed once, whichever
ranks sent them; the hand-off is done when every receiving rank's transfer is. At TP 1 to TP 1 this is
one transfer with the request's own id, exactly as before.
"""

from __future__ import annotations

from splitserve.engine.tp.layout import TransferPair, transfer_pairs


def rank_transfer_id(transfer_id: str, receiver_rank: int, receiver_tp: int) -> str:
    """The id of the part of hand-off ``transfer_id`` that receiving rank ``receiver_rank`` gets."""
    if not 0 <= receiver_rank < receiver_tp:
        raise ValueError(f"receiver_rank: must be 0 to {receiver_tp - 1}, got {receiver_rank}")
    return transfer_id if receiver_tp == 1 else f"{transfer_id}@kv{receiver_rank}"


def sends_for(num_kv_heads: int, sender_tp: int, sender_rank: int, receiver_tp: int) -> tuple[TransferPair, ...]:
    """The transfers sending rank ``sender_rank`` starts: one per receiving rank it feeds, with the heads
    it sends there (none for a rank whose heads another holder of a replicated head sends)."""
    if not 0 <= sender_rank < sender_tp:
        raise ValueError(f"sender_rank: must be 0 to {sender_tp - 1}, got {sender_rank}")
    return tuple(p for p in transfer_pairs(num_kv_heads, sender_tp, receiver_tp) if p.sender_rank == sender_rank)
