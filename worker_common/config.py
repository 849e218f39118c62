"""A worker's settings: one frozen dataclass, composed of the engine's and the transfer layer's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from splitserve.engine.core import EngineConfig
from splitserve.kv_transfer.config import TransferConfig
from splitserve.rpc.security import InternalSecurity
from splitserve.worker_common.affinity import check_cpu_set


@dataclass(frozen=True)
class WorkerFaults:
    """Config-gated delays that hold requests in a phase, so tests can act on them there."""

    prefill_delay_s: float = 0.0  # prefill worker: sleep before every step that computes prompt tokens
    decode_step_delay_s: float = 0.0  # decode worker: sleep after every decode step
    # This worker's process exits at once (os._exit, as a crash would) at the start of its step number
    # ``die_after + 1`` of this kind: "prefill" (a step computing prompt tokens) or "decode". "": never.
    die_at: str = ""
    die_after: int = 0

    def __post_init__(self) -> None:
        for name in ("prefill_delay_s", "decode_step_delay_s", "die_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"faults.{name}: must be >= 0, got {getattr(self, name)}")
        if self.die_at not in ("", "prefill", "decode"):
            raise ValueError(f"faults.die_at: {self.die_at!r} is not '', 'prefill' or 'decode'")


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
    max_inflight: int = 16  # requests held at once: prefill, colocated: the router's credit; decode: leases
    node: str = ""  # where the worker runs (a Ray node id), for status
    faults: WorkerFaults = field(default_factory=WorkerFaults)
    security: InternalSecurity = field(default_factory=InternalSecurity)  # mTLS and the cluster token
    metrics_port: int | None = None  # Prometheus /metrics over HTTP on ``host``; None: off, 0: any free port
    log_format: Literal["text", "json"] = "text"  # the process's log lines (splitserve.observability.logs)
    # The cores this process pins itself to before its torch threads start (worker_common/affinity.py);
    # None: no pinning. engine.num_threads, when set, is at most len(cpus).
    cpus: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"role: {self.role!r} is not 'prefill', 'decode' or 'colocated'")
        if not self.worker_id:
            raise ValueError("worker_id: must not be empty")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight: must be >= 1, got {self.max_inflight}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: must be null or 0 to 65535, got {self.metrics_port}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format: {self.log_format!r} is not text or json")
        if self.cpus is not None:
            try:
                object.__setattr__(self, "cpus", check_cpu_set(self.cpus))
            except ValueError as e:
                raise ValueError(f"cpus: {e}") from None
            check_threads_fit(self.engine.num_threads, self.cpus)


def check_threads_fit(threads: int | None, cpus: tuple[int, ...]) -> None:
    """More torch threads than pinned cpus would oversubscribe them: refused."""
    if threads is not None and threads > len(cpus):
        raise ValueError(
            f"threads: {threads} threads on {len(cpus)} pinned cpus oversubscribe them; "
            f"set threads <= {len(cpus)} or leave it null (one per cpu)"
        )
