"""The deployment config of ``splitserve serve``: read once, validated with errors naming the field.

A YAML file (``--config``) holds any subset of the settings; command-line flags override it.
``cluster_configs/local.yaml`` lists every setting with its default and meaning (it is the embedded
default: loading it gives ``DeploymentConfig()``); ``cluster_configs/gpu-cluster.yaml`` and
``onprem-cpu.yaml`` are examples for real clusters.
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_origin

import yaml

from splitserve.common.faults import FaultPlan, FaultPoint, KillPoint
from splitserve.common.validate import check_choice, check_range, check_ranges, field_default
from splitserve.deploy.planner_settings import PlannerSettings
from splitserve.engine.core import ENGINE_BACKENDS, EngineConfig, EngineSettings
from splitserve.kv_transfer.config import TransferConfig
from splitserve.observability.logs import LOG_FORMATS
from splitserve.router.config import RouterConfig, RouterSettings
from splitserve.rpc.security import InternalSecurity, PublicSecurity
from splitserve.worker_common.affinity import CpuSet, parse_cpu_sets, thread_count
from splitserve.worker_common.config import MAX_INFLIGHT, WorkerConfig, check_threads_fit

__all__ = [
    "ConfigError",
    "DeploymentConfig",
    "EngineSettings",
    "FaultPlan",
    "KillPoint",
    "RoleConfig",
    "RouterSettings",
    "SecuritySettings",
]


OMP_WAIT_POLICIES = ("auto", "default", "passive", "active")


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
    max_inflight: int = MAX_INFLIGHT["prefill"]  # each role's own default: DeploymentConfig's fields
    num_blocks: int | None = None  # this role's KV blocks; None: engine.num_blocks (or kv_cache_bytes)
    num_cpus: float | None = None  # Ray CPUs each worker reserves; None: len(its cpus) when pinned, else 0
    # Ray GPUs each rank reserves. None: one with device cuda (else Ray hides the GPUs from the worker), none
    # on cpu; an explicit 0 with device cuda is refused.
    num_gpus: float | None = None
    # Custom Ray resources each worker needs. None: the default convention, 1 unit of
    # splitserve_prefill / splitserve_decode where the cluster has that resource, else nothing.
    resources: dict | None = None
    # Ray node labels the worker's node must carry, e.g. {"splitserve-role": "decode"} for nodes
    # started with ``ray start --labels splitserve-role=decode``. None: no label constraint.
    label_selector: dict | None = None
    max_restarts: int = 3  # times Ray restarts a lost worker (-1: forever); it re-registers when back
    # Processes (one per device) each worker spans, placed together on one node by a Ray placement group;
    # each holds 1/tensor_parallel_size of every layer (docs/engine.md). With cpus, each worker's set is
    # split evenly among its ranks; threads, num_cpus and num_gpus are per rank.
    tensor_parallel_size: int = 1
    # The engine this role's workers run: splitserve | vllm (docs/engine.md); None: the engine section's backend.
    backend: str | None = None
    # How the worker's OpenMP threads wait between parallel regions (OMP_WAIT_POLICY of its processes):
    # default: libgomp's own (spin a few milliseconds, then sleep; the operator's OMP_WAIT_POLICY if set),
    # passive: sleep at once, active: spin until the next region; auto: default for a worker whose cores
    # are its own (DeploymentConfig.owns_cores), else passive. docs/engine.md, "A worker's threads".
    omp_wait_policy: str = "auto"
    # GOMP_SPINCOUNT of its processes: how many turns (one pause instruction each) a waiting OpenMP thread spins
    # before it sleeps; with `active`, a bounded spin (e.g. decode: active, 10000). None: libgomp's own.
    omp_spin_count: int | None = None

    def __post_init__(self) -> None:
        check_ranges(self, ("replicas", "threads", "max_inflight", "num_blocks", "tensor_parallel_size"), min=1)
        if self.backend is not None:
            check_choice(self, "backend", ENGINE_BACKENDS)
        check_choice(self, "omp_wait_policy", OMP_WAIT_POLICIES)
        check_range(self, "omp_spin_count", min=0)
        check_ranges(self, ("num_cpus", "num_gpus"), min=0)
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
            tp = self.tensor_parallel_size
            for cpus in self.cpus:
                if len(cpus) % tp:
                    raise ValueError(
                        f"cpus: a set of {len(cpus)} cpus does not split evenly among tensor_parallel_size {tp} ranks"
                    )
                check_threads_fit(self.threads, cpus[: len(cpus) // tp])
        if self.resources is not None and not all(
            isinstance(k, str) and isinstance(v, (int, float)) and v >= 0 for k, v in self.resources.items()
        ):
            raise ValueError(f"resources: must map resource names to amounts >= 0, got {self.resources!r}")
        if self.label_selector is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.label_selector.items()
        ):
            raise ValueError(f"label_selector: must map label names to strings, got {self.label_selector!r}")
        check_range(self, "max_restarts", min=-1)

    @property
    def max_pinned_replicas(self) -> int | None:
        """The most replicas the cpu sets can bind (one set each); None: any number."""
        return len(self.cpus) if self.cpus is not None and len(self.cpus) > 1 else None

    def cpu_set(self, slot: int, rank: int = 0) -> CpuSet | None:
        """The cores of rank ``rank`` of the worker in this slot (0 .. replicas - 1): its share of the slot's
        set (the whole set without tensor parallelism); None: not pinned."""
        if self.cpus is None:
            return None
        cpus = self.cpus[0] if len(self.cpus) == 1 else self.cpus[slot]
        share = len(cpus) // self.tensor_parallel_size
        return cpus[rank * share : (rank + 1) * share]

    def worker_env(self, slot: int, owns_cores: bool = False) -> dict[str, str]:
        """The OpenMP environment of each rank of the worker in this slot; ``owns_cores``: no other worker
        runs on its cores (``DeploymentConfig.owns_cores``), which ``auto`` reads."""
        policy = self.omp_wait_policy
        if policy == "auto":
            policy = "default" if owns_cores else "passive"
        env = {} if policy == "default" else {"OMP_WAIT_POLICY": policy.upper()}
        if self.omp_spin_count is not None:
            env["GOMP_SPINCOUNT"] = str(self.omp_spin_count)
        threads = self.worker_threads(slot)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)  # Ray's default for actors is 1
        return env

    def worker_threads(self, slot: int) -> int | None:
        """Torch threads of each rank of the worker in this slot."""
        return thread_count(self.threads, self.cpu_set(slot))

    def worker_num_cpus(self, slot: int) -> float:
        """Ray CPUs each rank of the worker in this slot reserves: num_cpus if set, else one per pinned cpu."""
        if self.num_cpus is not None:
            return self.num_cpus
        cpus = self.cpu_set(slot)
        return float(len(cpus)) if cpus else 0.0

    def worker_num_gpus(self, device: str) -> float:
        """Ray GPUs each rank of a worker reserves on ``device``: num_gpus if set, else 1 on cuda, 0 on cpu."""
        if self.num_gpus is not None:
            return self.num_gpus
        return 1.0 if device.startswith("cuda") else 0.0


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


def _values(settings: Any) -> dict[str, Any]:
    """A settings dataclass's fields, to build the runtime config that extends it (shallow: nested
    values stay the objects they are)."""
    return {f.name: getattr(settings, f.name) for f in fields(settings)}


@dataclass(frozen=True)
class DeploymentConfig:
    """One deployment: the top-level settings, one section per role, and the engine's, router's,
    transfer's, faults' and security settings, each the dataclass of that layer. Top-level settings
    that a runtime config holds take their defaults from it."""

    model: str | None = None
    model_name: str = field_default(WorkerConfig, "model_name")
    dtype: str = field_default(EngineConfig, "dtype")
    device: str = field_default(EngineConfig, "device")
    host: str = field_default(RouterConfig, "host")
    port: int = field_default(RouterConfig, "port")
    internal_port: int = field_default(RouterConfig, "internal_port")  # the router's port for workers; 0: any free port
    openai_port: int | None = field_default(RouterConfig, "openai_port")  # the OpenAI-compatible HTTP API on `host`;
    # None: off, 0: any free port
    ray_address: str | None = None
    worker_host: str | None = None  # address workers bind and advertise; None: 127.0.0.1 on an embedded
    # Ray, else each node's IP as Ray knows it
    ready_timeout_s: float = 300.0  # workers must have registered by then
    # Prometheus /metrics over HTTP (docs/metrics.md). None: off; otherwise the router serves it on this
    # port (0: any free port) and every worker on a free port of its own address.
    metrics_port: int | None = field_default(RouterConfig, "metrics_port")
    metrics_host: str | None = field_default(RouterConfig, "metrics_host")  # the router's /metrics address; None: host
    log_format: str = field_default(WorkerConfig, "log_format")  # text | json (one JSON object a line, with request_id)
    # disaggregated: prefill and decode workers; colocated: workers that run both phases in one
    # continuous batch (the baseline disaggregation is measured against)
    mode: str = "disaggregated"
    prefill: RoleConfig = field(default_factory=lambda: RoleConfig(max_inflight=MAX_INFLIGHT["prefill"]))
    decode: RoleConfig = field(default_factory=lambda: RoleConfig(max_inflight=MAX_INFLIGHT["decode"]))
    colocated: RoleConfig = field(default_factory=lambda: RoleConfig(max_inflight=MAX_INFLIGHT["colocated"]))
    engine: EngineSettings = field(default_factory=EngineSettings)
    router: RouterSettings = field(default_factory=RouterSettings)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    faults: FaultPlan = field(default_factory=FaultPlan)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    planner: PlannerSettings = field(default_factory=PlannerSettings)  # the live planner (off by default)

    def __post_init__(self) -> None:
        from splitserve.engine.model.loader import canonical_dtype

        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))  # vLLM's names; the canonical one kept
        check_choice(self, "mode", MODES)
        check_choice(self, "log_format", LOG_FORMATS)
        if self.device.startswith("cuda"):
            for role in self.roles:
                if getattr(self, role).num_gpus == 0:
                    raise ValueError(
                        f"{role}.num_gpus: 0 with device {self.device!r}: Ray would hide the GPUs from the "
                        "worker; leave it unset (one GPU per rank) or give each rank a share above 0"
                    )
        self._check_backends()
        if self.planner.enabled and self.mode != "disaggregated":
            raise ValueError("planner.enabled: the live planner sizes prefill and decode (mode disaggregated)")

    def backend(self, role: str) -> str:
        """The engine backend of this role's workers: its own ``backend``, else the engine section's."""
        return getattr(self, role).backend or self.engine.backend

    def _check_backends(self) -> None:
        """Prefill and decode run the same backend: a splitserve prefill worker cannot feed a vLLM decode worker,
        nor the reverse (their KV layouts differ: block sizes, vLLM's packing of a block)."""
        if self.mode == "disaggregated" and self.backend("prefill") != self.backend("decode"):
            named = [f"{r}.backend" for r in ("prefill", "decode") if getattr(self, r).backend] or ["engine.backend"]
            prefill, decode = self.backend("prefill"), self.backend("decode")
            raise ValueError(
                f"{' and '.join(named)}: prefill runs {prefill!r} and decode {decode!r}; "
                "their KV layouts differ (block size, vLLM's packing of a block), so one cannot feed the other: "
                "give both roles the same backend"
            )

    @property
    def roles(self) -> tuple[str, ...]:
        """The worker roles this deployment runs."""
        return MODES[self.mode]

    def owns_cores(self, role: str, slot: int) -> bool:
        """Whether the worker in this slot of this role has its cores to itself, as configured: it is the
        deployment's only worker process (one role, one replica, one rank), or it is pinned and every other
        worker is pinned to cores apart from its own (each replica of its role to a set of its own). A worker
        started later by scaling keeps what its own start found."""
        role_configs = {r: getattr(self, r) for r in self.roles}
        processes = sum(c.replicas * c.tensor_parallel_size for c in role_configs.values())
        if processes == 1:
            return True
        mine = role_configs[role]
        if mine.cpus is None or (len(mine.cpus) == 1 and mine.replicas > 1) or mine.tensor_parallel_size > 1:
            return False
        own = set(mine.cpu_set(slot))
        for other_role, config in role_configs.items():
            if config.cpus is None:
                return False
            for other_slot in range(config.replicas):
                if (other_role, other_slot) != (role, slot) and own & set(
                    config.cpus[min(other_slot, len(config.cpus) - 1)]
                ):
                    return False
        return True

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
        try:  # the router's checks of the top-level settings it takes (metrics_port, ...)
            config.router_config(model_dir="")
        except ValueError as e:
            raise ConfigError(f"router.{e}") from None
        return config

    def with_overrides(self, **overrides: Any) -> DeploymentConfig:
        """Command-line overrides: ``None`` leaves the config's value."""
        values = {k: v for k, v in overrides.items() if v is not None}
        if "backend" in values:  # --backend: every role's engine (a role's own backend gives way to it)
            backend = values.pop("backend")
            values["engine"] = replace(self.engine, backend=backend)
            values.update(
                {role: replace(getattr(self, role), backend=None) for role in ("prefill", "decode", "colocated")}
            )
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
        """The router's runtime config: its ``router:`` settings, and what it takes from the rest."""
        return RouterConfig(
            **_values(self.router),
            model_dir=model_dir,
            host=self.host,
            port=self.port,
            model_name=self.model_name,
            block_size=self.engine.block_size,
            prefill_credit=getattr(self, self.roles[0]).max_inflight,
            internal_port=self.internal_port,
            metrics_port=self.metrics_port,
            metrics_host=self.metrics_host,
            openai_port=self.openai_port,
            public_security=self.security.public(),
            internal_security=self.security.internal(),
            faults=self.faults.for_router(),
        )

    def engine_config(self, model_dir: str, role: str, slot: int = 0) -> EngineConfig:
        """The engine config of the worker of this role in this replica slot."""
        role_config = getattr(self, role)
        return EngineConfig(
            **{
                **_values(self.engine),
                "num_blocks": role_config.num_blocks or self.engine.num_blocks,
                "backend": self.backend(role),
                # decode requests arrive with their KV: nothing to reuse
                "enable_prefix_caching": self.engine.enable_prefix_caching and role != "decode",
            },
            model_dir=model_dir,
            dtype=self.dtype,
            device=self.device,
            num_threads=role_config.worker_threads(slot),
            tensor_parallel_size=role_config.tensor_parallel_size,
            # Rank 0 schedules and sends each step's plan: the other ranks own no requests.
            tensor_parallel_step="plan" if role_config.tensor_parallel_size > 1 else "lockstep",
        )

    def check_model(self, model_dir: str) -> None:
        """Raise ConfigError naming ``<role>.tensor_parallel_size`` when a role's size does not split the
        model in ``model_dir`` into whole heads and MLP columns (before any worker starts)."""
        from splitserve.engine.model.config import ModelConfig
        from splitserve.engine.tp.shard import TPShard

        model = ModelConfig.from_model_dir(model_dir)
        for role in self.roles:
            try:
                TPShard.for_model(model, getattr(self, role).tensor_parallel_size, 0)
            except ValueError as e:
                raise ConfigError(f"{role}.{e}") from None


MODES = {"disaggregated": ("prefill", "decode"), "colocated": ("colocated",)}


def _build(cls, raw: dict[str, Any], prefix: str, base: Any = None):
    """``cls`` from a file's mapping; a section starts from the deployment's default for it (``base``), so a
    key left out keeps that section's own default (a decode section's max_inflight is the decode one)."""
    known = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"{name}: unknown setting (known: {', '.join(sorted(known))})")
        section = _section(known[key]) if cls is DeploymentConfig else None
        if section is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{name}: must be a mapping")
            values[key] = _build(section, value, f"{name}.", base=known[key].default_factory())
        elif cls is RoleConfig and key == "cpus":
            values[key] = value  # RoleConfig parses its forms (worker_common/affinity.py)
        elif cls is FaultPlan and key in ("transfer", "kill"):
            if not isinstance(value, list) or not all(isinstance(point, dict) for point in value):
                raise ConfigError(f"{name}: must be a list of fault points (mappings)")
            point_cls = FaultPoint if key == "transfer" else KillPoint
            try:
                values[key] = tuple(point_cls(**point) for point in value)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{name}: {e}") from None
        else:
            values[key] = _check_type(name, value, known[key].type, cls)
    try:
        return cls(**values) if base is None else replace(base, **values)
    except ValueError as e:
        raise ConfigError(f"{prefix}{e}") from None


def _section(f) -> type | None:
    """The dataclass of a section of the deployment config (``engine:``, ``prefill:``, ...), else None."""
    if f.default_factory is MISSING:
        return None
    default = f.default_factory()
    return type(default) if is_dataclass(default) else None


def _check_type(name: str, value: Any, annotation: str, cls: type) -> Any:
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
    # A Literal, written out or by an alias of its module (router.config's Policy): the dataclass checks the value.
    if isinstance(value, str) and any(_is_literal(part, cls) for part in parts):
        return value
    raise ConfigError(f"{name}: expected {annotation}, got {value!r}")


def _is_literal(part: str, cls: type) -> bool:
    if part.startswith("Literal"):
        return True
    aliases = (vars(sys.modules[c.__module__]).get(part) for c in cls.__mro__)
    return any(get_origin(alias) is Literal for alias in aliases)
