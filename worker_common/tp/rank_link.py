"""Rank 0 of a tensor-parallel worker and its other ranks (the followers).

Rank 0 owns the scheduler, the block manager and the worker's gRPC server; every step it broadcasts the
step's plan on the ranks' own process group (``TPGroup``, ``splitserve.engine.tp.step``) and all ranks run
the same forward on their shards. KV transfers are per rank: each rank moves its own heads
(``splitserve.kv_transfer.tp.parts``). What is not ordered with the steps goes over gRPC, each follower serving
``TensorParallelRank`` to rank 0 (``splitserve.worker_common.tp.follower``):

    rank 0 ──Expect(part, blocks)──▶ follower   a decode rank leases nothing: rank 0's block ids hold
           ──Release(part)────────▶             end a part (cancel it if live)
           ◀──Events: part ended────            one stream per follower, open for the group's life

A follower's events stream that breaks means the rank is gone: every part it held fails and
``Ranks.on_lost`` fires (the worker then fails as a whole: ``WorkerBase.group_failed``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from splitserve.engine.tp.distributed import TPGroup
from splitserve.kv_transfer.handles import TransferState
from splitserve.kv_transfer.sender import PeerAddress
from splitserve.kv_transfer.tp.handoff import RemotePart
from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc import workers_pb2_grpc as wpb_grpc
from splitserve.rpc.options import CLIENT_OPTIONS
from splitserve.rpc.security import InternalSecurity
from splitserve.rpc.status import from_status

log = logging.getLogger("splitserve.worker")

GROUP_FAILED_EXIT = 75  # a rank's exit status when its tensor-parallel group failed (Ray restarts the worker)
RANK_RPC_TIMEOUT_S = 5.0  # Expect and Release between the ranks of one worker (one node)


@dataclass(frozen=True, order=True)
class RankInfo:
    """A follower rank as it started: where its TensorParallelRank service is, and (a decode rank) its KV
    receiver's id and incarnation, which the lease grant passes to the prefill ranks."""

    rank: int
    address: str
    receiver_id: str = ""
    incarnation: str = ""

    @property
    def peer(self) -> PeerAddress:
        return PeerAddress(self.receiver_id, self.incarnation, self.address)


class FollowerLink:
    """Rank 0's end of one follower: its parts in flight, and the calls to it."""

    def __init__(
        self, info: RankInfo, group_id: str, security: InternalSecurity, on_lost: Callable[[str], None]
    ) -> None:
        self.rank, self.info = info.rank, info
        self._on_lost = on_lost
        self._channel = security.channel(info.address, CLIENT_OPTIONS)
        self._stub = wpb_grpc.TensorParallelRankStub(self._channel)
        self._parts: dict[str, RemotePart] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._events = self._stub.Events(wpb.RankEventsRequest(group=group_id))
        threading.Thread(target=self._read, name=f"rank{info.rank}-events", daemon=True).start()

    def watch(self, part_id: str) -> RemotePart:
        """A part this rank moves, registered before the rank can report it."""
        part = RemotePart(part_id, self.rank)
        with self._lock:
            if self._closed:
                part.report(TransferState.FAILED, f"rank {self.rank} is gone")
            else:
                self._parts[part_id] = part
        return part

    def expect(self, part_id: str, block_ids: Sequence[int], timeout_s: float) -> RemotePart:
        """A decode rank: expect this part into these blocks; returns once it does. Raises ServingError."""
        part = self.watch(part_id)
        try:
            self._stub.Expect(
                wpb.RankExpect(transfer_id=part_id, block_ids=block_ids, timeout_s=timeout_s),
                timeout=RANK_RPC_TIMEOUT_S,
            )
        except grpc.RpcError as e:
            with self._lock:
                self._parts.pop(part_id, None)
            part.report(TransferState.FAILED, f"rank {self.rank} did not expect it: {e.code().name}")
            self.release(part_id, "expect failed")
            raise from_status(e.code(), f"tensor-parallel rank {self.rank}: {e.details()}") from None
        return part

    def release(self, part_id: str, reason: str) -> None:
        """End a part on the rank (it reports how it ended); does not wait. A lost rank is noticed by its
        events stream, not here."""
        if not self._closed:
            future = self._stub.Release.future(
                wpb.RankRelease(transfer_id=part_id, reason=reason), timeout=RANK_RPC_TIMEOUT_S
            )
            future.add_done_callback(lambda f: None)  # errors are the events stream's to report

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._events.cancel()
        self._channel.close()

    def _read(self) -> None:
        try:
            for event in self._events:
                with self._lock:
                    part = self._parts.pop(event.transfer_id, None)
                if part is not None:
                    part.report(_state(event.state), event.error, event.bytes)
            reason = "its events stream ended"
        except grpc.RpcError as e:
            reason = f"its events stream broke ({e.code().name}: {e.details()})"
        with self._lock:
            closed, self._closed = self._closed, True
            parts, self._parts = list(self._parts.values()), {}
        for part in parts:
            part.report(TransferState.FAILED, f"tensor-parallel rank {self.rank} lost: {reason}")
        if not closed:
            self._on_lost(f"tensor-parallel rank {self.rank}: {reason}")


def _state(name: str) -> TransferState:
    try:
        state = TransferState(name)
    except ValueError:
        return TransferState.FAILED
    return state if state.terminal else TransferState.FAILED


class Ranks:
    """Rank 0's view of its worker's ranks: the group, and (once ``connect``ed) a link to every other rank,
    in rank order. The ranks build their shards at the same time; rank 0 connects once they have."""

    def __init__(
        self, group: TPGroup, group_id: str, security: InternalSecurity, rendezvous: tuple[str, int] | None = None
    ) -> None:
        """``rendezvous``: (host, port) of the store the group formed on (the vllm backend's ranks meet there too)."""
        self.group, self.group_id, self.security, self.rendezvous = group, group_id, security, rendezvous
        self.on_lost: Callable[[str], None] = lambda reason: log.error("%s", reason)
        self.links: list[FollowerLink] = []

    def connect(self, followers: Sequence[RankInfo]) -> None:
        """Link to the other ranks, each started (``Follower.start``) and described by its ``RankInfo``."""
        if sorted(f.rank for f in followers) != list(range(1, self.group.size)):
            raise ValueError(f"followers: ranks {[f.rank for f in followers]} for a group of {self.group.size}")
        self.links = [FollowerLink(info, self.group_id, self.security, self._lost) for info in sorted(followers)]

    @property
    def size(self) -> int:
        return self.group.size

    def _lost(self, reason: str) -> None:
        self.on_lost(reason)

    def close(self) -> None:
        for link in self.links:
            link.close()
