"""The prefill worker: batched, chunked prefill with a prefix cache; returns the first token at once
and ships the KV to the decode worker the router chose, layer group by layer group.

A request's life here (it exists exactly as long as the router's ``Prefill`` call)::

    queued ─▶ prefilling (chunks) ─▶ first token sampled ─▶ FirstToken sent to the router at once
                                        │
                                        ├─ finished at the first token / no destination: blocks freed
                                        └─ KV transfer (started with the final chunk, streamed by layer
                                           group while later layers compute) ─▶ TransferResult; blocks
                                           freed (full blocks stay in the prefix cache)

A cancelled call frees the request in whatever phase it is.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

import grpc

from splitserve.engine.request import FinishReason, Request
from splitserve.engine.sampling_params import SamplingParamsError
from splitserve.engine.wire import FINISH_TO_PB, sampling_from_pb, stop_reason_text
from splitserve.kv_transfer.descriptor import Commit
from splitserve.kv_transfer.handles import TransferHandle, TransferState
from splitserve.kv_transfer.sender import KVSender, PeerAddress, SendHandle
from splitserve.kv_transfer.service import GrpcConnection
from splitserve.observability.logs import request_context
from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc import workers_pb2_grpc as wpb_grpc
from splitserve.worker_common.base import END, WorkerBase, WorkerError, stream_events
from splitserve.worker_common.config import WorkerConfig

log = logging.getLogger("splitserve.prefill")


@dataclass(eq=False)
class PrefillJob:
    request: Request
    destination: PeerAddress | None
    events: queue.Queue = field(default_factory=queue.Queue)
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token_at: float | None = None
    transfer: SendHandle | None = None
    done: bool = False  # the loop is finished with it (blocks freed or owned by the transfer callback)


class PrefillWorker(WorkerBase):
    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.scheduler = self.core.make_scheduler(hand_off_after_first_token=True)
        self.sender = KVSender(
            self.core.kv_cache,
            self.fingerprint,
            config.worker_id,
            connect=lambda peer: GrpcConnection(peer.control, config.security),
            host=config.host,
            config=config.transfer,
        )
        self.jobs: dict[str, PrefillJob] = {}
        self._subscribers: list[queue.Queue] = []

    @property
    def incarnation(self) -> str:
        return self.sender.incarnation

    def add_services(self, server: grpc.Server) -> None:
        wpb_grpc.add_PrefillWorkerServicer_to_server(_Servicer(self), server)

    def stop(self, grace_s: float = 1.0) -> None:
        super().stop(grace_s)
        self.sender.close()

    def kv_pairs(self) -> int:
        return self.sender.num_pairs()

    # ---- requests from handler threads ----------------------------------------------------------

    def accept(self, message: wpb.PrefillRequest) -> PrefillJob:
        """Validate and queue a request (handler thread); raises WorkerError."""
        try:
            sampling = sampling_from_pb(message.sampling, draw_seed=False)
        except SamplingParamsError as e:
            raise WorkerError("INVALID_ARGUMENT", str(e)) from None
        if not message.sampling.HasField("seed"):
            raise WorkerError("INVALID_ARGUMENT", "sampling.seed: the router must set it")
        if self.draining:
            raise WorkerError("UNAVAILABLE", f"prefill worker {self.config.worker_id} is draining")
        prompt, output = list(message.prompt_token_ids), list(message.output_token_ids)
        self.check_request(prompt + output, sampling)
        destination = None
        if message.HasField("destination"):
            d = message.destination
            destination = PeerAddress(d.receiver_id, d.incarnation, d.control_address)
        job = PrefillJob(Request.resume(message.request_id, prompt, output, sampling, sampling.seed), destination)
        with self.lock:
            if message.request_id in self.jobs or self.sender.has_transfer(message.request_id):
                raise WorkerError("ALREADY_EXISTS", f"request_id: {message.request_id!r} is already here")
            held = self.credited()
            if held >= 2 * self.config.max_inflight:
                raise WorkerError(
                    "RESOURCE_EXHAUSTED", f"{self.config.role} worker has {held} requests (twice its max_inflight)"
                )
            self.jobs[message.request_id] = job
        self.submit(("add", job))
        return job

    def max_request_calls(self) -> int:
        # Twice max_inflight before the first token, and as many again whose KV is still moving.
        return 4 * self.config.max_inflight

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
        self.submit(("cancel", job))

    # ---- the loop -------------------------------------------------------------------------------

    def handle_command(self, command: tuple) -> None:
        kind, arg = command
        if kind == "drain":  # accept() refuses new requests; the ones here finish as usual
            return
        if kind == "add":
            try:
                with self.lock:
                    self.scheduler.add(arg.request)
            except ValueError as e:
                self._finish_job(arg, WorkerError("INVALID_ARGUMENT", str(e)))
            return
        job, request_id = arg, arg.request.request_id
        if self.jobs.get(request_id) is not job:
            return  # already finished
        if not job.done:  # still in the scheduler: abort frees its blocks
            with self.lock:
                self.scheduler.finish(request_id, FinishReason.ABORT)
            self._finish_job(job, END)
        elif job.transfer is not None:
            self.sender.cancel(request_id, "cancelled by the router")  # the transfer callback frees the blocks

    def _schedule(self):
        """This step's work, or None (after publishing the cache events) when there is none."""
        with self.lock:
            output = self.scheduler.schedule()
        if output.is_empty:
            self._publish_cache_events()
            return None
        return output

    def step(self) -> bool:
        output = self._schedule()
        if output is None:
            return False
        self.fault_point("prefill")
        if self.config.faults.prefill_delay_s:
            time.sleep(self.config.faults.prefill_delay_s)
        now = time.monotonic()
        streaming: list[TransferHandle] = []
        for item in output.scheduled:
            job = self.jobs[item.request.request_id]
            if job.first_scheduled is None:
                job.first_scheduled = now
            if item.samples and job.destination is not None and job.transfer is None:
                request = item.request
                blocks = self.core.blocks.block_table(request.request_id)[
                    : -(-request.num_tokens // self.core.config.block_size)
                ]
                job.transfer = self.sender.start(request.request_id, job.destination, blocks, request.num_tokens)
                streaming.append(job.transfer)
        hook = (lambda n: [self.sender.layers_ready(h, n) for h in streaming]) if streaming else None
        sampled = self.run_model(output, "prefill", on_layer_done=hook)
        with self.lock:
            handed_off = self.scheduler.update(output, sampled)
        for request in handed_off:
            self._first_token(self.jobs[request.request_id], request)
        self._publish_cache_events()
        return True

    def _first_token(self, job: PrefillJob, request: Request) -> None:
        job.first_token_at = time.monotonic()
        job.done = True
        token = request.token_ids[-1]
        self.metrics.prefix_cache(request.num_tokens - 1, request.num_cached_tokens)
        event = wpb.FirstToken(
            token_id=token,
            cached_tokens=request.num_cached_tokens,
            queue_ms=((job.first_scheduled or job.arrival) - job.arrival) * 1e3,
            compute_ms=(job.first_token_at - (job.first_scheduled or job.arrival)) * 1e3,
        )
        if request.finish_reason is not None:
            event.finish_reason = FINISH_TO_PB[request.finish_reason]
            event.stop_reason = stop_reason_text(request.stop_reason)
        job.events.put(wpb.PrefillEvent(first_token=event))
        if job.transfer is None:
            self._release(job)
            self._finish_job(job, END)
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
                job.destination.receiver_id,
                handle.error,
                extra={"request_id": job.request.request_id},
            )
        if report:
            ok = handle.state is TransferState.DONE
            job.events.put(
                wpb.PrefillEvent(
                    transfer=wpb.TransferResult(
                        ok=ok,
                        error="" if ok else f"{handle.state.value}: {handle.error}",
                        transfer_ms=((handle.finished_at or time.monotonic()) - job.first_token_at) * 1e3,
                        bytes=handle.nbytes,
                    )
                )
            )
        self._finish_job(job, END)

    def _release(self, job: PrefillJob) -> None:
        request_id = job.request.request_id
        with self.lock:
            self.core.blocks.free(request_id)
        self.sender.release(request_id)
        self.wake()

    def _finish_job(self, job: PrefillJob, last) -> None:
        with self.lock:
            if self.jobs.get(job.request.request_id) is job:
                del self.jobs[job.request.request_id]
        job.events.put(last)
        if last is not END:
            job.events.put(END)

    def fail_all(self, message: str) -> None:
        for job in list(self.jobs.values()):
            with self.lock:
                self.scheduler.finish(job.request.request_id, FinishReason.ABORT)
            if job.transfer is not None:
                self.sender.cancel(job.request.request_id, message)
            else:
                self._release(job)
            self._finish_job(job, WorkerError("INTERNAL", message))

    # ---- prefix-cache events for the router ------------------------------------------------------

    def subscribe(self) -> tuple[queue.Queue, list[int]]:
        """A queue of future cache events, and the snapshot of hashes held now (taken atomically)."""
        events: queue.Queue = queue.Queue()
        with self.lock:
            self._publish_cache_events()
            snapshot = self.core.blocks.cached_hashes()
            self._subscribers.append(events)
        return events, snapshot

    def unsubscribe(self, events: queue.Queue) -> None:
        with self.lock:
            if events in self._subscribers:
                self._subscribers.remove(events)
        events.put(END)

    def _publish_cache_events(self) -> None:
        with self.lock:
            events = self.core.blocks.take_events()
            for event in events:
                kind = {
                    "stored": wpb.CacheEvent.STORED,
                    "removed": wpb.CacheEvent.REMOVED,
                    "cleared": wpb.CacheEvent.REMOVED,
                }[event.kind]
                message = wpb.CacheEvent(
                    kind=kind, block_hashes=list(event.block_hashes), block_size=self.core.config.block_size
                )
                for subscriber in self._subscribers:
                    subscriber.put(message)

    def status_message(self):
        with self.lock:
            running, waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        return self.status(running, waiting)


class _Servicer(wpb_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    def Prefill(self, request, context):  # noqa: N802
        with request_context(request.request_id):
            try:
                job = self.worker.accept(request)
            except WorkerError as e:
                context.abort(getattr(grpc.StatusCode, e.code), e.message)
            if not context.add_callback(lambda: self.worker.cancel(job)):  # the call ended already
                self.worker.cancel(job)
                return
            yield from stream_events(job.events, context, lambda event: event)

    def Status(self, request, context):  # noqa: N802
        return self.worker.status_message()

    def CacheEvents(self, request, context):  # noqa: N802
        events, snapshot = self.worker.subscribe()
        context.add_callback(lambda: self.worker.unsubscribe(events))
        yield wpb.CacheEvent(
            kind=wpb.CacheEvent.SNAPSHOT, block_hashes=snapshot, block_size=self.worker.core.config.block_size
        )
        yield from stream_events(events, context, lambda event: event)
