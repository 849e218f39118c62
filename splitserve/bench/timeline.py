"""Where the served time went during a run: the router's and the workers' own metrics, read before and
after it (docs/benchmarks.md#where-the-time-went).

Each worker's loop thread books every second to one phase (``splitserve_worker_loop_seconds_total``):
the model (``run``) and named overheads around it, plus ``idle``. The difference of two readings is the
run's breakdown, and it adds up to the worker's wall clock between them. The router's relay counters give
what relaying each token to its client cost. The endpoints come from the router's status: its own
``metrics_address`` and every worker's.

A server that does not expose them (the OpenAI backend against another server, a deployment without
``--metrics-port``) gets a one-line note instead (``TimelineUnavailable``).
"""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc
from prometheus_client.parser import text_string_to_metric_families

from splitserve.bench.config import BenchConfig
from splitserve.bench.runner import get_status

LOOP_SECONDS = "splitserve_worker_loop_seconds_total"
RELAY_SECONDS = "splitserve_router_relay_seconds_total"
RELAYED_TOKENS = "splitserve_router_relayed_tokens_total"
# The table's order: the model first, then the overheads around it, then the time with nothing to do. A
# phase a newer worker reports and this list lacks comes after them.
PHASE_ORDER = ("run", "schedule", "apply", "stream", "commands", "lock_wait", "other", "idle")
ROLE_ORDER = {"prefill": 0, "decode": 1, "colocated": 2}
SCRAPE_TIMEOUT_S = 10.0


class TimelineUnavailable(Exception):
    """The run's timeline cannot be read (the message says why, in one line)."""


@dataclass(frozen=True)
class WorkerReading:
    worker_id: str
    role: str
    at: float  # perf_counter() at the middle of the scrape
    phases: dict[str, float]  # seconds by phase since the loop started


@dataclass(frozen=True)
class Reading:
    """One scrape of the router and every worker."""

    relay_s: float
    relayed_tokens: float
    workers: dict[str, WorkerReading]


@dataclass(frozen=True)
class Endpoints:
    router: str  # host:port of the router's /metrics
    workers: dict[str, tuple[str, str]]  # worker id -> (role, host:port of its /metrics)

    @classmethod
    def of_status(cls, status) -> Endpoints:
        """From the router's ``GetStatusResponse``; raises TimelineUnavailable when metrics are off."""
        if not status.metrics_address:
            raise TimelineUnavailable("the deployment serves no metrics (start it with --metrics-port)")
        workers = {w.worker_id: (w.role, w.metrics_address) for w in status.workers if w.metrics_address}
        if not workers:
            raise TimelineUnavailable("no worker serves metrics")
        return cls(status.metrics_address, workers)

    def read(self) -> Reading:
        """Scrape the router and every worker now; raises TimelineUnavailable if one cannot be read."""
        router = _scrape(self.router)
        workers = {}
        for worker_id, (role, address) in self.workers.items():
            before = time.perf_counter()
            samples = _scrape(address)
            at = (before + time.perf_counter()) / 2
            phases = {labels["phase"]: value for name, labels, value in samples if name == LOOP_SECONDS}
            if not phases:
                raise TimelineUnavailable(f"worker {worker_id} at {address} reports no {LOOP_SECONDS}")
            workers[worker_id] = WorkerReading(worker_id, role, at, phases)
        return Reading(_total(router, RELAY_SECONDS), _total(router, RELAYED_TOKENS), workers)


@dataclass(frozen=True)
class Probe:
    """A run's first reading, to take the second one against (``finish``)."""

    endpoints: Endpoints
    before: Reading

    @classmethod
    def start(cls, config: BenchConfig) -> Probe | None:
        """Read the endpoints from the router's status and take the first reading; None, with a one-line
        note on stderr, when the server does not expose them."""
        try:
            addr = config.addr if config.backend == "splitserve" else config.timeline_addr
            if addr is None:
                raise TimelineUnavailable(
                    f"--backend {config.backend}: no splitserve router to ask for its metrics (--timeline-addr)"
                )
            try:
                status = asyncio.run(get_status(addr, security=config.security))
            except grpc.RpcError as e:
                raise TimelineUnavailable(f"cannot read the router's status: {e.code().name}") from None
            endpoints = Endpoints.of_status(status)
            return cls(endpoints, endpoints.read())
        except TimelineUnavailable as e:
            _note(str(e))
            return None

    def finish(self) -> dict | None:
        """The run's ``breakdown`` since the first reading; None (noted) if the second cannot be read."""
        try:
            return breakdown(self.before, self.endpoints.read())
        except TimelineUnavailable as e:
            _note(str(e))
            return None


def timed(run: Callable[..., dict]) -> Callable[..., dict]:
    """``run`` (``benchmark``'s arguments and result) with the run's ``timeline`` added to its result when
    the server exposes it."""

    def run_with_timeline(requests, offsets_s, config: BenchConfig, *args, **kwargs) -> dict:
        probe = Probe.start(config)
        result = run(requests, offsets_s, config, *args, **kwargs)
        if probe is not None and (timeline := probe.finish()) is not None:
            result["timeline"] = timeline
        return result

    return run_with_timeline


def _note(reason: str) -> None:
    print(f"splitserve bench: no timeline of where the time went: {reason}", file=sys.stderr)


def _scrape(address: str) -> list[tuple[str, dict[str, str], float]]:
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=SCRAPE_TIMEOUT_S) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError) as e:
        raise TimelineUnavailable(f"cannot read http://{address}/metrics: {e}") from None
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def _total(samples: list[tuple[str, dict[str, str], float]], name: str) -> float:
    return sum(value for sample_name, _, value in samples if sample_name == name)


def breakdown(before: Reading, after: Reading) -> dict:
    """The run's timeline (the result's ``timeline``): per worker, its wall clock between the readings, each
    phase's seconds, their sum and the sum's difference from the wall clock; for the router, the tokens
    relayed and what relaying them cost. A worker restarted in between (its counters went back) or not in
    both readings is left out."""
    workers = []
    for worker_id, last in after.workers.items():
        first = before.workers.get(worker_id)
        if first is None:
            continue
        phases = {p: last.phases[p] - first.phases.get(p, 0.0) for p in _ordered(last.phases)}
        if min(phases.values()) < 0:
            continue
        wall = last.at - first.at
        total = sum(phases.values())
        workers.append(
            {
                "worker_id": worker_id,
                "role": last.role,
                "wall_s": wall,
                "phases_s": phases,
                "sum_s": total,
                "diff_s": total - wall,
            }
        )
    tokens = after.relayed_tokens - before.relayed_tokens
    relay_s = after.relay_s - before.relay_s
    router = {
        "relayed_tokens": int(tokens),
        "relay_s": relay_s,
        "relay_us_per_token": relay_s / tokens * 1e6 if tokens > 0 else 0.0,
    }
    return {"workers": sorted(workers, key=lambda w: (ROLE_ORDER.get(w["role"], 3), w["worker_id"])), "router": router}


def _ordered(phases: Mapping[str, float]) -> list[str]:
    return [p for p in PHASE_ORDER if p in phases] + sorted(set(phases) - set(PHASE_ORDER))


def format_timeline(timeline: Mapping) -> str:
    """The "Where the time went" table: a row per phase, a column per worker (seconds and share of its wall
    clock), the busy time (all but idle) and the model's part of it, then the router's relay cost."""
    workers = timeline["workers"]
    lines = ["{s:{c}^{n}}".format(s=" Where the time went ", n=50, c="=")]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"{label:<24}" + "".join(f"{cell:>20}" for cell in cells))

    def cell(seconds: float, of: float, signed: bool = False) -> str:
        share = seconds / of if of > 0 else 0.0
        if signed:  # a difference that rounds to zero shows as +0.000, never -0.000
            seconds, share = round(seconds, 3) + 0.0, round(share, 3) + 0.0
        return f"{seconds:{'+' if signed else ''}.3f} {share:>{'+' if signed else ''}7.1%}"

    if workers:
        row("Worker loop (s, share)", [w["worker_id"] for w in workers])
        row("Wall clock:", [f"{w['wall_s']:.3f} {'':>7}" for w in workers])
        for phase in _ordered({p: 0.0 for w in workers for p in w["phases_s"]}):
            label = f"  {phase}{' (model)' if phase == 'run' else ''}:"
            row(label, [cell(w["phases_s"].get(phase, 0.0), w["wall_s"]) for w in workers])
        row("Sum - wall clock:", [cell(w["diff_s"], w["wall_s"], signed=True) for w in workers])
        busy = [w["sum_s"] - w["phases_s"].get("idle", 0.0) for w in workers]
        row("Busy (all but idle):", [cell(b, w["wall_s"]) for b, w in zip(busy, workers)])
        row(
            "Model (run) of busy:",
            [f"{w['phases_s'].get('run', 0.0) / b if b > 0 else 0.0:.1%}" for b, w in zip(busy, workers)],
        )
    else:
        lines.append("No worker reported its loop for the whole run.")
    router = timeline["router"]
    lines.append("{s:{c}^{n}}".format(s="Router relay", n=50, c="-"))
    lines.append(f"{'Relayed tokens:':<40} {router['relayed_tokens']}")
    lines.append(f"{'Relay cost (s):':<40} {router['relay_s']:.4f}")
    lines.append(f"{'Relay cost per token (us):':<40} {router['relay_us_per_token']:.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)
