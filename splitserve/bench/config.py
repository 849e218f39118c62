"""The settings of one benchmark run, shared by both backends (``runner``: gRPC, ``openai_backend``: HTTP).
``BenchConfig`` is also importable from ``splitserve.bench.runner``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from splitserve.common.validate import check_range
from splitserve.rpc.security import ClientSecurity

BACKENDS = ("splitserve", "openai")


@dataclass(frozen=True)
class BenchConfig:
    addr: str = "127.0.0.1:50051"  # the router's gRPC address (backend "splitserve")
    backend: Literal["splitserve", "openai"] = "splitserve"
    base_url: str = ""  # backend "openai": http://host:port of an OpenAI-compatible server
    model: str = ""  # backend "openai": the served model name sent with every request
    request_rate: float = math.inf  # requests per second; inf: all at once
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True
    request_timeout_s: float = 600.0
    percentiles: tuple[float, ...] = (90.0, 95.0, 99.0)
    goodput: Mapping[str, float] = field(default_factory=dict)  # SLOs in ms: ttft, tpot, e2el
    progress: bool = True
    security: ClientSecurity = field(default_factory=ClientSecurity)  # TLS and the API key
    # backend "openai" against a splitserve router's OpenAI port: the router's gRPC address, to read where the
    # served time went (splitserve.bench.timeline); backend "splitserve" reads it from ``addr``.
    timeline_addr: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend: must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend == "openai" and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url: backend openai needs an http(s) URL, got {self.base_url!r}")
        check_range(self, "max_concurrency", min=1, label="--max-concurrency")
        check_range(self, "request_timeout_s", above=0, label="--request-timeout")
        check_range(self, "seed", min=0, label="--seed")
        check_range(self, "temperature", min=0, label="--temperature")
