"""The router's settings: those a deployment config sets (``router:``), and the runtime ones around them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from splitserve.common.faults import Faults
from splitserve.common.validate import check_choice, check_range, check_ranges
from splitserve.rpc.security import InternalSecurity, PublicSecurity

Policy = Literal["prefix_aware", "least_loaded", "round_robin"]
POLICIES: tuple[str, ...] = get_args(Policy)


@dataclass(frozen=True)
class RouterSettings:
    """The router's own knobs: the deployment config's ``router:`` section, as it is."""

    routing_policy: Policy = "prefix_aware"
    overlap_weight: float = 16.0  # prefix_aware cost = overlap_weight x uncached blocks + queued prefill tokens
    max_queue: int = 1024  # requests waiting for dispatch; past it RESOURCE_EXHAUSTED
    lease_timeout_s: float = 30.0  # waiting for a decode worker with room, before UNAVAILABLE
    max_migrations: int = 3  # times a request may move after its decode worker was lost
    max_prefill_retries: int = 3  # times a request may be retried after its prefill worker was lost
    # Conditional disaggregation (NVIDIA Dynamo's rule): a request is prefilled on a prefill worker only when
    # its uncached prompt is longer than local_prefill_max_tokens and the prefill queue holds fewer than
    # remote_prefill_max_queue_tokens uncached prompt tokens; otherwise its decode worker prefills it. 0: off.
    local_prefill_max_tokens: int = 0
    remote_prefill_max_queue_tokens: int = 0
    max_n: int = 16  # samples of one prompt a request may ask for (n); past it INVALID_ARGUMENT

    def __post_init__(self) -> None:
        check_choice(self, "routing_policy", POLICIES)
        check_range(self, "overlap_weight", min=0)
        check_range(self, "max_queue", min=1)
        check_range(self, "lease_timeout_s", above=0)
        check_ranges(self, ("max_migrations", "max_prefill_retries"), min=0)
        check_ranges(self, ("local_prefill_max_tokens", "remote_prefill_max_queue_tokens"), min=0)
        check_range(self, "max_n", min=1)


@dataclass(frozen=True)
class RouterConfig(RouterSettings):
    """Everything a router runs with: its settings, and what the deployment holds elsewhere (the model,
    the addresses, the engine's block size, the prefill role's credit, security, faults)."""

    model_dir: str = field(kw_only=True)
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port
    model_name: str = ""  # reported by GetStatus; default: the model folder's name
    block_size: int = 16  # the workers' KV block size (prompt blocks are hashed with it for routing)
    prefill_credit: int = 16  # requests in flight per prefill worker (its max_inflight)
    status_interval_s: float = 0.5  # worker status polls
    worker_timeout_s: float = 5.0  # a status poll, and a worker's first answer
    max_request_id_chars: int = 128
    max_message_bytes: int = 4 << 20  # largest request accepted; the transport refuses past twice it
    internal_port: int = 0  # the port workers register on (Registry); 0: any free port
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: off, 0: any free port
    metrics_host: str | None = None  # the address /metrics binds; None: host
    openai_port: int | None = None  # the OpenAI-compatible HTTP API on the same host; None: off, 0: any free port
    public_security: PublicSecurity = field(default_factory=PublicSecurity)
    internal_security: InternalSecurity = field(default_factory=InternalSecurity)
    faults: Faults = field(default_factory=Faults)  # the router's kill point (tests)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ranges(self, ("block_size", "prefill_credit", "max_request_id_chars", "max_message_bytes"), min=1)
        check_ranges(self, ("status_interval_s", "worker_timeout_s"), above=0)
        check_ranges(self, ("metrics_port", "openai_port"), min=0, max=65535)
