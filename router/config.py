"""The router's settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from splitserve.rpc.security import InternalSecurity, PublicSecurity

Policy = Literal["prefix_aware", "least_loaded", "round_robin"]


@dataclass(frozen=True)
class RouterConfig:
    model_dir: str
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port
    model_name: str = ""  # reported by GetStatus; default: the model folder's name
    block_size: int = 16  # the workers' KV block size (prompt blocks are hashed with it for routing)
    routing_policy: Policy = "prefix_aware"
    overlap_weight: float = 16.0  # prefix_aware cost = overlap_weight x uncached blocks + queued prefill tokens
    prefill_credit: int = 16  # requests in flight per prefill worker (its max_inflight)
    max_queue: int = 1024  # requests waiting for dispatch; past it RESOURCE_EXHAUSTED
    lease_timeout_s: float = 30.0  # waiting for a decode worker with room, before UNAVAILABLE
    max_migrations: int = 3  # times a request may move after its decode worker was lost
    max_prefill_retries: int = 3  # times a request may be retried after its prefill worker was lost
    status_interval_s: float = 0.5  # worker status polls
    worker_timeout_s: float = 5.0  # a status poll, and a worker's first answer
    max_request_id_chars: int = 128
    max_message_bytes: int = 4 << 20  # largest request accepted; the transport refuses past twice it
    die_after_tokens: int = -1  # fault point (tests): the process exits instead of relaying more tokens than this
    internal_port: int = 0  # the port workers register on (Registry); 0: any free port
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: off, 0: any free port
    metrics_host: str | None = None  # the address /metrics binds; None: host
    openai_port: int | None = None  # the OpenAI-compatible HTTP API on the same host; None: off, 0: any free port
    public_security: PublicSecurity = field(default_factory=PublicSecurity)
    internal_security: InternalSecurity = field(default_factory=InternalSecurity)

    def __post_init__(self) -> None:
        if self.routing_policy not in ("prefix_aware", "least_loaded", "round_robin"):
            raise ValueError(
                f"routing_policy: {self.routing_policy!r} is not prefix_aware, least_loaded or round_robin"
            )
        for name in ("max_migrations", "max_prefill_retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("block_size", "prefill_credit", "max_queue", "max_request_id_chars", "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("lease_timeout_s", "status_interval_s", "worker_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.die_after_tokens < -1:
            raise ValueError(f"die_after_tokens: must be >= -1, got {self.die_after_tokens}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: must be null or 0 to 65535, got {self.metrics_port}")
        if self.openai_port is not None and not 0 <= self.openai_port <= 65535:
            raise ValueError(f"openai_port: must be a port number (0: any free port), got {self.openai_port}")
        if self.overlap_weight < 0:
            raise ValueError(f"overlap_weight: must be >= 0, got {self.overlap_weight}")
