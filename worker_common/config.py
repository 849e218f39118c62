"""A worker's settings: one frozen dataclass, composed of the engine's and the transfer layer's."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from splitserve.common.faults import Faults
from splitserve.common.validate import check_choice, check_range
from splitserve.engine.core import EngineConfig
from splitserve.kv_transfer.config import TransferConfig
from splitserve.rpc.security import InternalSecurity
from splitserve.worker_common.affinity import check_cpu_set

# Requests one worker holds at once, by role (prefill, colocated: the router's credit; decode: leases):
# the one place these defaults live (the deployment file's roles and the worker CLI read them here).
MAX_INFLIGHT = {"prefill": 16, "decode": 128, "colocated": 64}


@dataclass(frozen=True)
class RankSettings:
    """What differs between the ranks of a tensor-parallel worker besides the rank itself (rank 0's are
    the ``WorkerConfig``'s own fields)."""

    faults: Faults = field(default_factory=Faults)
    cpus: tuple[int, ...] | None = None


@dataclass(frozen=True)
class WorkerConfig:
    role: Literal["prefill", "decode", "colocated"]
    worker_id: str
    engine: EngineConfig
    host: str = "127.0.0.1"  # the address this worker binds and advertises (reachable from the router and peers)
    port: int = 0  # gRPC port; 0 = any free port
    router_address: str = ""  # register with this router (host:port) and stay registered while alive
    model_name: str = ""  # part of the KV layout fingerprint; default: the model folder's name
    transfer: TransferConfig = field(default_factory=TransferConfig)
    max_inflight: int = MAX_INFLIGHT["prefill"]  # requests held at once (MAX_INFLIGHT: by role)
    node: str = ""  # where the worker runs (a Ray node id), for status
    faults: Faults = field(default_factory=Faults)  # this process's share of the deployment's fault plan (tests)
    security: InternalSecurity = field(default_factory=InternalSecurity)  # mTLS and the cluster token
    metrics_port: int | None = None  # Prometheus /metrics over HTTP on ``host``; None: off, 0: any free port
    log_format: Literal["text", "json"] = "text"  # the process's log lines (splitserve.observability.logs)
    # The cores this process pins itself to before its torch threads start (worker_common/affinity.py);
    # None: no pinning. engine.num_threads, when set, is at most len(cpus).
    cpus: tuple[int, ...] | None = None
    # A tensor-parallel worker (engine.tensor_parallel_size > 1): ranks 1 .. size-1, in order; () gives each
    # the defaults (no faults, no pinning).
    follower_ranks: tuple[RankSettings, ...] = ()

    def __post_init__(self) -> None:
        check_choice(self, "role", ("prefill", "decode", "colocated"))
        if not self.worker_id:
            raise ValueError("worker_id: must not be empty")
        check_range(self, "max_inflight", min=1)
        check_range(self, "metrics_port", min=0, max=65535)
        check_choice(self, "log_format", ("text", "json"))
        if self.cpus is not None:
            try:
                object.__setattr__(self, "cpus", check_cpu_set(self.cpus))
            except ValueError as e:
                raise ValueError(f"cpus: {e}") from None
            check_threads_fit(self.engine.num_threads, self.cpus)
        followers = self.engine.tensor_parallel_size - 1
        if self.follower_ranks and len(self.follower_ranks) != followers:
            raise ValueError(f"follower_ranks: {len(self.follower_ranks)} entries for {followers} follower ranks")

    def for_rank(self, rank: int) -> WorkerConfig:
        """The config of rank ``rank`` (>= 1) of this tensor-parallel worker: its engine rank, faults and cpus."""
        followers = self.engine.tensor_parallel_size - 1
        if not 1 <= rank <= followers:
            raise ValueError(f"rank: must be 1 to {followers}, got {rank}")
        settings = self.follower_ranks[rank - 1] if self.follower_ranks else RankSettings()
        return replace(
            self,
            engine=replace(self.engine, tensor_parallel_rank=rank),
            faults=settings.faults,
            cpus=settings.cpus,
            follower_ranks=(),
        )

    def restarted(self) -> WorkerConfig:
        """This config in a worker Ray restarted: its fault points that end a process fired already."""
        return replace(
            self,
            faults=self.faults.restarted(),
            follower_ranks=tuple(replace(r, faults=r.faults.restarted()) for r in self.follower_ranks),
        )


def check_threads_fit(threads: int | None, cpus: tuple[int, ...]) -> None:
    """More torch threads than pinned cpus would oversubscribe them: refused."""
    if threads is not None and threads > len(cpus):
        raise ValueError(
            f"threads: {threads} threads on {len(cpus)} pinned cpus oversubscribe them; "
            f"set threads <= {len(cpus)} or leave it null (one per cpu)"
        )
