"""``splitserve simulate``: a discrete-event simulation of a deployment, timed by profiles.

The same workload as ``splitserve bench`` (its datasets and arrival process, or a Mooncake trace) meets
a simulated router and simulated workers (``splitserve.planning.sim_workers``: the engine's real
scheduler and block manager). The router follows the real one's path for each request::

    arrival ─▶ queue (max_queue) ─▶ a prefill worker with credit (router.policy.choose_prefill) ─▶
    a decode lease (choose_decode; waits up to lease_timeout_s) ─▶ prefill steps ─▶ first token
    (credit back) ─▶ KV transfer (profile.transfer_s) ─▶ decode steps ─▶ finished
                                                       └▶ handed back / worker lost: re-prefill

Conditional disaggregation (``router.policy.prefill_on_decode``, the router's own function) is decided
when a leg starts, before the queue: a request it picks takes a decode lease with no prefill worker, and
its decode worker prefills it. Colocated workers take the prefill path's place and hold the credit to
the end. A lost worker's requests are retried (no token out yet) or migrate (prompt and output
re-prefilled), as the router does.

Results have ``splitserve bench``'s JSON keys (``splitserve.bench.metrics.summarize`` on the same
``RequestRecord``s), so a simulated run and a measured one can be diffed key by key.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from splitserve.bench.metrics import RequestRecord, per_request_lists, summarize
from splitserve.common.arith import ceil_div
from splitserve.deploy.profile import Profile
from splitserve.engine.kv_cache.block_hash import block_hashes
from splitserve.engine.scheduler.request import Request
from splitserve.engine.scheduler.scheduler import SchedulerConfig
from splitserve.planning.sim_workers import SimColocated, SimDecode, SimPrefill, SimRequest, SimWorker
from splitserve.router.policy import DecodeView, PrefillView, choose_decode, choose_prefill, prefill_on_decode


@dataclass(frozen=True)
class RoleSpec:
    """One role's workers: how many, of which TP size, timed by which profile, with how much KV."""

    count: int
    profile: Profile
    num_blocks: int
    max_inflight: int
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.count < 0 or self.num_blocks < 1 or self.max_inflight < 1:
            raise ValueError(
                f"count, num_blocks, max_inflight: got {self.count}, {self.num_blocks}, {self.max_inflight}"
            )


@dataclass(frozen=True)
class SimConfig:
    mode: str = "disaggregated"  # disaggregated | colocated
    prefill: RoleSpec | None = None
    decode: RoleSpec | None = None
    colocated: RoleSpec | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int | None = None
    max_model_len: int = 4096
    routing_policy: str = "prefix_aware"
    overlap_weight: float = 16.0
    max_queue: int = 4096
    lease_timeout_s: float = 30.0
    max_prefill_retries: int = 3
    max_migrations: int = 3
    ttft_overhead_s: float = 0.0  # what a request spends outside the steps before its first token (gRPC, router)
    # Conditional disaggregation (router.config): prefill on the decode worker when the uncached prompt is at
    # most local_prefill_max_tokens, or the prefill queue holds remote_prefill_max_queue_tokens or more. 0: off.
    local_prefill_max_tokens: int = 0
    remote_prefill_max_queue_tokens: int = 0
    losses: tuple[tuple[float, str], ...] = ()  # (time, worker id): that worker is lost then

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode: expected disaggregated or colocated, got {self.mode!r}")
        needed = ("prefill", "decode") if self.mode == "disaggregated" else ("colocated",)
        missing = [r for r in needed if getattr(self, r) is None or getattr(self, r).count < 1]
        if missing:
            raise ValueError(f"{missing[0]}: the {self.mode} mode needs at least one {missing[0]} worker")
        if self.mode == "disaggregated":
            # Every hand-off is timed by the prefill workers' profile; without a measured transfer there is
            # nothing honest to time it by (a colocated deployment moves no KV and needs none).
            self.prefill.profile.require_transfer(
                "a disaggregated deployment hands each request's KV from prefill to decode, so it cannot be "
                "simulated without one (a colocated deployment can)"
            )


@dataclass(order=True)
class _Event:
    time: float
    seq: int
    action: Callable[[], None] = field(compare=False)


class Simulation:
    def __init__(self, config: SimConfig) -> None:
        self.config = c = config
        self.time = 0.0
        self._events: list[_Event] = []
        self._seq = itertools.count()
        self.queue: deque[SimRequest] = deque()  # waiting for a prefill worker with credit
        self.leasing: deque[tuple[SimRequest, SimWorker]] = deque()  # holding a credit, waiting for a lease
        self.done: list[SimRequest] = []
        self._turn = 0
        base = SchedulerConfig(
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            prefill_chunk_size=c.prefill_chunk_size,
            max_model_len=c.max_model_len,
        )
        self._schedulers = {
            "colocated": base,
            "prefill": SchedulerConfig(**{**vars(base), "hand_off_after_first_token": True}),
            "decode": SchedulerConfig(**{**vars(base), "preemption": "hand_back"}),
        }
        self.prefill: list[SimWorker] = []
        self.decode: list[SimDecode] = []
        self.views: dict[str, PrefillView] = {}
        self.decode_views: dict[str, DecodeView] = {}
        self.workers: dict[str, SimWorker] = {}
        self._numbers = {role: itertools.count() for role in self._schedulers}
        for role in ("colocated",) if c.mode == "colocated" else ("prefill", "decode"):
            for _ in range(getattr(c, role).count):
                self.spawn(role)
        for when, worker_id in c.losses:
            if worker_id not in self.workers:
                raise ValueError(f"losses: no worker {worker_id!r}")
            self.at(when, lambda w=self.workers[worker_id]: self._lose(w))

    # ---- the workers, and scaling them ----------------------------------------------------------

    def spawn(self, role: str, healthy: bool = True) -> SimWorker:
        """A new worker of ``role``, named as the launcher names them (``<role>-<n>``). One spawned
        unhealthy takes no work until ``ready`` (a worker that is still starting)."""
        spec: RoleSpec = getattr(self.config, role)
        worker_id = f"{role}-{next(self._numbers[role])}"
        common = {
            "block_size": self.config.block_size,
            "clock": lambda: self.time,
            "at": self.at,
            "scheduler": self._schedulers[role],
            "prefix_caching": role != "decode",
        }
        args = (worker_id, spec.profile, spec.num_blocks)
        if role == "decode":
            w = SimDecode(*args, on_token=self._decode_token, on_handed_back=self._handed_back, **common)
            self.decode.append(w)
            self.decode_views[worker_id] = DecodeView(worker_id, w.blocks.num_free_blocks, 0, healthy=healthy)
        else:
            if role == "prefill":
                w = SimPrefill(*args, on_first_token=self._first_token, **common)
            else:
                w = SimColocated(*args, on_token=self._colocated_token, **common)
            self.prefill.append(w)
            view = PrefillView(worker_id, credit=spec.max_inflight, healthy=healthy)
            view.cached_hashes = _HeldHashes(w)
            self.views[worker_id] = view
        self.workers[worker_id] = w
        return w

    def ready(self, worker_id: str) -> None:
        """A started worker registers: the router routes to it from now on."""
        for views in (self.views, self.decode_views):
            if worker_id in views:
                views[worker_id].healthy = True
        self._dispatch()
        self._lease()

    def drain(self, worker_id: str) -> None:
        """What ``splitserve scale`` does to a removed worker: nothing new is routed to it; a decode worker
        hands its requests back (they migrate), a prefill worker finishes what it holds; then it stops."""
        worker = self.workers[worker_id]
        if worker_id in self.views:
            self.views[worker_id].healthy = False
        if worker_id in self.decode_views:
            self.decode_views[worker_id].healthy = False
            self._lose(worker)
            return
        self._stop_when_idle(worker)

    def _stop_when_idle(self, worker: SimWorker) -> None:
        if worker.requests or any(prefill is worker for _, prefill in self.leasing):
            self.at(self.time + 0.05, lambda: self._stop_when_idle(worker))
        else:
            worker.alive = False

    def serving(self, role: str) -> list[SimWorker]:
        """The workers of ``role`` the router routes to."""
        views = self.decode_views if role == "decode" else self.views
        return [w for w in self.workers.values() if w.role == role and w.alive and views[w.worker_id].healthy]

    # ---- the clock ----------------------------------------------------------------------------

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, _Event(when, next(self._seq), action))

    def run(self, requests: Iterable[SimRequest]) -> list[SimRequest]:
        """Every request arrives at its ``arrival_s``; returns them once all have ended."""
        pending = sorted(requests, key=lambda r: r.arrival_s)
        for job in pending:
            self.at(job.arrival_s, lambda job=job: self._arrive(job))
        while self._events:
            event = heapq.heappop(self._events)
            self.time = event.time
            event.action()
        return pending

    # ---- the router ---------------------------------------------------------------------------

    def _arrive(self, job: SimRequest) -> None:
        if self._prefill_locally(job):
            self._lease_locally(job)
            return
        if len(self.queue) >= self.config.max_queue:
            self._fail(job, "RESOURCE_EXHAUSTED")
            return
        self.queue.append(job)
        self._dispatch()

    def _prefill_locally(self, job: SimRequest) -> bool:
        """The router's rule (``router.policy.prefill_on_decode``), on the simulated views. As the router,
        it is applied when a leg starts (an arrival, a retry, a migration), before the prefill queue."""
        c = self.config
        return prefill_on_decode(
            c,
            list(self.views.values()),
            block_hashes(job.prompt + job.output, c.block_size),
            c.block_size,
            num_tokens=len(job.prompt) + len(job.output),
            tokens_left=job.output_len - len(job.output),
            waiting_tokens=sum(len(j.prompt) + len(j.output) for j in self.queue),
            decode_workers=len(self.decode),
        )

    def _lease_locally(self, job: SimRequest) -> None:
        """Conditional disaggregation: a decode lease with no prefill worker; the decode worker prefills."""
        job.legs += 1
        job.leg += 1
        job.prefill_worker = job.decode_worker = None
        job.local = True
        if job.dispatched_s is None:
            job.dispatched_s = self.time
        job.lease_deadline = self.time + self.config.lease_timeout_s
        self.leasing.append((job, None))
        self._lease()

    def _dispatch(self) -> None:
        c = self.config
        while self.queue:
            job = self.queue[0]
            views = list(self.views.values())
            hashes = block_hashes(job.prompt + job.output, c.block_size)
            view = choose_prefill(views, c.routing_policy, hashes, c.block_size, c.overlap_weight, self._turn)
            if view is None:
                return
            self._turn += 1
            self.queue.popleft()
            worker = self.workers[view.worker_id]
            cached = view.cached_prefix_blocks(hashes) * c.block_size
            job.legs += 1
            job.leg += 1
            job.prefill_worker, job.decode_worker = worker, None
            if job.dispatched_s is None:
                job.dispatched_s = self.time
            job.queued_tokens = len(job.prompt) + len(job.output) - cached
            job.holds_credit = True
            view.credit -= 1
            view.inflight += 1
            view.queued_tokens += job.queued_tokens
            if c.mode == "colocated" or job.output_len - len(job.output) <= 1:
                worker.add(job)
            else:
                job.lease_deadline = self.time + c.lease_timeout_s
                self.leasing.append((job, worker))
                self._lease()

    def _lease(self) -> None:
        """Leases in order: a request takes the decode worker with room that the router's policy picks."""
        while self.leasing:
            job, prefill = self.leasing[0]
            if prefill is not None and not prefill.alive:  # its prefill worker was lost: dispatch it again
                self.leasing.popleft()
                self._credit_back(job)
                self._again(job, f"{prefill.worker_id} lost")
                continue
            blocks = ceil_div(len(job.prompt) + len(job.output) + 1, self.config.block_size)
            view = choose_decode([v for v in self.decode_views.values() if self.workers[v.worker_id].alive], blocks)
            if view is None:
                if self.time >= job.lease_deadline:
                    self.leasing.popleft()
                    if prefill is not None:
                        self._credit_back(job)
                    self._fail(job, "UNAVAILABLE")
                    continue
                self.at(job.lease_deadline, self._lease)
                return
            decode = self.workers[view.worker_id]
            if not decode.lease(job):
                self.at(self.time + 0.01, self._lease)  # the view was stale: look again shortly
                return
            self.leasing.popleft()
            job.decode_worker = decode
            self._decode_view(decode)
            if prefill is None:  # conditional disaggregation: the decode worker prefills it
                job.prefill_worker = decode
                decode.add_local(job)
            else:
                prefill.add(job)

    def _credit_back(self, job: SimRequest) -> None:
        """The router gives a prefill worker's credit back (at the first token; colocated: at the end)."""
        if not job.holds_credit or job.prefill_worker is None:
            return
        job.holds_credit = False
        view = self.views[job.prefill_worker.worker_id]
        view.credit += 1
        view.inflight -= 1
        view.queued_tokens -= job.queued_tokens

    def _decode_view(self, decode: SimDecode) -> None:
        view = self.decode_views[decode.worker_id]
        view.free_blocks, view.requests = decode.blocks.num_free_blocks, decode.num_requests

    # ---- the workers' events ------------------------------------------------------------------

    def _first_token(self, prefill: SimPrefill, job: SimRequest, request: Request) -> None:
        self._credit_back(job)
        self._token(job)
        if job.output_len - len(job.output) <= 0 or job.decode_worker is None:
            prefill.release(job)
            self._finish(job)
        else:
            leg, decode = job.leg, job.decode_worker
            # A hand-off between TP p and TP d moves max(p, d) parts side by side, each its share of the heads.
            ranks = max(self.config.prefill.tensor_parallel_size, self.config.decode.tensor_parallel_size)
            seconds = prefill.profile.transfer_s(prefill.profile.kv_bytes(request.num_tokens - 1) // ranks)
            self.at(self.time + seconds, lambda: self._landed(job, leg, prefill, decode))
        self._dispatch()

    def _landed(self, job: SimRequest, leg: int, prefill: SimPrefill, decode: SimDecode) -> None:
        if job.leg != leg:
            return
        prefill.release(job)
        if not decode.alive:
            return
        if job.landed_s is None:
            job.landed_s = self.time
        decode.admit(job)

    def _decode_token(self, decode: SimDecode, job: SimRequest, request: Request) -> None:
        self._token(job)
        if request.is_finished:
            self._finish(job)
            self._decode_view(decode)
            self._lease()

    def _colocated_token(self, worker: SimColocated, job: SimRequest, request: Request) -> None:
        self._token(job)
        if request.is_finished:
            self._credit_back(job)
            self._finish(job)
            self._dispatch()

    def _handed_back(self, decode: SimDecode, job: SimRequest) -> None:
        self._decode_view(decode)
        self._again(job, "handed back")

    def _token(self, job: SimRequest) -> None:
        now = self.time
        if job.first_token_s is None:
            job.first_token_s = now + self.config.ttft_overhead_s
        elif job.last_token_s is not None:
            job.itls_s.append(now - job.last_token_s)
        job.last_token_s = max(now, job.first_token_s)
        job.output.append(1)

    def _finish(self, job: SimRequest) -> None:
        job.finished_s = job.last_token_s
        self.done.append(job)

    def _fail(self, job: SimRequest, code: str) -> None:
        job.error = code
        self.done.append(job)

    def _again(self, job: SimRequest, why: str) -> None:
        """A leg ended without finishing: retry the prefill (nothing out yet) or migrate, within the limits."""
        c = self.config
        job.leg += 1  # events of the old leg are ignored from now on
        if not job.output and job.legs > c.max_prefill_retries or job.output and job.legs > c.max_migrations + 1:
            self._fail(job, "UNAVAILABLE")
            return
        if self._prefill_locally(job):
            self._lease_locally(job)
            return
        self.queue.appendleft(job)
        self._dispatch()

    def _lose(self, worker: SimWorker) -> None:
        for job in worker.lose():
            self._credit_back(job)
            other = job.decode_worker if job.prefill_worker is worker else job.prefill_worker
            if other is not None and other is not worker:
                other.drop(job)
            self._again(job, f"{worker.worker_id} lost")
        if worker.worker_id in self.views:
            self.views[worker.worker_id].healthy = False
        if worker.worker_id in self.decode_views:
            self.decode_views[worker.worker_id].healthy = False
        self._dispatch()
        self._lease()


class _HeldHashes:
    """A prefill view's ``cached_hashes``, read from the simulated worker's block manager itself (the real
    router learns them from the worker's events)."""

    def __init__(self, worker: SimWorker) -> None:
        self.blocks = worker.blocks

    def __contains__(self, block_hash: int) -> bool:
        return self.blocks.holds_hash(block_hash)


# ---- runs ---------------------------------------------------------------------------------------------


def simulate(
    config: SimConfig,
    requests: Sequence[tuple[list[int], int]],
    offsets_s: Sequence[float],
    percentiles: Sequence[float] = (90, 95, 99),
    goodput: dict[str, float] | None = None,
    simulation: Callable[[SimConfig], Simulation] = Simulation,
    per_request: bool = False,
) -> tuple[dict, Simulation]:
    """Run ``requests`` (prompt token ids, output length) arriving at ``offsets_s``; returns
    ``splitserve bench``'s summary of the run and the simulation (for its workers' figures).
    ``simulation`` makes it from ``config`` (``sim_planner.PlannedSimulation``: with the live planner). With
    ``per_request``, the summary carries bench's per-request lists too (``ttfts``, ``tpots``, ``errors``...),
    so that a simulated run can be judged against other SLOs afterwards, as a measured one can."""
    sim = simulation(config)
    jobs = [SimRequest(i, list(p), n, o) for i, ((p, n), o) in enumerate(zip(requests, offsets_s, strict=True))]
    sim.run(jobs)
    records = [to_record(job) for job in jobs]
    end = max((job.finished_s or job.arrival_s for job in jobs), default=0.0)
    duration = max(end, 1e-9)
    summary = summarize(records, duration, percentiles, goodput)
    return (summary | per_request_lists(records) if per_request else summary), sim


def to_record(job: SimRequest) -> RequestRecord:
    record = RequestRecord(len(job.prompt), job.output_len, due_s=job.arrival_s, sent_s=job.arrival_s)
    if job.error or job.finished_s is None:
        record.error_code = job.error or "DEADLINE_EXCEEDED"
        record.error = record.error_code
        return record
    record.ttft_s = job.first_token_s - job.arrival_s
    record.itls_s = job.itls_s
    record.e2el_s = job.finished_s - job.arrival_s
    record.output_len = len(job.output)
    record.cached_tokens = job.cached_tokens or 0
    first, dispatched = job.first_token_s, job.dispatched_s or job.arrival_s
    record.server_timing = {  # the router's timing breakdown, as the last message of a real request carries it
        "queue_ms": (dispatched - job.arrival_s) * 1e3,
        "prefill_ms": (first - dispatched) * 1e3,
        "transfer_ms": ((job.landed_s - first) * 1e3) if job.landed_s is not None else 0.0,
        "first_token_ms": (first - job.arrival_s) * 1e3,
        "decode_ms": (job.finished_s - first) * 1e3,
        "total_ms": (job.finished_s - job.arrival_s) * 1e3,
        "reprefills": job.legs - 1,
    }
    return record


def utilization(sim: Simulation) -> dict[str, float]:
    """Each role's busy time over the run's (mean over its workers)."""
    out: dict[str, float] = {}
    end = sim.time or 1.0
    for role in ("prefill", "decode", "colocated"):
        workers = [w for w in sim.workers.values() if w.role == role]
        if workers:
            out[role] = sum(w.busy_s for w in workers) / (len(workers) * end)
    return out
