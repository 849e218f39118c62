"""A worker's own metrics, served on its own ``/metrics`` endpoint: engine steps and batch sizes, KV
blocks, prefix-cache queries and hits, KV transfers sent or received, and where the loop thread's time
goes (``worker_common.loop_clock``). Every series carries the
worker's ``worker_id`` and ``role``, so series from many workers aggregate and join with the router's
``splitserve_worker_*`` gauges. Every name and label: docs/metrics.md.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from splitserve.kv_transfer.handles import TransferHandle, TransferState
from splitserve.observability.buckets import BATCH, STEP_S, TOKENS, TRANSFER_S
from splitserve.worker_common.loop_clock import LoopClock

LABELS = ["worker_id", "role"]


class WorkerMetrics:
    def __init__(self, worker_id: str, role: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.ids = (worker_id, role)
        self.steps = Counter(
            "splitserve_engine_steps",
            "Model steps, by kind (prefill: the step computes prompt tokens; decode: only decodes)",
            [*LABELS, "kind"],
            registry=r,
        )
        self.step_seconds = Histogram(
            "splitserve_engine_step_seconds",
            "One model step (forward and sampling)",
            [*LABELS, "kind"],
            buckets=STEP_S,
            registry=r,
        )
        self.batch_requests = Histogram(
            "splitserve_engine_batch_requests", "Requests in one step", LABELS, buckets=BATCH, registry=r
        )
        self.batch_tokens = Histogram(
            "splitserve_engine_batch_tokens", "Tokens computed in one step", LABELS, buckets=TOKENS, registry=r
        )
        self.cache_queries = Counter(
            "splitserve_engine_prefix_cache_queries",
            "Tokens prefilled, looked up in the prefix cache",
            LABELS,
            registry=r,
        ).labels(*self.ids)
        self.cache_hits = Counter(
            "splitserve_engine_prefix_cache_hits", "Of those, tokens found there", LABELS, registry=r
        ).labels(*self.ids)
        self.transfers = Counter(
            "splitserve_engine_kv_transfers",
            "KV transfers ended, by direction (sent, received) and result (done, failed, cancelled)",
            [*LABELS, "direction", "result"],
            registry=r,
        )
        self.transfer_bytes = Counter(
            "splitserve_engine_kv_transfer_bytes", "KV payload bytes moved", [*LABELS, "direction"], registry=r
        )
        self.transfer_seconds = Histogram(
            "splitserve_engine_kv_transfer_seconds",
            "A done transfer's active "
            "time: its first payload until the last was acknowledged (sent) or "
            "landed (received)",
            [*LABELS, "direction"],
            buckets=TRANSFER_S,
            registry=r,
        )
        self.loop = LoopClock()  # the worker's loop thread starts it
        r.register(_LoopCollector(self.loop, self.ids))

    def watch(self, worker) -> None:
        """Read the worker's load, KV blocks and pairs at every scrape."""
        self.registry.register(_WorkerCollector(worker, self.ids))

    def step(self, kind: str, seconds: float, num_requests: int, num_tokens: int) -> None:
        self.steps.labels(*self.ids, kind).inc()
        self.step_seconds.labels(*self.ids, kind).observe(seconds)
        self.batch_requests.labels(*self.ids).observe(num_requests)
        self.batch_tokens.labels(*self.ids).observe(num_tokens)

    def prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        self.cache_queries.inc(queried_tokens)
        self.cache_hits.inc(hit_tokens)

    def transfer_ended(self, direction: str, handle: TransferHandle) -> None:
        """A transfer reached its terminal state: count it, its bytes and (when done) its active time."""
        self.transfers.labels(*self.ids, direction, handle.state.value).inc()
        self.transfer_bytes.labels(*self.ids, direction).inc(handle.nbytes)
        if handle.state is TransferState.DONE and handle.active_s is not None:
            self.transfer_seconds.labels(*self.ids, direction).observe(handle.active_s)


class _WorkerCollector:
    """Gauges read at scrape time from the worker itself (under its lock, from the allocator)."""

    def __init__(self, worker, ids: tuple[str, str]) -> None:
        self.worker, self.ids = worker, list(ids)

    def describe(self):
        return []

    def collect(self):
        status = self.worker.status_message()
        figures = [
            ("splitserve_engine_requests_running", "Requests being computed", status.running),
            (
                "splitserve_engine_requests_waiting",
                "Requests queued (prefill) or waiting for their KV (decode)",
                status.waiting,
            ),
            ("splitserve_engine_kv_blocks_capacity", "KV blocks of this worker", status.kv_blocks_total),
            (
                "splitserve_engine_kv_blocks_in_use",
                "KV blocks held by live requests or transfers",
                status.kv_blocks_in_use,
            ),
            ("splitserve_engine_kv_blocks_cached", "Evictable prefix-cache blocks", status.kv_blocks_cached),
            ("splitserve_engine_kv_pairs", "Open KV-transfer pair groups", self.worker.kv_pairs()),
        ]
        for name, help_text, value in figures:
            family = GaugeMetricFamily(name, help_text, labels=LABELS)
            family.add_metric(self.ids, value)
            yield family
        preemptions = CounterMetricFamily(
            "splitserve_engine_preemptions",
            "Requests preempted for lack of KV blocks (decode: handed back to the router; colocated: recomputed)",
            labels=LABELS,
        )
        preemptions.add_metric(self.ids, self.worker.engine.num_preemptions)
        yield preemptions


class _LoopCollector:
    """The loop thread's seconds by phase, read from its clock at scrape time (the phase in progress included)."""

    def __init__(self, clock: LoopClock, ids: tuple[str, str]) -> None:
        self.clock, self.ids = clock, list(ids)

    def describe(self):
        return []

    def collect(self):
        family = CounterMetricFamily(
            "splitserve_worker_loop_seconds",
            "The worker loop thread's wall clock by phase (commands, schedule, run, apply, stream, lock_wait, "
            "idle, other); the phases add up to the time since the loop started",
            labels=[*LABELS, "phase"],
        )
        for phase, seconds in self.clock.seconds().items():
            family.add_metric([*self.ids, phase], seconds)
        yield family
