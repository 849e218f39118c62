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
"""

from __future__ import annotations

import time

from splitserve.engine.request import FinishReason, Request
from splitserve.engine.wire import FINISH_TO_PB, stop_reason_text
from splitserve.prefill_worker.worker import PrefillJob, PrefillWorker
from splitserve.rpc import workers_pb2 as wpb
from splitserve.worker_common.base import END, WorkerError
from splitserve.worker_common.config import WorkerConfig


class ColocatedWorker(PrefillWorker):
    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.scheduler = self.core.make_scheduler()  # keeps requests to the end; recomputes when preempted

    def accept(self, message: wpb.PrefillRequest) -> PrefillJob:
        if message.HasField("destination"):
            raise WorkerError("INVALID_ARGUMENT", "destination: a colocated worker decodes its requests itself")
        return super().accept(message)

    def credited(self) -> int:
        return len(self.jobs)  # the router holds a colocated request's credit until it ends

    def handle_command(self, command: tuple) -> None:
        kind, arg = command
        if kind == "drain":  # hand back what has tokens; the rest is handed back at its first token
            for job in [j for j in self.jobs.values() if j.done]:
                self._hand_back(job)
            return
        if kind == "add":
            super().handle_command(command)
            return
        job = arg
        if self.jobs.get(job.request.request_id) is job:
            with self.lock:
                self.scheduler.finish(job.request.request_id, FinishReason.ABORT)  # frees its blocks
            self._finish_job(job, END)

    def step(self) -> bool:
        output = self._schedule()
        if output is None:
            return False
        prompt_work = any(i.request.num_tokens - i.request.num_computed_tokens > 1 for i in output.scheduled)
        self.faults.step("prefill" if prompt_work else "decode")
        now = time.monotonic()
        for item in output.scheduled:
            job = self.jobs[item.request.request_id]
            if job.first_scheduled is None:
                job.first_scheduled = now
        sampled = self.run_model(output, "prefill" if prompt_work else "decode")
        with self.lock:
            advanced = self.scheduler.update(output, sampled)
        for request in advanced:
            self._advanced(self.jobs[request.request_id], request)
        self._publish_cache_events()
        self.faults.step_done()
        return True

    def _advanced(self, job: PrefillJob, request: Request) -> None:
        """The request got a token: the first one as FirstToken, later ones as Tokens."""
        token = request.token_ids[-1]
        if not job.done:
            job.done = True
            job.first_token_at = time.monotonic()
            self.metrics.prefix_cache(request.num_tokens - 1, request.num_cached_tokens)
            job.events.put(
                wpb.PrefillEvent(
                    first_token=wpb.FirstToken(
                        token_id=token,
                        cached_tokens=request.num_cached_tokens,
                        queue_ms=((job.first_scheduled or job.arrival) - job.arrival) * 1e3,
                        compute_ms=(job.first_token_at - (job.first_scheduled or job.arrival)) * 1e3,
                    )
                )
            )
        else:
            job.events.put(wpb.PrefillEvent(tokens=wpb.Tokens(token_ids=[token], index=request.num_output_tokens - 1)))
        if request.is_finished:  # the scheduler has freed its blocks
            finished = wpb.Finished(
                finish_reason=FINISH_TO_PB[request.finish_reason], stop_reason=stop_reason_text(request.stop_reason)
            )
            self._finish_job(job, wpb.PrefillEvent(finished=finished))
        elif self.draining:
            self._hand_back(job)

    def _hand_back(self, job: PrefillJob) -> None:
        output = job.request.output_token_ids
        with self.lock:
            self.scheduler.finish(job.request.request_id, FinishReason.PREEMPTED)
        self._finish_job(job, wpb.PrefillEvent(preempted=wpb.Preempted(output_token_ids=output)))

    def fail_all(self, message: str) -> None:
        for job in list(self.jobs.values()):
            with self.lock:
                self.scheduler.finish(job.request.request_id, FinishReason.ABORT)
            self._finish_job(job, WorkerError("INTERNAL", message))
