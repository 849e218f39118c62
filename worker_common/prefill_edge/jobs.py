"""What the prefill and colocated workers share about a request: its job record, how a ``Prefill`` call
becomes one, and the ``FirstToken`` it answers with. Both speak the same protocol to the router; they
differ in what follows the first token (a KV transfer, or decoding here)."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from splitserve.common.errors import ServingError
from splitserve.engine.sampling.params import SamplingParamsError
from splitserve.engine.wire import logprobs_to_pb, prompt_logprobs_to_pb, sampling_from_pb
from splitserve.kv_transfer.sender import PeerAddress, SendHandle
from splitserve.rpc import workers_pb2 as wpb
from splitserve.worker_common.base import WorkerBase
from splitserve.worker_common.engine_api import Engine, Request, ScheduledStep
from splitserve.worker_common.messages import Emit, End, Event, Fail, make_event_queue
from splitserve.worker_common.samples import check_samples

# A worker refuses a request only past this many times max_inflight held: the router keeps to max_inflight,
# but a call it has ended (a cancel) leaves here a moment later, and the router may already have sent the
# next one. (``check_room``'s refusal says "twice".)
HELD_FACTOR = 2
# The most Prefill calls open at once, per max_inflight: those held before their first token (up to
# HELD_FACTOR), and as many again whose KV is still moving. The colocated worker, which holds at most
# HELD_FACTOR (decoding ones included), keeps the same figure: the router sees the two alike.
REQUEST_CALLS_FACTOR = 2 * HELD_FACTOR


@dataclass(eq=False)
class PrefillJob:
    request: Request
    destination: tuple[PeerAddress, ...]  # the decode worker's ranks, rank 0 first; () when no KV moves
    events: queue.Queue[Event] = field(default_factory=make_event_queue)
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token_at: float | None = None
    transfer: SendHandle | None = None
    done: bool = False  # past its first token (prefill: blocks freed or owned by the transfer callback)
    n: int = 1  # samples of the prompt (a colocated worker forks samples 1 to n - 1 after the first token)
    samples: dict[str, tuple[int, Request]] = field(default_factory=dict)  # engine id -> (sample, request)

    def first_token(self, request: Request) -> wpb.FirstToken:
        """The request sampled its first token: mark the job done and describe the token, with its timing."""
        self.done = True
        self.first_token_at = time.monotonic()
        started = self.first_scheduled or self.arrival
        return wpb.FirstToken(
            token_id=request.token_ids[-1],
            cached_tokens=request.num_cached_tokens,
            queue_ms=(started - self.arrival) * 1e3,
            compute_ms=(self.first_token_at - started) * 1e3,
            logprobs=logprobs_to_pb(request.logprobs[-1]) if request.logprobs else None,
            prompt_logprobs=prompt_logprobs_to_pb(request.prompt_logprobs),
        )


def job_from_pb(worker: WorkerBase, message: wpb.PrefillRequest) -> PrefillJob:
    """Validate a ``Prefill`` call's request (handler thread); raises ServingError naming the field."""
    try:
        sampling = sampling_from_pb(message.sampling, draw_seed=False)
    except SamplingParamsError as e:
        raise ServingError("INVALID_ARGUMENT", str(e)) from None
    if not message.sampling.HasField("seed"):
        raise ServingError("INVALID_ARGUMENT", "sampling.seed: the router must set it")
    if worker.draining:
        raise ServingError("UNAVAILABLE", f"prefill worker {worker.config.worker_id} is draining")
    prompt, output = list(message.prompt_token_ids), list(message.output_token_ids)
    worker.check_request(prompt + output, sampling)
    destination: tuple[PeerAddress, ...] = ()
    if message.HasField("destination"):
        d = message.destination
        ranks = d.ranks or [d]  # a tensor-parallel decode worker lists every rank
        destination = tuple(PeerAddress(r.receiver_id, r.incarnation, r.control_address) for r in ranks)
        bad = next((i for i, r in enumerate(destination) if not (r.receiver_id and r.control)), None)
        if bad is not None:
            field = f"destination.ranks[{bad}]" if d.ranks else "destination"
            raise ServingError("INVALID_ARGUMENT", f"{field}: receiver_id and control_address must be set")
    n = max(1, message.n)
    if n > 1 and output:
        raise ServingError("INVALID_ARGUMENT", "n: a re-prefilled request (output_token_ids set) is one sample")
    if (why := check_samples(worker.engine, n)) is not None:
        raise ServingError("INVALID_ARGUMENT", why)
    request = Request.resume(message.request_id, prompt, output, sampling, sampling.seed)
    return PrefillJob(request, destination, n=n, samples={request.request_id: (0, request)})


def check_room(worker: WorkerBase, held: int) -> None:
    """Refuse a request past twice max_inflight held (under the worker's lock)."""
    if held >= HELD_FACTOR * worker.config.max_inflight:
        raise ServingError(
            "RESOURCE_EXHAUSTED", f"{worker.config.role} worker has {held} requests (twice its max_inflight)"
        )


def mark_scheduled(jobs: dict[str, PrefillJob], step: ScheduledStep) -> None:
    """Note when each scheduled job first got compute (its queue time ends there)."""
    now = time.monotonic()
    for request in step.requests:
        job = jobs.get(request.request_id)  # None: a forked sample (it is timed by its request's job)
        if job is not None and job.first_scheduled is None:
            job.first_scheduled = now


def finish_job(jobs: dict[str, PrefillJob], lock: threading.RLock, job: PrefillJob, last: Event) -> None:
    """Forget the job (by job, not by id: a later request may reuse the id) and close its call's queue:
    a last message is followed by End."""
    with lock:
        if jobs.get(job.request.request_id) is job:
            del jobs[job.request.request_id]
    job.events.put(last)
    if isinstance(last, Emit):
        job.events.put(End())


def add_job(jobs: dict[str, PrefillJob], lock: threading.RLock, engine: Engine, job: PrefillJob) -> None:
    """Give the job's request to the engine (loop thread); one it refuses ends its call as INVALID_ARGUMENT."""
    try:
        with lock:
            engine.add(job.request)
    except ValueError as e:
        finish_job(jobs, lock, job, Fail(ServingError("INVALID_ARGUMENT", str(e))))
