"""The router's metrics and its one log line per request.

Per-request figures are observed from the same clock readings as the ``Timing`` of the request's last
message (``router/generate.py``), so the histograms agree with what clients receive:

    arrival ─queue─▶ dispatched ─prefill─▶ first token ─transfer (KV landed)─▶ ... ─decode─▶ last message
       └──────────────── time to first token ───┘                                          │
       └──────────────────────────────────── e2e ─────────────────────────────────────────┘

Queue time, TTFT, prefill time, inter-token latency and the relay's own cost are observed as they
happen (so a stuck queue shows while it lasts, and cancelled requests count up to where they got);
transfer time and bytes once per leg that moved KV; e2e, decode time and token counts when a request
finishes. Gauges (queue length, running requests, and each worker's load and KV blocks as the router's
status polls last saw them) are read when scraped. Every name and label: docs/metrics.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from splitserve.observability.buckets import E2E_S, LATENCY_S, STEP_S, TOKENS, TRANSFER_BYTES, TRANSFER_S
from splitserve.v1 import splitserve_pb2 as pb

requests_log = logging.getLogger("splitserve.requests")

Outcome = Literal["finished", "error", "cancelled"]


@dataclass(frozen=True)
class RequestSummary:
    """How one request ended: what the log line and the end-of-request metrics report."""

    request_id: str
    outcome: Outcome
    status: str  # the gRPC status code's name: OK, INVALID_ARGUMENT, UNAVAILABLE, CANCELLED, ...
    message: str  # the error message ("" when finished)
    finish_reason: str  # stop | length | "" (did not finish)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timing: pb.Timing | None  # None: refused before it was queued


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter(
            "splitserve_requests",
            "Requests ended, by outcome (finished, error, cancelled), "
            "gRPC status code and finish reason (stop, length; empty unless finished)",
            ["outcome", "status", "finish_reason"],
            registry=r,
        )
        self.queue = Histogram(
            "splitserve_request_queue_seconds",
            "Time in the router's queue, arrival to dispatch",
            buckets=LATENCY_S,
            registry=r,
        )
        self.ttft = Histogram(
            "splitserve_time_to_first_token_seconds", "Arrival to the first token sent", buckets=LATENCY_S, registry=r
        )
        self.itl = Histogram(
            "splitserve_inter_token_latency_seconds",
            "Gap between consecutive messages carrying tokens of one request",
            buckets=STEP_S,
            registry=r,
        )
        self.e2e = Histogram(
            "splitserve_e2e_request_latency_seconds",
            "Arrival to the last message, finished requests",
            buckets=E2E_S,
            registry=r,
        )
        self.prefill = Histogram(
            "splitserve_request_prefill_seconds",
            "Dispatch to the first token (decode lease, prefill worker queue and compute)",
            buckets=LATENCY_S,
            registry=r,
        )
        self.decode = Histogram(
            "splitserve_request_decode_seconds",
            "First token to the last token, finished requests",
            buckets=E2E_S,
            registry=r,
        )
        self.transfer = Histogram(
            "splitserve_kv_transfer_seconds",
            "One leg's KV transfer as it delays decoding: first token until every layer landed",
            buckets=TRANSFER_S,
            registry=r,
        )
        self.transfer_bytes = Histogram(
            "splitserve_kv_transfer_bytes", "One leg's KV payload in bytes", buckets=TRANSFER_BYTES, registry=r
        )
        self.transfer_failures = Counter(
            "splitserve_kv_transfer_failures", "KV transfers that failed (the leg ran again)", registry=r
        )
        self.prompt_tokens = Counter(
            "splitserve_prompt_tokens", "Prompt tokens of requests that reached their first token", registry=r
        )
        self.cache_hits = Counter(
            "splitserve_prefix_cache_hit_tokens",
            "Of those, tokens served from a prefill worker's prefix cache",
            registry=r,
        )
        self.generation_tokens = Counter("splitserve_generation_tokens", "Tokens sent to clients", registry=r)
        self.relay_seconds = Counter(
            "splitserve_router_relay_seconds",
            "Time the router spent relaying workers' token messages: from a message in hand to the client's "
            "response built (bookkeeping, detokenizing, stop strings, the response message)",
            registry=r,
        )
        self.relayed_tokens = Counter(
            "splitserve_router_relayed_tokens", "Tokens those messages carried (relay seconds per token)", registry=r
        )
        self.request_prompt_tokens = Histogram(
            "splitserve_request_prompt_tokens", "Prompt length, finished requests", buckets=TOKENS, registry=r
        )
        self.request_generation_tokens = Histogram(
            "splitserve_request_generation_tokens", "Output length, finished requests", buckets=TOKENS, registry=r
        )
        self.migrations = Counter(
            "splitserve_request_migrations",
            "Requests moved off a lost decode worker (re-prefilled elsewhere)",
            registry=r,
        )
        self.preemptions = Counter(
            "splitserve_request_preemptions",
            "Requests a decode worker handed back (out of KV blocks, or draining) and the router re-prefilled",
            registry=r,
        )
        self.local_prefills = Counter(
            "splitserve_request_local_prefills",
            "Legs prefilled on their decode worker (conditional disaggregation)",
            registry=r,
        )
        self.planner_decisions = Counter(
            "splitserve_planner_decisions",
            "Live planner decisions, by outcome: applied (a scale), held (hysteresis, cool-down) or steady",
            ["outcome"],
            registry=r,
        )
        self.prefill_retries = Counter(
            "splitserve_request_prefill_retries", "Prefills retried after their prefill worker was lost", registry=r
        )

    def watch(self, router) -> None:
        """Read the router's queue and its workers' last polled status at every scrape."""
        self.registry.register(_PoolCollector(router))

    # ---- as a request goes ----------------------------------------------------------------------

    def first_token(self, ttft_s: float, prefill_s: float, prompt_tokens: int, cached_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prefill.observe(prefill_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.cache_hits.inc(cached_tokens)

    def relayed(self, num_tokens: int, gap_s: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if gap_s is not None:
            self.itl.observe(gap_s)

    def relay_cost(self, num_tokens: int, seconds: float) -> None:
        """One token message relayed: its tokens and the router's time on it."""
        self.relayed_tokens.inc(num_tokens)
        self.relay_seconds.inc(seconds)

    def kv_transfer(self, seconds: float, nbytes: int) -> None:
        self.transfer.observe(seconds)
        self.transfer_bytes.observe(nbytes)

    def ended(self, summary: RequestSummary) -> None:
        self.requests.labels(summary.outcome, summary.status, summary.finish_reason).inc()
        if summary.outcome == "finished":
            t = summary.timing
            self.e2e.observe(t.total_ms / 1e3)
            self.decode.observe(t.decode_ms / 1e3)
            self.request_prompt_tokens.observe(summary.prompt_tokens)
            self.request_generation_tokens.observe(summary.completion_tokens)


class _PoolCollector:
    """Gauges read at scrape time from the router's own state (its event loop writes it; a scrape
    thread reads whole values: lists are copied, status messages are replaced, never edited)."""

    def __init__(self, router) -> None:
        self.router = router

    def describe(self):
        return []  # gauges appear and vanish with workers: nothing to check at registration

    def collect(self):
        router = self.router
        waiting = len(router.dispatcher.waiting) if router.dispatcher is not None else 0
        yield GaugeMetricFamily("splitserve_requests_waiting", "Requests in the router's queue", value=waiting)
        yield GaugeMetricFamily(
            "splitserve_requests_running",
            "Requests dispatched and not ended",
            value=max(0, len(router.inflight) - waiting),
        )
        labels = ["worker_id", "role"]
        families = {
            "up": GaugeMetricFamily(
                "splitserve_worker_up", "1 if the worker answered its last status poll", labels=labels
            ),
            "running": GaugeMetricFamily(
                "splitserve_worker_requests_running",
                "Requests being computed on the worker (last status poll)",
                labels=labels,
            ),
            "waiting": GaugeMetricFamily(
                "splitserve_worker_requests_waiting",
                "Requests queued on the worker, or waiting for their KV (decode)",
                labels=labels,
            ),
            "capacity": GaugeMetricFamily(
                "splitserve_worker_kv_blocks_capacity", "KV blocks of the worker", labels=labels
            ),
            "in_use": GaugeMetricFamily(
                "splitserve_worker_kv_blocks_in_use", "KV blocks held by live requests or transfers", labels=labels
            ),
            "cached": GaugeMetricFamily(
                "splitserve_worker_kv_blocks_cached", "Evictable prefix-cache blocks", labels=labels
            ),
        }
        for w in list(router.pool.workers) if router.pool is not None else []:
            s, values = w.status, [w.worker_id, w.spec.role]
            figures = {
                "up": float(w.healthy),
                "running": s.running,
                "waiting": s.waiting,
                "capacity": s.kv_blocks_total,
                "in_use": s.kv_blocks_in_use,
                "cached": s.kv_blocks_cached,
            }
            for key, value in figures.items():
                families[key].add_metric(values, value)
        yield from families.values()


def log_request(summary: RequestSummary) -> None:
    """One line per request, with the figures of its ``Timing`` (as text, and as JSON fields)."""
    fields = {
        "request_id": summary.request_id,
        "outcome": summary.outcome,
        "status": summary.status,
        "finish_reason": summary.finish_reason,
        "prompt_tokens": summary.prompt_tokens,
        "completion_tokens": summary.completion_tokens,
        "cached_tokens": summary.cached_tokens,
    }
    t = summary.timing
    if t is not None:
        fields |= {
            name: round(getattr(t, name), 3)
            for name in ("queue_ms", "prefill_ms", "transfer_ms", "first_token_ms", "decode_ms", "total_ms")
        }
        fields |= {"reprefills": t.reprefills, "prefill_worker": t.prefill_worker, "decode_worker": t.decode_worker}
    if summary.message:
        fields["error"] = summary.message
    text = " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("request_id", "error") and v != "")
    level = logging.WARNING if summary.outcome == "error" and summary.status not in _CLIENT_ERRORS else logging.INFO
    suffix = f": {summary.message}" if summary.message else ""
    requests_log.log(level, "request %s %s %s%s", summary.request_id, summary.outcome, text, suffix, extra=fields)


# Errors that are the caller's doing: logged at INFO, the server's own failures at WARNING.
_CLIENT_ERRORS = ("INVALID_ARGUMENT", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED")
