"""The prefill worker: batched, chunked prefill with a prefix cache; returns the first token at once
and ships the KV to the decode worker the router chose, layer group by layer group.

A request's life here (it exists exactly as long as the router's ``Prefill`` call)::

    queued ─▶ prefilling (chunks) ─▶ first token sampled ─▶ FirstToken sent to the router at once
                                        │
                                        ├─ finished at the first token / no destination: blocks freed
                                        └─ KV transfer (started with the final chunk, streamed by layer
                                           group while later layers compute) ─▶ TransferResult; blocks
                                           freed (full blocks stay in the prefix cache)

A cancelled call frees the request in whatever phase it is. Each step of the loop: schedule ▸ start the
transfers of the requests on their final chunk ▸ run the model (layer groups go out as they finish) ▸
send the first tokens and commit the transfers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from splitserve.common.arith import ceil_div
from splitserve.common.errors import ServingError
from splitserve.engine.wire import FINISH_TO_PB, stop_reason_text
from splitserve.kv_transfer.descriptor import Commit
from splitserve.kv_transfer.handles import TransferHandle, TransferState
from splitserve.kv_transfer.sender import KVSender
from splitserve.kv_transfer.service import GrpcConnection
from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc import workers_pb2_grpc as wpb_grpc
from splitserve.worker_common.base import WorkerBase
from splitserve.worker_common.config import WorkerConfig
from splitserve.worker_common.engine_api import Engine, FinishReason, Request, ScheduledStep
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
from splitserve.worker_common.tp.kv import TPSender
from splitserve.worker_common.tp.rank_link import Ranks

log = logging.getLogger("splitserve.prefill")


class PrefillWorker(WorkerBase):
    scheduler_mode = {"hand_off_after_first_token": True}

    def __init__(self, config: WorkerConfig, ranks: Ranks | None = None, engine: Engine | None = None) -> None:
        super().__init__(config, ranks, engine)
        self.cache_events = CacheEventFeed(self.engine, self.lock)
        sender = KVSender(
            self.engine.kv_cache,
            self.fingerprint,
            config.worker_id,
            connect=lambda peer: GrpcConnection(peer.control, config.security),
            host=config.host,
            config=config.transfer,
            faults=self.faults,
        )
        # The request's KV as one hand-off, whatever the TP sizes of this worker and of its destination.
        self.sender = TPSender(sender, self.engine.model.num_kv_heads, ranks, self.engine.plan_channel)
        self.jobs: dict[str, PrefillJob] = {}

    @property
    def incarnation(self) -> str:
        return self.sender.incarnation

    def add_services(self, server: grpc.Server) -> None:
        wpb_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(self), server)

    def stop(self, grace_s: float = 1.0) -> None:
        super().stop(grace_s)
        self.sender.close()

    def kv_pairs(self) -> int:
        return self.sender.num_pairs()

    def kv_transfers(self) -> int:
        return self.sender.num_transfers()

    # ---- requests from handler threads ----------------------------------------------------------

    def accept(self, message: wpb.PrefillRequest) -> PrefillJob:
        """Validate and queue a request (handler thread); raises ServingError."""
        job = job_from_pb(self, message)
        if job.n > 1:
            raise ServingError("INVALID_ARGUMENT", "n: a prefill worker prefills one sample; the decode worker forks")
        with self.lock:
            if message.request_id in self.jobs or self.sender.has_transfer(message.request_id):
                raise ServingError("ALREADY_EXISTS", f"request_id: {message.request_id!r} is already here")
            check_room(self, self.credited())
            self.jobs[message.request_id] = job
        self.submit(Add(job))
        return job

    def max_request_calls(self) -> int:
        # Twice max_inflight before the first token, and as many again whose KV is still moving.
        return REQUEST_CALLS_FACTOR * self.config.max_inflight

    def credited(self) -> int:
        """Requests that count against ``max_inflight``: those before their first token. The router
        gives the credit back at the first token, while the KV may still be moving (the job stays
        here until then, holding blocks, not compute). The router keeps to ``max_inflight``; this
        worker refuses only past twice that, because a call the router has ended (a cancel) leaves
        here a moment later, and the router may already have sent the next one."""
        return sum(not job.done for job in self.jobs.values())

    def cancel(self, job: PrefillJob) -> None:
        """The router's call ended (any reason): drop the job if it is still here. By job, not by id:
        a finished call's callback must never touch a newer request that reuses the id."""
        self.submit(Cancel(job))

    # ---- the loop -------------------------------------------------------------------------------

    def handle_command(self, command: Command) -> None:
        match command:
            case Add(job):
                add_job(self.jobs, self.lock, self.engine, job)
            case Cancel(job):
                self._cancel(job)
            case Drain():  # accept() refuses new requests; the ones here finish as usual
                pass
            case _:
                raise unknown_command(command)

    def _cancel(self, job: PrefillJob) -> None:
        request_id = job.request.request_id
        if self.jobs.get(request_id) is not job:
            return  # already finished
        if not job.done:  # still in the scheduler: abort frees its blocks
            self.engine.finish(request_id, FinishReason.ABORT)
            self._finish_job(job, End())
        elif job.transfer is not None:
            self.sender.cancel(request_id, "cancelled by the router")  # the transfer callback frees the blocks

    def step(self) -> bool:
        scheduled = self.engine.schedule()
        if scheduled.is_empty:
            self.cache_events.publish()
            return False
        self.faults.step("prefill")  # the kill point, then the delay (tests)
        mark_scheduled(self.jobs, scheduled)
        streaming = self._start_transfers(scheduled)
        result = self.engine.run(scheduled, "prefill", on_layer_done=self._layers_done(streaming))
        for request in result.advanced:
            self._first_token(self.jobs[request.request_id], request)
        self.cache_events.publish()
        return True

    def _start_transfers(self, scheduled: ScheduledStep) -> list[TransferHandle]:
        """Start the KV transfer of each request whose final chunk runs now: its layer groups stream
        while later layers compute."""
        streaming: list[TransferHandle] = []
        for request in scheduled.sampling:
            job = self.jobs[request.request_id]
            if job.destination and job.transfer is None:
                blocks = self.engine.block_table(request.request_id)[
                    : ceil_div(request.num_tokens, self.engine.model.block_size)
                ]
                job.transfer = self.sender.start(request.request_id, job.destination, blocks, request.num_tokens)
                streaming.append(job.transfer)
        return streaming

    def _layers_done(self, streaming: list[TransferHandle]) -> Callable[[int], None] | None:
        """The model's per-layer hook: queue each finished layer group of the streaming transfers."""
        if not streaming:
            return None

        def layers_ready(num_layers: int) -> None:
            for handle in streaming:
                self.sender.layers_ready(handle, num_layers)

        return layers_ready

    def _first_token(self, job: PrefillJob, request: Request) -> None:
        token = request.token_ids[-1]
        event = job.first_token(request)
        self.metrics.prefix_cache(request.num_tokens - 1, request.num_cached_tokens)
        if request.finish_reason is not None:
            event.finish_reason = FINISH_TO_PB[request.finish_reason]
            event.stop_reason = stop_reason_text(request.stop_reason)
        job.events.put(Emit(wpb.PrefillEvent(first_token=event)))
        if job.transfer is None:
            self._release(job)
            self._finish_job(job, End())
        elif request.finish_reason is not None:  # nothing left to decode: do not move the KV
            self.sender.cancel(request.request_id, "finished at its first token")
            job.transfer.on_terminal(lambda h: self._transfer_ended(job, h, report=False))
        else:
            self.sender.finish(job.transfer, commit=Commit(first_token=token))
            job.transfer.on_terminal(lambda h: self._transfer_ended(job, h, report=True))

    def _transfer_ended(self, job: PrefillJob, handle: TransferHandle, report: bool) -> None:
        """Runs in whichever thread ended the transfer: free the blocks, tell the router."""
        self._release(job)
        self.metrics.transfer_ended("sent", handle)
        if handle.state is TransferState.FAILED:
            log.warning(
                "KV transfer of %s to %s failed: %s",
                job.request.request_id,
                job.destination[0].receiver_id,
                handle.error,
                extra={"request_id": job.request.request_id},
            )
        if not report:
            self._finish_job(job, End())
            return
        ok = handle.state is TransferState.DONE
        result = wpb.TransferResult(
            ok=ok,
            error="" if ok else f"{handle.state.value}: {handle.error}",
            transfer_ms=((handle.finished_at or time.monotonic()) - job.first_token_at) * 1e3,
            bytes=handle.nbytes,
        )
        self._finish_job(job, Emit(wpb.PrefillEvent(transfer=result)))

    def _release(self, job: PrefillJob) -> None:
        request_id = job.request.request_id
        self.engine.free(request_id)
        self.sender.release(request_id)
        self.wake()

    def _finish_job(self, job: PrefillJob, last: Event) -> None:
        finish_job(self.jobs, self.lock, job, last)

    def fail_all(self, message: str) -> None:
        for job in list(self.jobs.values()):
            self.engine.finish(job.request.request_id, FinishReason.ABORT)
            if job.transfer is not None:
                self.sender.cancel(job.request.request_id, message)
            else:
                self._release(job)
            self._finish_job(job, Fail(ServingError("INTERNAL", message)))

    def status_message(self):
        with self.lock:
            running, waiting = self.engine.num_running, self.engine.num_waiting
        return self.status(running, waiting)
