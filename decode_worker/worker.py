"""The decode worker: leases blocks, receives each request's KV, decodes in one continuous batch and
streams token ids back to the router.

A request's life here (it exists exactly as long as the router's ``Decode`` call)::

    lease granted (blocks allocated) ─▶ waiting for KV ─▶ KV landed: joins the batch ─▶ tokens ...
           │ refused: no room                  │ transfer failed / cancelled       ├─▶ Finished
           ▼                                   ▼                                   └─▶ Preempted
        (call ends)                     blocks freed, call ends               (out of blocks: blocks
                                                                               freed; the router
                                                                               re-prefills elsewhere)

The request starts decoding only after every layer of its KV has landed; the first token and the
sampling state come with the transfer's commit. A cancelled call frees the request in any phase.

A request with ``n`` > 1 samples (``worker_common.samples``) is one job and one call: once its KV landed,
samples 1 to n - 1 are forked from it and join the batch beside it; Tokens, Finished and Preempted name
their sample, and the job ends with its last sample (a cancel ends them all).
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

import grpc

from splitserve.common.errors import ServingError
from splitserve.engine.sampling.params import SamplingParams, SamplingParamsError
from splitserve.engine.wire import (
    FINISH_TO_PB,
    logprobs_to_pb,
    prompt_logprobs_to_pb,
    sampling_from_pb,
    stop_reason_text,
)
from splitserve.kv_transfer.handles import TransferHandle, TransferState
from splitserve.kv_transfer.receiver import KVReceiver
from splitserve.kv_transfer.sender import PeerAddress
from splitserve.kv_transfer.service import KVTransferServicer
from splitserve.observability.logs import request_context
from splitserve.rpc import kv_transfer_pb2_grpc
from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc import workers_pb2_grpc as wpb_grpc
from splitserve.rpc.status import abort
from splitserve.worker_common.base import WorkerBase, ms_since, stream_events
from splitserve.worker_common.config import WorkerConfig
from splitserve.worker_common.engine_api import Engine, FinishReason, Request
from splitserve.worker_common.messages import (
    Add,
    Admit,
    Cancel,
    Command,
    Drain,
    Emit,
    End,
    Event,
    Fail,
    make_event_queue,
    unknown_command,
)
from splitserve.worker_common.samples import check_samples, fork_samples
from splitserve.worker_common.tp.kv import TPReceiver
from splitserve.worker_common.tp.rank_link import Ranks

log = logging.getLogger("splitserve.decode")

# Decode calls open at once beyond the leases held (max_inflight): lease asks being refused (at capacity,
# no blocks, draining), each answered at once, as the router tries the next worker. 16 leaves room to spare.
REFUSED_LEASE_CALLS = 16


@dataclass(eq=False)
class DecodeJob:
    request_id: str
    prompt: list[int]
    output: list[int]  # generated before this leg
    sampling: SamplingParams
    events: queue.Queue[Event] = field(default_factory=make_event_queue)
    leased_at: float = field(default_factory=time.monotonic)
    transfer: TransferHandle | None = None
    request: Request | None = None  # set once admitted into the batch
    n: int = 1  # samples of the prompt
    samples: dict[str, tuple[int, Request]] = field(
        default_factory=dict
    )  # engine id -> (sample, request), in the batch
    cancelled: bool = False
    ended: bool = False


class DecodeWorker(WorkerBase):
    scheduler_mode = {"preemption": "hand_back"}

    def __init__(self, config: WorkerConfig, ranks: Ranks | None = None, engine: Engine | None = None) -> None:
        super().__init__(config, ranks, engine)
        self.receiver = KVReceiver(
            self.engine.kv_cache,
            self.fingerprint,
            config.worker_id,
            host=config.host,
            config=config.transfer,
            faults=self.faults,
        )
        # A tensor-parallel worker receives a request's KV as one part per rank, into the same block ids.
        self.kv: KVReceiver | TPReceiver = self.receiver if ranks is None else TPReceiver(self.receiver, ranks)
        self.jobs: dict[str, DecodeJob] = {}
        self.forked: dict[str, DecodeJob] = {}  # engine ids of samples 1 to n - 1 -> their job

    @property
    def incarnation(self) -> str:
        return self.receiver.incarnation

    def max_request_calls(self) -> int:
        return self.config.max_inflight + REFUSED_LEASE_CALLS

    def add_services(self, server: grpc.Server) -> None:
        wpb_grpc.add_DecodeWorkerServicer_to_server(_Servicer(self), server)
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(self.receiver), server)

    def stop(self, grace_s: float = 1.0) -> None:
        super().stop(grace_s)
        self.receiver.close()

    def kv_pairs(self) -> int:
        return self.receiver.num_pairs()

    def kv_transfers(self) -> int:
        return self.receiver.num_transfers()

    # ---- leases, from handler threads -----------------------------------------------------------

    def lease(self, message: wpb.DecodeRequest) -> tuple[DecodeJob | None, wpb.DecodeEvent]:
        """Reserve blocks for a request's KV (handler thread); returns (job, grant) or (None, refusal)."""
        try:
            sampling = sampling_from_pb(message.sampling, draw_seed=False)
        except SamplingParamsError as e:
            raise ServingError("INVALID_ARGUMENT", str(e)) from None
        prompt, output = list(message.prompt_token_ids), list(message.output_token_ids)
        self.check_request(prompt + output, sampling)
        n = max(1, message.n)
        if n > 1 and (message.prefill_locally or output):
            raise ServingError("INVALID_ARGUMENT", "n: samples fork from a first leg's landed KV only")
        if (why := check_samples(self.engine, n)) is not None:
            raise ServingError("INVALID_ARGUMENT", why)
        if self.draining:
            return None, wpb.DecodeEvent(refused=wpb.LeaseRefused(reason="draining", free_blocks=0))
        engine = self.engine
        with self.lock:
            if message.request_id in self.jobs or self.kv.has_transfer(message.request_id):
                raise ServingError("ALREADY_EXISTS", f"request_id: {message.request_id!r} is already here")
            if len(self.jobs) >= self.config.max_inflight:
                refusal = wpb.LeaseRefused(
                    reason=f"at capacity ({self.config.max_inflight} requests, its max_inflight)",
                    free_blocks=engine.num_free_blocks,
                )
                return None, wpb.DecodeEvent(refused=refusal)
            # Room for the prompt's KV and the first token of this leg; decoding grows it step by step.
            leased = Request.resume(message.request_id, prompt, output, sampling, sampling.seed)
            if not engine.allocate(message.request_id, len(prompt) + len(output) + 1, leased):
                refusal = wpb.LeaseRefused(reason="not enough free KV blocks", free_blocks=engine.num_free_blocks)
                return None, wpb.DecodeEvent(refused=refusal)
            job = self.jobs[message.request_id] = DecodeJob(message.request_id, prompt, output, sampling, n=n)
        table = engine.block_table(message.request_id)  # without the lock: vLLM's admits it on the loop thread
        if not table:
            with self.lock:
                engine.free(message.request_id)
                del self.jobs[message.request_id]
            refusal = wpb.LeaseRefused(reason="not enough free KV blocks", free_blocks=engine.num_free_blocks)
            return None, wpb.DecodeEvent(refused=refusal)
        if message.prefill_locally:  # conditional disaggregation: no KV will arrive; prefill it here
            self.submit(Add(job))
            return job, wpb.DecodeEvent(lease=wpb.LeaseGranted(blocks=len(table)))
        try:
            job.transfer = self.kv.expect(message.request_id, table)
        except (ValueError, ServingError) as e:  # an earlier request with this id is still being torn down,
            with self.lock:  # or (tensor-parallel) a rank could not expect its part
                engine.free(message.request_id)
                del self.jobs[message.request_id]
            if isinstance(e, ServingError):
                raise
            raise ServingError(
                "ALREADY_EXISTS", f"request_id: {message.request_id!r} is still being released"
            ) from None
        job.transfer.on_terminal(lambda handle: self._kv_ended(job, handle))
        destination = self._destination()
        return job, wpb.DecodeEvent(lease=wpb.LeaseGranted(destination=destination, blocks=len(table)))

    def _destination(self) -> wpb.KVDestination:
        """Where the prefill worker sends the KV: this worker's KV-transfer endpoint, and with tensor
        parallelism every rank's."""
        rank0 = PeerAddress(self.config.worker_id, self.receiver.incarnation, self.address)
        destination = wpb.KVDestination(
            receiver_id=rank0.receiver_id, incarnation=rank0.incarnation, control_address=rank0.control
        )
        if isinstance(self.kv, TPReceiver):
            for peer in self.kv.destinations(rank0):
                destination.ranks.add(
                    receiver_id=peer.receiver_id, incarnation=peer.incarnation, control_address=peer.control
                )
        return destination

    def _kv_ended(self, job: DecodeJob, handle: TransferHandle) -> None:
        """The transfer ended (transfer or caller thread): admit on success, else give the lease back."""
        self.metrics.transfer_ended("received", handle)
        if handle.state is TransferState.FAILED:
            log.warning(
                "KV transfer of %s failed: %s", job.request_id, handle.error, extra={"request_id": job.request_id}
            )
        if handle.state is TransferState.DONE:
            self.submit(Admit(job))
            return
        # ABORTED, not UNAVAILABLE: this worker is fine (the sender may be the one lost); the router
        # runs the leg again without counting this worker out.
        self._end(job, Fail(ServingError("ABORTED", f"KV transfer {handle.state.value}: {handle.error}")))

    def cancel(self, job: DecodeJob) -> None:
        """The router's call ended (any reason): drop the job if it is still here (by job, not by id)."""
        self.submit(Cancel(job))

    # ---- the loop -------------------------------------------------------------------------------

    def handle_command(self, command: Command) -> None:
        match command:
            case Admit(job):
                self._admit(job)
            case Add(job):
                self._add_local(job)
            case Cancel(job):
                self._cancel(job)
            case Drain():  # hand every running request back to the router (it re-prefills elsewhere)
                for job in [j for j in self.jobs.values() if j.request is not None]:
                    for request_id, (_, request) in list(job.samples.items()):
                        self.engine.finish(request_id, FinishReason.PREEMPTED)
                        self._hand_back(job, request.output_token_ids, request_id)
            case _:
                raise unknown_command(command)

    def _cancel(self, job: DecodeJob) -> None:
        if job.ended or self.jobs.get(job.request_id) is not job:
            return
        job.cancelled = True
        if job.request is not None:
            for request_id in job.samples:
                self.engine.finish(request_id, FinishReason.ABORT)  # frees its blocks
            self._end(job, End())
        else:  # still waiting for its KV: _kv_ended frees the lease (or _admit, if the KV just landed)
            self.kv.cancel(job.request_id, "cancelled by the router")

    def _add_local(self, job: DecodeJob) -> None:
        """A request this worker prefills itself: it joins the batch as waiting, in its leased blocks, and
        its prompt is computed in chunks beside the decodes."""
        if job.ended or job.cancelled:
            self._end(job, End())
            return
        if self.draining:
            self._hand_back(job, job.output)
            return
        request = Request.resume(job.request_id, job.prompt, job.output, job.sampling, job.sampling.seed)
        try:
            with self.lock:
                self.engine.add(request)
                job.request = request
                job.samples[request.request_id] = (0, request)
        except ValueError as e:
            self._end(job, Fail(ServingError("INVALID_ARGUMENT", str(e))))

    def _admit(self, job: DecodeJob) -> None:
        if job.ended or job.cancelled:
            self._end(job, End())  # frees the lease
            return
        commit = job.transfer.commit  # its types and version were checked as it was decoded
        if commit is None or not 0 <= commit.first_token < self.engine.model.vocab_size:
            self._end(job, Fail(ServingError("INTERNAL", f"KV commit carries no valid first token: {commit!r}")))
            return
        first = commit.first_token
        if self.draining:  # the KV arrived at a draining worker: hand the request back right away
            for sample in range(1, job.n):  # samples never forked: each is re-prefilled on its own
                job.events.put(Emit(wpb.DecodeEvent(preempted=wpb.Preempted(output_token_ids=[], sample=sample))))
            self._hand_back(job, job.output + [first])
            return
        request = Request.resume(job.request_id, job.prompt, job.output + [first], job.sampling, job.sampling.seed)
        with self.lock:
            self.engine.add_running(request)
            job.request = request
            job.samples[request.request_id] = (0, request)
            for sample, child in enumerate(fork_samples(self.engine, request, job.n), start=1):
                job.samples[child.request_id] = (sample, child)
                self.forked[child.request_id] = job
        landed = wpb.KVLanded(wait_ms=ms_since(job.leased_at), bytes=job.transfer.nbytes)
        job.events.put(Emit(wpb.DecodeEvent(landed=landed)))

    def step(self) -> bool:
        scheduled = self.engine.schedule()
        for victim in scheduled.preempted:  # handed back: blocks already freed
            self._hand_back(self._job(victim.request_id), victim.output_token_ids, victim.request_id)
        if scheduled.is_empty:
            return False
        self.faults.step("decode")
        for request in self.engine.run(scheduled, "decode").advanced:
            self._advanced(self._job(request.request_id), request)
        self.faults.step_done()
        return True

    def _job(self, request_id: str) -> DecodeJob:
        """The job of an engine request: the request's own, or the one a forked sample belongs to."""
        job = self.jobs.get(request_id)
        return job if job is not None else self.forked[request_id]

    def _advanced(self, job: DecodeJob, request: Request) -> None:
        """The request got a token: stream it; a finished request ends here (the scheduler freed its blocks)."""
        sample = job.samples[request.request_id][0]
        tokens = wpb.Tokens(token_ids=[request.token_ids[-1]], index=request.num_output_tokens - 1, sample=sample)
        if request.logprobs:
            tokens.logprobs.append(logprobs_to_pb(request.logprobs[-1]))
        if job.transfer is None and request.num_output_tokens == len(job.output) + 1:  # prefilled here
            tokens.prompt_logprobs.extend(prompt_logprobs_to_pb(request.prompt_logprobs))
        job.events.put(Emit(wpb.DecodeEvent(tokens=tokens)))
        if request.is_finished:
            finished = wpb.Finished(
                finish_reason=FINISH_TO_PB[request.finish_reason],
                stop_reason=stop_reason_text(request.stop_reason),
                sample=sample,
            )
            self._sample_ended(job, request.request_id, wpb.DecodeEvent(finished=finished))

    def _hand_back(self, job: DecodeJob, output: list[int], request_id: str | None = None) -> None:
        sample = job.samples[request_id][0] if request_id in job.samples else 0
        event = wpb.DecodeEvent(preempted=wpb.Preempted(output_token_ids=output, sample=sample))
        self._sample_ended(job, request_id or job.request_id, event)

    def _sample_ended(self, job: DecodeJob, request_id: str, event: wpb.DecodeEvent) -> None:
        """One sample's last event; the job's last sample ends the job (and its call)."""
        with self.lock:
            job.samples.pop(request_id, None)
            self.forked.pop(request_id, None)
            others = bool(job.samples)
        if others:
            job.events.put(Emit(event))
        else:
            self._end(job, Emit(event))

    def _end(self, job: DecodeJob, last: Event) -> None:
        """End a job once: free its lease if it never joined the batch (a joined request's blocks are
        the scheduler's, freed by finish), release its transfer, then forget it. The job stays in
        ``jobs`` until then, so a new request with the same id cannot lease in between. ``last`` closes
        its call's queue (a last message is followed by End)."""
        with self.lock:
            if job.ended:
                return
            job.ended = True
            if job.request is None:
                self.engine.free(job.request_id)
            for request_id in job.samples:
                self.forked.pop(request_id, None)
        self.kv.release(job.request_id)  # may call back into _end: it returns at once
        with self.lock:
            if self.jobs.get(job.request_id) is job:
                del self.jobs[job.request_id]
        job.events.put(last)
        if isinstance(last, Emit):
            job.events.put(End())

    def fail_all(self, message: str) -> None:
        for job in list(self.jobs.values()):
            for request_id in [job.request_id, *job.samples]:
                self.engine.finish(request_id, FinishReason.ABORT)
            self._end(job, Fail(ServingError("INTERNAL", message)))

    def status_message(self):
        with self.lock:
            running = self.engine.num_running
            waiting = sum(1 for job in self.jobs.values() if job.request is None)
        return self.status(running, waiting)


class _Servicer(wpb_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    def Decode(self, request, context):  # noqa: N802
        with request_context(request.request_id):
            yield from self._decode(request, context)

    def _decode(self, request, context):
        try:
            job, first = self.worker.lease(request)
        except ServingError as e:
            abort(context, e)
        # Before the first yield: the code after a yield runs only if the caller reads on, and a
        # caller that cancels right after the grant must still free the lease. add_callback is
        # False when the call has ended already.
        if job is not None and not context.add_callback(lambda: self.worker.cancel(job)):
            self.worker.cancel(job)
            return
        yield first
        if job is None:
            return
        yield from stream_events(job.events, context, merge=_coalesce)

    def Status(self, request, context):  # noqa: N802
        return self.worker.status_message()


def _coalesce(event: wpb.DecodeEvent, events: queue.Queue[Event]) -> wpb.DecodeEvent:
    """Merge the token events already queued behind ``event`` into one message: a slow reader gets
    fewer, larger messages, and the queue holds at most one request's output, never more."""
    if event.WhichOneof("kind") != "tokens":
        return event
    merged = wpb.Tokens()
    merged.CopyFrom(event.tokens)
    while True:
        try:
            following = events.get_nowait()
        except queue.Empty:
            break
        match following:
            case Emit(message) if message.WhichOneof("kind") == "tokens" and message.tokens.sample == merged.sample:
                merged.token_ids.extend(message.tokens.token_ids)
                merged.logprobs.extend(message.tokens.logprobs)
                continue
        # Not a token: send the merged tokens now and this one next (put it back at the front).
        with events.mutex:
            events.queue.appendleft(following)
            events.not_empty.notify()
        break
    return wpb.DecodeEvent(tokens=merged)
