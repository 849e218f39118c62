"""Rank 0's KV endpoint when a hand-off has several parts: the sender and receiver of the worker as a whole.

Each has the interface of the plain endpoint it wraps (``KVSender``, ``KVReceiver``), keyed by request id,
so the prefill and decode workers read the same at every TP size. A hand-off between a worker of TP ``p``
and one of TP ``d`` is one part per receiving rank (``rank_transfer_id``), sent by the ranks holding its
heads (``sends_for``); rank 0 moves its own parts and mirrors its followers' (``Handoff``). At TP 1 to TP 1
``TPSender.start`` is the plain ``KVSender.start`` of the request's own id, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from splitserve.common.errors import ServingError
from splitserve.engine.tp.step import Notice, PlanChannel
from splitserve.kv_transfer.descriptor import Commit
from splitserve.kv_transfer.handles import TransferHandle
from splitserve.kv_transfer.receiver import KVReceiver
from splitserve.kv_transfer.sender import KVSender, PeerAddress, SendHandle
from splitserve.kv_transfer.tp.handoff import Handoff, RemotePart
from splitserve.kv_transfer.tp.parts import rank_transfer_id, sends_for
from splitserve.worker_common.tp import rank_notices
from splitserve.worker_common.tp.rank_link import FollowerLink, Ranks


class TPSender:
    """A prefill worker's sends. ``start`` runs on the loop thread (it may send a notice on the plan channel,
    which only the loop thread uses); the rest from any thread."""

    def __init__(self, sender: KVSender, num_kv_heads: int, ranks: Ranks | None, channel: PlanChannel | None) -> None:
        if ranks is not None and channel is None:
            raise ValueError("channel: a tensor-parallel sender tells its ranks over the plan channel")
        self.sender, self.num_kv_heads, self.ranks, self.channel = sender, num_kv_heads, ranks, channel
        self._handoffs: dict[str, Handoff] = {}
        self._lock = threading.Lock()

    @property
    def incarnation(self) -> str:
        return self.sender.incarnation

    @property
    def tp_size(self) -> int:
        return self.ranks.size if self.ranks is not None else 1

    def start(
        self, request_id: str, destinations: Sequence[PeerAddress], block_ids: Sequence[int], num_tokens: int
    ) -> TransferHandle:
        """Start moving a request's KV to the receiving worker's ranks (``destinations``, rank 0 first)."""
        p, d = self.tp_size, len(destinations)
        if p == 1 and d == 1:
            return self.sender.start(request_id, destinations[0], block_ids, num_tokens)
        parts: list[TransferHandle] = [
            self.sender.start(
                rank_transfer_id(request_id, pair.receiver_rank, d),
                destinations[pair.receiver_rank],
                block_ids,
                num_tokens,
                heads=pair.heads,
            )
            for pair in sends_for(self.num_kv_heads, p, 0, d)
        ]
        links = self.ranks.links if self.ranks is not None else []
        remote = [
            link.watch(rank_transfer_id(request_id, pair.receiver_rank, d))
            for link in links
            for pair in sends_for(self.num_kv_heads, p, link.rank, d)
        ]
        if remote:  # before the step's plan: the ranks stream their layer groups during its forward
            notice = rank_notices.StartSends(request_id, tuple(block_ids), num_tokens, tuple(destinations))
            self.channel.send(Notice(rank_notices.encode(notice)))
        handoff = Handoff(request_id, parts + remote, self._end_part)
        with self._lock:
            self._handoffs[request_id] = handoff
        return handoff

    def layers_ready(self, handle: TransferHandle, num_layers: int) -> None:
        for part in self._local(handle):
            self.sender.layers_ready(part, num_layers)

    def finish(self, handle: TransferHandle, commit: Commit | None = None) -> None:
        """All layers computed on rank 0: its parts queue the rest, with the commit (the other ranks finish
        their parts after their own forward)."""
        for part in self._local(handle):
            self.sender.finish(part, commit)

    def cancel(self, request_id: str, reason: str = "cancelled by the sender") -> None:
        handoff = self._handoffs.get(request_id)
        if handoff is None:
            self.sender.cancel(request_id, reason)
        else:
            handoff.end(reason)

    def release(self, request_id: str) -> None:
        """Forget a request's transfer (cancelling what is still live)."""
        with self._lock:
            handoff = self._handoffs.pop(request_id, None)
        if handoff is None:
            self.sender.release(request_id)
            return
        handoff.end("released")
        for part in self._local(handoff):
            self.sender.release(part.transfer_id)

    def has_transfer(self, request_id: str) -> bool:
        return request_id in self._handoffs or self.sender.has_transfer(request_id)

    def num_pairs(self) -> int:
        return self.sender.num_pairs()

    def num_transfers(self) -> int:
        """Transfers registered at rank 0's own endpoint (its parts, or plain transfers), not the hand-offs."""
        return self.sender.num_transfers()

    def close(self) -> None:
        self.sender.close()

    def _local(self, handle: TransferHandle) -> list[SendHandle]:
        parts = handle.parts if isinstance(handle, Handoff) else (handle,)
        return [p for p in parts if isinstance(p, SendHandle)]

    def _end_part(self, part: TransferHandle, reason: str) -> None:
        if isinstance(part, RemotePart):
            _link(self.ranks, part).release(part.transfer_id, reason)
        else:
            self.sender.cancel(part.transfer_id, reason)


class TPReceiver:
    """A tensor-parallel decode worker's receives (TP > 1): rank 0 expects its part, each follower its own,
    into the same block ids."""

    def __init__(self, receiver: KVReceiver, ranks: Ranks) -> None:
        self.receiver, self.ranks = receiver, ranks
        self._handoffs: dict[str, Handoff] = {}
        self._lock = threading.Lock()

    @property
    def incarnation(self) -> str:
        return self.receiver.incarnation

    def expect(self, request_id: str, block_ids: Sequence[int], timeout_s: float | None = None) -> Handoff:
        """Expect every rank's part; raises ValueError (an id still here) or ServingError (a rank failed)."""
        d = self.ranks.size
        parts: list[TransferHandle] = [self.receiver.expect(rank_transfer_id(request_id, 0, d), block_ids, timeout_s)]
        try:
            for link in self.ranks.links:
                parts.append(link.expect(rank_transfer_id(request_id, link.rank, d), block_ids, timeout_s or 0.0))
        except ServingError:
            for part in parts:
                self._end_part(part, "another rank could not expect its part")
            self.receiver.release(parts[0].transfer_id)
            raise
        handoff = Handoff(request_id, parts, self._end_part)
        with self._lock:
            self._handoffs[request_id] = handoff
        return handoff

    def cancel(self, request_id: str, reason: str = "cancelled by the receiver") -> None:
        handoff = self._handoffs.get(request_id)
        if handoff is not None:
            handoff.end(reason)

    def release(self, request_id: str) -> None:
        with self._lock:
            handoff = self._handoffs.pop(request_id, None)
        if handoff is not None:
            handoff.end("released")
        self.receiver.release(rank_transfer_id(request_id, 0, self.ranks.size))

    def has_transfer(self, request_id: str) -> bool:
        return request_id in self._handoffs or self.receiver.has_transfer(
            rank_transfer_id(request_id, 0, self.ranks.size)
        )

    def destinations(self, rank0: PeerAddress) -> list[PeerAddress]:
        """Every rank's endpoint, rank 0 first, for the lease grant."""
        return [rank0, *(link.info.peer for link in self.ranks.links)]

    def num_pairs(self) -> int:
        return self.receiver.num_pairs()

    def close(self) -> None:
        self.receiver.close()

    def _end_part(self, part: TransferHandle, reason: str) -> None:
        if isinstance(part, RemotePart):
            _link(self.ranks, part).release(part.transfer_id, reason)
        else:
            self.receiver.cancel(part.transfer_id, reason)


def _link(ranks: Ranks | None, part: RemotePart) -> FollowerLink:
    assert ranks is not None, "a remote part without ranks"
    return ranks.links[part.rank - 1]
