"""The workers of a simulated deployment: the real scheduler and block manager, timed by a profile.

Each worker takes one step at a time, as the real loop does: ``Scheduler.schedule()`` picks the batch (its
token budget, chunking, prefix cache and preemption are the engine's own code), the profile says how long
its forward takes, and at the step's end ``Scheduler.update()`` applies one token per sampling request
(a fixed token that ends nothing: the workload's output lengths end the requests, as ``ignore_eos``
does in ``splitserve bench``). What the worker does with the tokens is the role's:

- ``SimPrefill``: hands each request off at its first token (``hand_off_after_first_token``); its blocks
  stay until the KV transfer ends;
- ``SimDecode``: leases blocks when the router asks, admits a request when its KV lands
  (``Scheduler.add_running``), streams a token per step, hands preempted requests back;
- ``SimColocated``: both phases in one batch, preemption by recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.deploy.profile import Profile, StepShape
from splitserve.engine.kv_cache.block_manager import BlockManager
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.scheduler.request import FinishReason, Request
from splitserve.engine.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

TOKEN = 1  # what every simulated step samples: no stop token, so length alone ends a request


@dataclass
class SimRequest:
    """One request of the workload, across its legs (a migration is a new leg)."""

    index: int
    prompt: list[int]
    output_len: int
    arrival_s: float
    output: list[int] = field(default_factory=list)
    first_token_s: float | None = None
    last_token_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    finished_s: float | None = None
    cached_tokens: int | None = None
    error: str = ""
    legs: int = 0
    leg: int = 0  # id of the current leg: events of an older leg are ignored
    prefill_worker: SimWorker | None = None
    decode_worker: SimWorker | None = None
    holds_credit: bool = False  # this leg holds its prefill worker's credit (the router's view)
    queued_tokens: int = 0  # the uncached prompt tokens the router counts against that worker
    lease_deadline: float = 0.0
    local: bool = False  # the last leg was prefilled on its decode worker (conditional disaggregation)
    dispatched_s: float | None = None  # the first leg left the router's queue
    landed_s: float | None = None  # the first leg's KV landed on its decode worker

    @property
    def request_id(self) -> str:
        return f"r{self.index}.{self.leg}"

    def engine_request(self) -> Request:
        """A fresh engine request for this leg: prompt, and the output so far."""
        sampling = SamplingParams(max_tokens=self.output_len, temperature=0.0, ignore_eos=True, seed=0)
        return Request.resume(self.request_id, self.prompt, list(self.output), sampling, seed=0)


class SimWorker:
    role = ""

    def __init__(
        self,
        worker_id: str,
        profile: Profile,
        num_blocks: int,
        block_size: int,
        scheduler: SchedulerConfig,
        prefix_caching: bool,
        clock: Callable[[], float],
        at: Callable[[float, Callable[[], None]], None],
    ) -> None:
        self.worker_id, self.profile = worker_id, profile
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.scheduler = Scheduler(scheduler, self.blocks)
        self.now, self.at = clock, at
        self.busy = False
        self._kicked = False
        self.alive = True
        self.requests: dict[str, SimRequest] = {}  # engine request id -> the workload's request
        self.steps = 0
        self.busy_s = 0.0

    def kick(self) -> None:
        """Start a step if idle and there is work (called whenever work arrives or a step ends). The step
        is scheduled after everything else due at this instant, as the real loop drains its inbox before
        it schedules: requests that arrive together are batched together."""
        if self.busy or self._kicked or not self.alive:
            return
        self._kicked = True
        self.at(self.now(), self._start_step)

    def _start_step(self) -> None:
        self._kicked = False
        if self.busy or not self.alive:
            return
        output = self.scheduler.schedule()
        self.on_scheduled(output)
        if output.is_empty:
            return
        self.busy = True
        seconds = self.profile.serving_step_s(step_shape(output), sum(s.samples for s in output.scheduled))
        self.busy_s += seconds
        self.steps += 1
        self.at(self.now() + seconds, lambda: self._step_done(output))

    def _step_done(self, output: SchedulerOutput) -> None:
        self.busy = False
        if not self.alive:
            return
        sampled = {s.request.request_id: TOKEN for s in output.scheduled if s.samples}
        for request in self.scheduler.update(output, sampled):
            job = self.requests.get(request.request_id)
            if job is not None:
                self.on_token(job, request)
        self.kick()

    def add(self, job: SimRequest) -> None:
        """A request to compute from its prompt (prefill and colocated workers; a decode worker's local prefill)."""
        request = job.engine_request()
        self.requests[request.request_id] = job
        self.scheduler.add(request)
        self.kick()

    def first_seen(self, job: SimRequest, request: Request) -> None:
        """Its prompt tokens served from the prefix cache, noted at its first token."""
        if job.cached_tokens is None:
            job.cached_tokens = request.num_cached_tokens

    def on_scheduled(self, output: SchedulerOutput) -> None:
        """A step was scheduled (possibly with preemptions)."""

    def on_token(self, job: SimRequest, request: Request) -> None:
        raise NotImplementedError

    def drop(self, job: SimRequest) -> None:
        """Forget a request here, freeing its blocks (the scheduler's, or a lease's)."""
        rid = job.request_id
        self.requests.pop(rid, None)
        if rid in self.scheduler.requests:
            self.scheduler.finish(rid, FinishReason.ABORT)
        elif self.blocks.has_request(rid):
            self.blocks.free(rid)

    def lose(self) -> list[SimRequest]:
        """The worker is lost: every request it held, to be retried or migrated."""
        self.alive = False
        jobs = list(self.requests.values())
        for job in jobs:
            self.drop(job)
        return jobs


def step_shape(output: SchedulerOutput) -> StepShape:
    """A scheduled step as the cost model sees it: one-token items decode, others are prompt chunks."""
    chunks, contexts = [], []
    for item in output.scheduled:
        computed, new = item.request.num_computed_tokens, item.num_new_tokens
        if new == 1:
            contexts.append(computed + 1)
        else:
            chunks.append((computed, new))
    return StepShape.of(chunks, contexts)


class SimPrefill(SimWorker):
    role = "prefill"

    def __init__(self, *args, on_first_token: Callable[[SimPrefill, SimRequest, Request], None], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.on_first_token = on_first_token

    def on_token(self, job: SimRequest, request: Request) -> None:
        self.first_seen(job, request)
        self.on_first_token(self, job, request)

    def release(self, job: SimRequest) -> None:
        """The request's KV has moved (or will not): free its blocks here."""
        self.requests.pop(job.request_id, None)
        if self.blocks.has_request(job.request_id):
            self.blocks.free(job.request_id)
        self.kick()


class SimDecode(SimWorker):
    role = "decode"

    def __init__(
        self,
        *args,
        on_token: Callable[[SimDecode, SimRequest, Request], None],
        on_handed_back: Callable[[SimDecode, SimRequest], None],
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._token, self._handed_back = on_token, on_handed_back

    def lease(self, job: SimRequest) -> bool:
        """Blocks for the request's KV and its next token (as ``DecodeWorker.lease``); False: no room."""
        rid = job.request_id
        if not self.blocks.allocate(rid, len(job.prompt) + len(job.output) + 1):
            return False
        self.requests[rid] = job
        return True

    def add_local(self, job: SimRequest) -> None:
        """Conditional disaggregation: a leased request this worker prefills itself, in its batch (its blocks
        are the lease's; ``requests`` holds it already)."""
        self.scheduler.add(job.engine_request())
        self.kick()

    def admit(self, job: SimRequest) -> None:
        """Its KV has landed (the first token with it): join the batch."""
        self.scheduler.add_running(job.engine_request())
        self.kick()

    def on_scheduled(self, output: SchedulerOutput) -> None:
        for victim in output.preempted:  # handed back: the scheduler freed its blocks
            job = self.requests.pop(victim.request_id, None)
            if job is not None:
                self._handed_back(self, job)

    def on_token(self, job: SimRequest, request: Request) -> None:
        if request.is_finished:
            self.requests.pop(request.request_id, None)
        self._token(self, job, request)

    @property
    def num_requests(self) -> int:
        return len(self.requests)


class SimColocated(SimWorker):
    role = "colocated"

    def __init__(self, *args, on_token: Callable[[SimColocated, SimRequest, Request], None], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._token = on_token

    def on_token(self, job: SimRequest, request: Request) -> None:
        self.first_seen(job, request)
        if request.is_finished:
            self.requests.pop(request.request_id, None)
        self._token(self, job, request)
