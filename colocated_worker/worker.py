"""The colocated worker: both phases in one engine, as a conventional (not disaggregated) server runs
them. Chunked prefills and decodes share one continuous batch under the token budget
(``max_num_batched_tokens``, ``prefill_chunk_size``), with the prefix cache on and preemption by
recompute. It is the baseline that disaggregated serving is measured against, on the same cores.

It speaks the prefill worker's protocol, so the router queues, credits and routes to it like a
prefill worker (prefix-aware routing included): ``Prefill`` returns ``FirstToken`` at once, then,
instead of moving the KV anywhere, streams the decode worker's events on the same call::

    queued ─▶ prefilling (chunks, mixed with other requests' decodes) ─▶ FirstToken ─▶ Tokens ...
                                                                                      ├─▶ Finished
                                                                                      └─▶ Preempted
                                                                       (draining: handed back, the
                                                                        router re-prefills elsewhere)

A cancelled call frees the request in whatever phase it is.

A request with ``n`` > 1 samples (``worker_common.samples``) is one job and one call: right after its first
token, samples 1 to n - 1 are forked from it (sharing its full prompt blocks; or, if that token ended it
and its blocks are freed, added as requests that the prefix cache serves) and stream on the same call,
each event naming its sample; the job ends with its last sample.

It shares the prefill worker's edge (``splitserve.worker_common.prefill_edge``: ``PrefillServicer``,
``PrefillJob``, the cache-event feed) and the engine interface (``worker_common.engine_api``), not its
class: it has no KV sender, as nothing ever leaves it. A role package of its own, like the prefill and
decode workers, and independent of both.
"""

from __future__ import annotations

import uuid

import grpc

from splitserve.common.errors import ServingError
from splitserve.engine.wire import FINISH_TO_PB, logprobs_to_pb, stop_reason_text
from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc import workers_pb2_grpc as wpb_grpc
from splitserve.worker_common.base import WorkerBase
from splitserve.worker_common.config import WorkerConfig
from splitserve.worker_common.engine_api import Engine, FinishReason, Request
from splitserve.worker_common.messages import Add, Cancel, Command, Drain, Emit, End, Event, Fail, unknown_command
from splitserve.worker_common.prefill_edge.cache_events import CacheEventFeed
from splitserve.worker_common.prefill_edge.jobs import (
    REQUEST_CALLS_FACTOR,
    PrefillJob,
    add_job,
    check_room,
    finish_job,
    job_from_pb,
    mark_scheduled,
)
from splitserve.worker_common.prefill_edge.service import PrefillServicer
from splitserve.worker_common.samples import fork_samples
from splitserve.worker_common.tp.rank_link import Ranks


class ColocatedWorker(WorkerBase):
    scheduler_mode = {}  # keeps requests to the end; recomputes when preempted

    def __init__(self, config: WorkerConfig, ranks: Ranks | None = None, engine: Engine | None = None) -> None:
        super().__init__(config, ranks, engine)
        self.cache_events = CacheEventFeed(self.engine, self.lock)
        self.jobs: dict[str, PrefillJob] = {}
        self.forked: dict[str, PrefillJob] = {}  # engine ids of samples 1 to n - 1 -> their job
        # Tells the router a restarted worker from the one it knew (the prefill worker's comes from its
        # KV sender; the same format).
        self._incarnation = uuid.uuid4().hex

    @property
    def incarnation(self) -> str:
        return self._incarnation

    def add_services(self, server: grpc.Server) -> None:
        wpb_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(self), server)

    def max_request_calls(self) -> int:
        return REQUEST_CALLS_FACTOR * self.config.max_inflight  # as the prefill worker's: the router sees one

    # ---- requests from handler threads ----------------------------------------------------------

    def accept(self, message: wpb.PrefillRequest) -> PrefillJob:
        """Validate and queue a request (handler thread); raises ServingError."""
        if message.HasField("destination"):
            raise ServingError("INVALID_ARGUMENT", "destination: a colocated worker decodes its requests itself")
        job = job_from_pb(self, message)
        with self.lock:
            if message.request_id in self.jobs:
                raise ServingError("ALREADY_EXISTS", f"request_id: {message.request_id!r} is already here")
            check_room(self, self.credited())
            self.jobs[message.request_id] = job
        self.submit(Add(job))
        return job

    def credited(self) -> int:
        return len(self.jobs)  # the router holds a colocated request's credit until it ends

    def cancel(self, job: PrefillJob) -> None:
        """The router's call ended (any reason): drop the job if it is still here (by job, not by id)."""
        self.submit(Cancel(job))

    # ---- the loop -------------------------------------------------------------------------------

    def handle_command(self, command: Command) -> None:
        match command:
            case Add(job):
                add_job(self.jobs, self.lock, self.engine, job)
            case Cancel(job):
                self._cancel(job)
            case Drain():  # hand back what has tokens; the rest is handed back at its first token
                for job in [j for j in self.jobs.values() if j.done]:
                    for _, request in list(job.samples.values()):
                        self._hand_back(job, request)
            case _:
                raise unknown_command(command)

    def _cancel(self, job: PrefillJob) -> None:
        if self.jobs.get(job.request.request_id) is job:
            for request_id in [job.request.request_id, *job.samples]:
                self.engine.finish(request_id, FinishReason.ABORT)  # frees its blocks
            self._finish_job(job, End())

    def step(self) -> bool:
        scheduled = self.engine.schedule()
        if scheduled.is_empty:
            self.cache_events.publish()
            return False
        kind = "prefill" if scheduled.prompt_work else "decode"
        self.faults.step(kind)
        mark_scheduled(self.jobs, scheduled)
        for request in self.engine.run(scheduled, kind).advanced:
            self._advanced(self._job(request.request_id), request)
        self.cache_events.publish()
        self.faults.step_done()
        return True

    def _job(self, request_id: str) -> PrefillJob:
        """The job of an engine request: the request's own, or the one a forked sample belongs to."""
        job = self.jobs.get(request_id)
        return job if job is not None else self.forked[request_id]

    def _advanced(self, job: PrefillJob, request: Request) -> None:
        """The request got a token: the first one as FirstToken, later ones (and other samples') as Tokens."""
        sample = job.samples[request.request_id][0]
        if not job.done:
            self.metrics.prefix_cache(request.num_tokens - 1, request.num_cached_tokens)
            job.events.put(Emit(wpb.PrefillEvent(first_token=job.first_token(request))))
            with self.lock:
                for i, child in enumerate(fork_samples(self.engine, request, job.n), start=1):
                    job.samples[child.request_id] = (i, child)
                    self.forked[child.request_id] = job
        else:
            tokens = wpb.Tokens(token_ids=[request.token_ids[-1]], index=request.num_output_tokens - 1, sample=sample)
            if request.logprobs:
                tokens.logprobs.append(logprobs_to_pb(request.logprobs[-1]))
            job.events.put(Emit(wpb.PrefillEvent(tokens=tokens)))
        if request.is_finished:  # the scheduler has freed its blocks
            finished = wpb.Finished(
                finish_reason=FINISH_TO_PB[request.finish_reason],
                stop_reason=stop_reason_text(request.stop_reason),
                sample=sample,
            )
            self._sample_ended(job, request.request_id, wpb.PrefillEvent(finished=finished))
        elif self.draining:
            self._hand_back(job, request)

    def _hand_back(self, job: PrefillJob, request: Request) -> None:
        output = request.output_token_ids
        sample = job.samples[request.request_id][0]
        self.engine.finish(request.request_id, FinishReason.PREEMPTED)
        event = wpb.PrefillEvent(preempted=wpb.Preempted(output_token_ids=output, sample=sample))
        self._sample_ended(job, request.request_id, event)

    def _sample_ended(self, job: PrefillJob, request_id: str, event: wpb.PrefillEvent) -> None:
        """One sample's last event; the job's last sample ends the job (and its call)."""
        with self.lock:
            job.samples.pop(request_id, None)
            self.forked.pop(request_id, None)
            others = bool(job.samples)
        if others:
            job.events.put(Emit(event))
        else:
            self._finish_job(job, Emit(event))

    def _finish_job(self, job: PrefillJob, last: Event) -> None:
        with self.lock:
            for request_id in job.samples:
                self.forked.pop(request_id, None)
        finish_job(self.jobs, self.lock, job, last)

    def fail_all(self, message: str) -> None:
        for job in list(self.jobs.values()):
            for request_id in [job.request.request_id, *job.samples]:
                self.engine.finish(request_id, FinishReason.ABORT)
            self._finish_job(job, Fail(ServingError("INTERNAL", message)))

    def status_message(self):
        with self.lock:
            running, waiting = self.engine.num_running, self.engine.num_waiting
        return self.status(running, waiting)
