"""The deployment config of ``splitserve serve``: read once, validated with errors naming the field.

A YAML file (``--config``) holds any subset of the settings; command-line flags override it.
``cluster_configs/local.yaml`` lists every setting with its default and meaning (it is the embedded
default: loading it gives ``DeploymentConfig()``); ``cluster_configs/gpu-cluster.yaml`` and
``onprem-cpu.yaml`` are examples for real clusters.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from splitserve.engine.core import DECODE_PATHS
from splitserve.engine.linear_tuner import LINEAR_KERNELS
from splitserve.kv_transfer.config import FaultPoint, TransferConfig
from splitserve.observability.logs import LOG_FORMATS
from splitserve.router.config import RouterConfig
from splitserve.rpc.security import InternalSecurity, PublicSecurity
from splitserve.worker_common.affinity import CpuSet, format_cpu_list, parse_cpu_sets, thread_count
from splitserve.worker_common.config import WorkerFaults, check_threads_fit


class ConfigError(ValueError):
    """The deployment config is invalid; the message names the field."""


@dataclass(frozen=True)
class RoleConfig:
    replicas: int = 1
    # Torch threads per worker (and OMP_NUM_THREADS); None: one per cpu of `cpus`, else torch's default.
    threads: int | None = None
    # The cores each worker pins its process to (worker_common/affinity.py). One set ([0, 1] or "0-1"):
    # every replica shares it; several ("0-1|2-3" as vLLM's VLLM_CPU_OMP_THREADS_BIND, or [[0, 1], [2, 3]]):
    # replica i gets set i, and there are at least as many sets as replicas. None: no pinning.
    cpus: tuple[CpuSet, ...] | None = None
    # Requests one worker holds at once. prefill: the router's credit (before the first token);
    # decode: leases (decoding or waiting for KV); colocated: the credit, held to the end.
    max_inflight: int = 16
    num_blocks: int | None = None  # this role's KV blocks; None: engine.num_blocks (or kv_cache_bytes)
    num_cpus: float | None = None  # Ray CPUs each worker reserves; None: len(its cpus) when pinned, else 0
    num_gpus: float = 0.0  # Ray GPUs each worker reserves (use 1 with device: cuda)
    # Custom Ray resources each worker needs. None: the default convention, 1 unit of
    # splitserve_prefill / splitserve_decode where the cluster has that resource, else nothing.
    resources: dict | None = None
    # Ray node labels the worker's node must carry, e.g. {"splitserve-role": "decode"} for nodes
    # started with ``ray start --labels splitserve-role=decode``. None: no label constraint.
    label_selector: dict | None = None
    max_restarts: int = 3  # times Ray restarts a lost worker (-1: forever); it re-registers when back

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {self.replicas}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads}")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight: must be >= 1, got {self.max_inflight}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {self.num_blocks}")
        for name in ("num_cpus", "num_gpus"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.cpus is not None:
            try:
                object.__setattr__(self, "cpus", parse_cpu_sets(self.cpus))
            except ValueError as e:
                raise ValueError(f"cpus: {e}") from None
            if 1 < len(self.cpus) < self.replicas:
                raise ValueError(
                    f"cpus: {len(self.cpus)} sets for {self.replicas} replicas; give one set (shared by "
                    f"all) or one per replica"
                )
            for cpus in self.cpus:
                check_threads_fit(self.threads, cpus)
        if self.resources is not None and not all(
            isinstance(k, str) and isinstance(v, (int, float)) and v >= 0 for k, v in self.resources.items()
        ):
            raise ValueError(f"resources: must map resource names to amounts >= 0, got {self.resources!r}")
        if self.label_selector is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.label_selector.items()
        ):
            raise ValueError(f"label_selector: must map label names to strings, got {self.label_selector!r}")
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts: must be >= -1, got {self.max_restarts}")

    @property
    def max_pinned_replicas(self) -> int | None:
        """The most replicas the cpu sets can bind (one set each); None: any number."""
        return len(self.cpus) if self.cpus is not None and len(self.cpus) > 1 else None

    def cpu_set(self, slot: int) -> CpuSet | None:
        """The cores of the worker in this slot (0 .. replicas - 1); None: not pinned."""
        if self.cpus is None:
            return None
        return self.cpus[0] if len(self.cpus) == 1 else self.cpus[slot]

    def worker_threads(self, slot: int) -> int | None:
        return thread_count(self.threads, self.cpu_set(slot))

    def worker_num_cpus(self, slot: int) -> float:
        """Ray CPUs the worker in this slot reserves: num_cpus if set, else one per pinned cpu."""
        if self.num_cpus is not None:
            return self.num_cpus
        cpus = self.cpu_set(slot)
        return float(len(cpus)) if cpus else 0.0

    def describe_cpus(self) -> str:
        """``cpus`` as written in vLLM's form, "0-1|2-3"; "" when not pinned."""
        return "|".join(format_cpu_list(c) for c in self.cpus) if self.cpus else ""


@dataclass(frozen=True)
class EngineSettings:
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 512 << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int | None = None
    linear_kernel: str = "auto"  # auto (timed per weight shape at load, cached) | plain | packed | split
    linear_split_allowed: bool | None = None  # None: split allowed when a worker's linear weights <= RAM / 4
    decode_path: str = "auto"  # splitserve.engine.core.DECODE_PATHS
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ValueError(f"linear_kernel: must be one of {', '.join(LINEAR_KERNELS)}, got {self.linear_kernel!r}")
        if self.decode_path not in DECODE_PATHS:
            raise ValueError(f"decode_path: must be one of {', '.join(DECODE_PATHS)}, got {self.decode_path!r}")


@dataclass(frozen=True)
class RouterSettings:
    routing_policy: str = "prefix_aware"
    overlap_weight: float = 16.0
    max_queue: int = 1024
    lease_timeout_s: float = 30.0
    max_migrations: int = 3
    max_prefill_retries: int = 3


_KILL_PHASES = {
    "prefill": ("prefill", "transfer"),
    "decode": ("transfer", "decode"),
    "colocated": ("prefill", "decode"),
    "router": ("decode",),
}


@dataclass(frozen=True)
class KillPoint:
    """End one process at once (``os._exit``, as a crash would) at a chosen point, to reach each fault
    deterministically. ``target``: a worker id (``prefill-0``, ``decode-1``, ``colocated-0``) or
    ``router`` (the ``serve`` process). ``at``/``after``: a worker dies as its step number ``after + 1``
    of that phase starts (``prefill``, ``decode``), or after ``after`` KV payload messages of a transfer
    (``transfer``: the prefill worker as sender, the decode worker as receiver); the router dies instead of relaying
    more than ``after`` tokens in all (``decode``). A worker's kill point fires in its first incarnation only:
    the process Ray restarts runs clean."""

    target: str
    at: str
    after: int = 0

    def __post_init__(self) -> None:
        role = "router" if self.target == "router" else self.target.rpartition("-")[0]
        if role not in _KILL_PHASES or (role != "router" and not self.target.rpartition("-")[2].isdigit()):
            raise ValueError(f"target: {self.target!r} is not 'router' or a worker id such as 'decode-0'")
        if self.at not in _KILL_PHASES[role]:
            raise ValueError(f"at: a {role} dies at {' or '.join(_KILL_PHASES[role])}, not {self.at!r}")
        if self.after < 0:
            raise ValueError(f"after: must be >= 0, got {self.after}")


@dataclass(frozen=True)
class Faults:
    prefill_delay_s: float = 0.0
    decode_step_delay_s: float = 0.0
    transfer: tuple[FaultPoint, ...] = ()
    kill: tuple[KillPoint, ...] = ()


@dataclass(frozen=True)
class SecuritySettings:
    """TLS, mTLS and tokens (docs/security.md). Paths are read where used: the router reads the
    public ones and every process the internal ones, so internal files must exist on every node."""

    tls_cert: str | None = None  # the public port's certificate chain (PEM); with tls_key: TLS
    tls_key: str | None = None
    tls_client_ca: str | None = None  # clients must present a certificate signed by this CA
    api_keys: tuple[str, ...] = ()  # bearer tokens accepted on the public API
    api_key_file: str | None = None  # more of them, one a line
    internal_tls_cert: str | None = None  # mTLS on every internal link (all three, or none)
    internal_tls_key: str | None = None
    internal_tls_ca: str | None = None
    internal_tls_server_name: str = "splitserve-internal"  # the name internal certificates carry
    cluster_token: str | None = None  # required on every internal call (and for Admin.Scale)
    cluster_token_file: str | None = None

    def __post_init__(self) -> None:
        for i, key in enumerate(self.api_keys):
            if not key or key != key.strip() or any(c.isspace() for c in key):
                raise ValueError(f"api_keys[{i}]: must be a non-empty string without whitespace")
        if self.cluster_token is not None and (not self.cluster_token or any(c.isspace() for c in self.cluster_token)):
            raise ValueError("cluster_token: must be a non-empty string without whitespace")
        self.public(), self.internal()  # their checks name the settings

    def public(self) -> PublicSecurity:
        return PublicSecurity(self.tls_cert, self.tls_key, self.tls_client_ca, self.api_keys, self.api_key_file)

    def internal(self) -> InternalSecurity:
        return InternalSecurity(
            self.internal_tls_cert,
            self.internal_tls_key,
            self.internal_tls_ca,
            self.internal_tls_server_name,
            self.cluster_token,
            self.cluster_token_file,
        )


@dataclass(frozen=True)
class DeploymentConfig:
    model: str | None = None
    model_name: str = ""
    dtype: str = "auto"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 50051
    internal_port: int = 0  # the router's port for workers (registration); 0: any free port
    openai_port: int | None = None  # the OpenAI-compatible HTTP API on `host`; None: off, 0: any free port
    ray_address: str | None = None
    worker_host: str | None = None  # address workers bind and advertise; None: 127.0.0.1 on an embedded
    # Ray, else each node's IP as Ray knows it
    ready_timeout_s: float = 300.0  # workers must have registered by then
    # Prometheus /metrics over HTTP (docs/metrics.md). None: off; otherwise the router serves it on this
    # port (0: any free port) and every worker on a free port of its own address.
    metrics_port: int | None = None
    metrics_host: str | None = None  # the address the router's /metrics binds; None: host
    log_format: str = "text"  # text | json (one JSON object a line, with request_id), router and workers
    # disaggregated: prefill and decode workers; colocated: workers that run both phases in one
    # continuous batch (the baseline disaggregation is measured against)
    mode: str = "disaggregated"
    prefill: RoleConfig = field(default_factory=RoleConfig)
    decode: RoleConfig = field(default_factory=lambda: RoleConfig(max_inflight=128))
    colocated: RoleConfig = field(default_factory=lambda: RoleConfig(max_inflight=64))
    engine: EngineSettings = field(default_factory=EngineSettings)
    router: RouterSettings = field(default_factory=RouterSettings)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    faults: Faults = field(default_factory=Faults)
    security: SecuritySettings = field(default_factory=SecuritySettings)

    def __post_init__(self) -> None:
        from splitserve.engine.loader import canonical_dtype

        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))  # vLLM's names; the canonical one kept
        if self.mode not in MODES:
            raise ValueError(f"mode: {self.mode!r} is not {' or '.join(MODES)}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format: {self.log_format!r} is not {' or '.join(LOG_FORMATS)}")

    @property
    def roles(self) -> tuple[str, ...]:
        """The worker roles this deployment runs."""
        return MODES[self.mode]

    @classmethod
    def from_file(cls, path: str | Path) -> DeploymentConfig:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{path}: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeploymentConfig:
        config = _build(cls, raw, "")
        try:
            config.router_config(model_dir="")
        except ValueError as e:
            raise ConfigError(f"router.{e}") from None
        return config

    def with_overrides(self, **overrides: Any) -> DeploymentConfig:
        """Command-line overrides: ``None`` leaves the config's value."""
        values = {k: v for k, v in overrides.items() if v is not None}
        roles = {}
        for role in ("prefill", "decode", "colocated"):
            changes = {
                name: values.pop(key)
                for name, key in (("replicas", f"num_{role}"), ("cpus", f"{role}_cpus"))
                if key in values
            }
            if changes:
                try:
                    roles[role] = replace(getattr(self, role), **changes)
                except ValueError as e:
                    raise ConfigError(f"{role}.{e}") from None
        return replace(self, **values, **roles)

    def router_config(self, model_dir: str) -> RouterConfig:
        r = self.router
        return RouterConfig(
            model_dir=model_dir,
            host=self.host,
            port=self.port,
            model_name=self.model_name,
            block_size=self.engine.block_size,
            routing_policy=r.routing_policy,
            overlap_weight=r.overlap_weight,
            prefill_credit=getattr(self, self.roles[0]).max_inflight,
            max_queue=r.max_queue,
            lease_timeout_s=r.lease_timeout_s,
            max_migrations=r.max_migrations,
            max_prefill_retries=r.max_prefill_retries,
            die_after_tokens=self.router_die_after_tokens,
            internal_port=self.internal_port,
            metrics_port=self.metrics_port,
            metrics_host=self.metrics_host,
            openai_port=self.openai_port,
            public_security=self.security.public(),
            internal_security=self.security.internal(),
        )

    def worker_faults(self, worker_id: str) -> tuple[WorkerFaults, tuple[FaultPoint, ...]]:
        """This worker's step faults, and the KV-transfer fault points it runs with."""
        f = self.faults
        kills = [k for k in f.kill if k.target == worker_id]
        step = next((k for k in kills if k.at != "transfer"), None)
        role = "sender" if worker_id.startswith("prefill") else "receiver"
        transfer = f.transfer + tuple(FaultPoint(role, "die", k.after) for k in kills if k.at == "transfer")
        return WorkerFaults(
            f.prefill_delay_s, f.decode_step_delay_s, step.at if step else "", step.after if step else 0
        ), transfer

    @property
    def router_die_after_tokens(self) -> int:
        return next((k.after for k in self.faults.kill if k.target == "router"), -1)


MODES = {"disaggregated": ("prefill", "decode"), "colocated": ("colocated",)}
_NESTED = {
    "prefill": RoleConfig,
    "decode": RoleConfig,
    "colocated": RoleConfig,
    "engine": EngineSettings,
    "router": RouterSettings,
    "transfer": TransferConfig,
    "faults": Faults,
    "security": SecuritySettings,
}


def _build(cls, raw: dict[str, Any], prefix: str):
    known = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"{name}: unknown setting (known: {', '.join(sorted(known))})")
        if key in _NESTED and cls in (DeploymentConfig,):
            if not isinstance(value, dict):
                raise ConfigError(f"{name}: must be a mapping")
            values[key] = _build(_NESTED[key], value, f"{name}.")
        elif cls is RoleConfig and key == "cpus":
            values[key] = value  # RoleConfig parses its forms (worker_common/affinity.py)
        elif cls is Faults and key in ("transfer", "kill"):
            if not isinstance(value, list) or not all(isinstance(point, dict) for point in value):
                raise ConfigError(f"{name}: must be a list of fault points (mappings)")
            point_cls = FaultPoint if key == "transfer" else KillPoint
            try:
                values[key] = tuple(point_cls(**point) for point in value)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{name}: {e}") from None
        else:
            values[key] = _check_type(name, value, known[key].type)
    try:
        return cls(**values)
    except ValueError as e:
        raise ConfigError(f"{prefix}{e}") from None


def _check_type(name: str, value: Any, annotation: str) -> Any:
    allowed = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "dict": (dict,)}
    if str(annotation) == "tuple[str, ...]":
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(f"{name}: expected a list of strings, got {value!r}")
    parts = [p.strip() for p in str(annotation).split("|")]
    if value is None:
        if "None" in parts:
            return None
        raise ConfigError(f"{name}: must not be null")
    for part in parts:
        kinds = allowed.get(part)
        if kinds and isinstance(value, kinds) and not (part != "bool" and isinstance(value, bool)):
            return float(value) if part == "float" else value
    if any(p.startswith("Literal") for p in parts) and isinstance(value, str):
        return value
    raise ConfigError(f"{name}: expected {annotation}, got {value!r}")
