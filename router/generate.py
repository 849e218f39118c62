"""One request's journey through the router, as an async generator of client messages.

    queue ─▶ prefill credit ─▶ decode lease ─▶ Prefill ─▶ first token to the client at once
                                                   │
                                decode stream: tokens ─▶ detokenize ─▶ stop strings ─▶ client
                                                   │
                                    Finished ─▶ final message (finish reason, usage, timing)
                                    Preempted ─▶ back to the queue with prompt + output (re-prefill)

Metrics are observed from the same clock readings as the final message's timing (router/metrics.py).

The request lives on a worker exactly as long as the router's call to it: whatever ends this
generator (the last token, a stop string, the client's cancel or deadline, an error) cancels the
calls still open, and the workers free what they hold.

A request with ``n`` > 1 samples is one ``RequestRun`` per sample (router/samples.py): sample 0's first
leg carries the others (``forks``): one prefill, one KV transfer, and the decode (or colocated) worker
forks them on the same call, whose events name their sample (``_decode_samples``). A fork that does not
finish on that call (handed back, its worker lost) continues on legs of its own, as any request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

import grpc

from splitserve.common.errors import ServingError
from splitserve.engine.kv_cache.block_hash import block_hashes
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.scheduler.scheduler import stop_reason
from splitserve.engine.text.detokenizer import IncrementalDetokenizer
from splitserve.engine.text.stop_strings import StopStringMatcher
from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.engine.wire import FINISH_TO_PB, finish_label, sampling_to_pb, stop_reason_text
from splitserve.router.config import RouterConfig
from splitserve.router.dispatcher import Dispatcher, Ticket
from splitserve.router.metrics import Outcome, RequestSummary, RouterMetrics
from splitserve.router.workers import read_call, start_call
from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc.status import from_status
from splitserve.v1 import splitserve_pb2 as pb

log = logging.getLogger("splitserve.router")


@dataclass
class Clock:
    arrival: float = field(default_factory=time.monotonic)
    dispatched: float | None = None
    first_token: float | None = None
    last_relay: float | None = None
    transfer_ms: float = 0.0  # the last leg's (LegTransfer.ms)
    reprefills: int = 0

    def timing(self, prefill_worker: str, decode_worker: str) -> pb.Timing:
        now = time.monotonic()
        ms = lambda a, b: ((b or now) - (a or now)) * 1e3  # noqa: E731
        return pb.Timing(
            queue_ms=ms(self.arrival, self.dispatched),
            prefill_ms=ms(self.dispatched, self.first_token),
            transfer_ms=self.transfer_ms,
            first_token_ms=ms(self.arrival, self.first_token),
            decode_ms=ms(self.first_token, now),
            total_ms=ms(self.arrival, now),
            prefill_worker=prefill_worker,
            decode_worker=decode_worker,
            reprefills=self.reprefills,
        )


@dataclass
class LegTransfer:
    """One leg's KV transfer, from the prefill worker's result or, if the leg ends before that is read,
    from the decode worker's landing (both arrive; whichever the router reads first stands in)."""

    first_token: float  # this leg's first token (router clock)
    landed_ms: float | None = None  # first token until the decode worker said the KV landed
    result_ms: float | None = None  # the prefill worker's figure: first token until every layer was acknowledged
    nbytes: int = 0

    @property
    def ms(self) -> float | None:
        return self.result_ms if self.result_ms is not None else self.landed_ms


class WorkerLost(Exception):
    """A worker call failed at the transport (the worker died, its node was lost, it was drained)."""

    def __init__(self, role: str, worker, message: str, worker_failed: bool = True) -> None:
        super().__init__(message)
        self.role, self.worker, self.message = role, worker, message
        self.worker_failed = worker_failed  # False: the leg failed (a KV transfer) but the worker is fine


class RequestRun:
    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        tokenizer: Tokenizer,
        dispatcher: Dispatcher,
        config: RouterConfig,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.request_id, self.prompt, self.sampling = request_id, prompt, sampling
        self.dispatcher, self.config = dispatcher, config
        self.metrics = metrics or RouterMetrics()
        self.sampling_pb = sampling_to_pb(sampling)
        # A leg that re-prefills output comes after the first token, which carried the prompt's
        # log-probabilities: it does not ask for them again (and may then use the prefix cache).
        self.resume_pb = sampling_to_pb(replace(sampling, prompt_logprobs=None))
        self.hashes = block_hashes(prompt, config.block_size)
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, prompt, sampling.skip_special_tokens)
        self.stops = StopStringMatcher(sampling.stop, sampling.include_stop_str_in_output)
        self.output: list[int] = []  # every generated token, in order (all relayed to the client)
        self.cached_tokens: int | None = None
        self.finish_reason = pb.FINISH_REASON_UNSPECIFIED
        self.stop_reason = ""
        self.clock = Clock()
        self.prefill_worker = self.decode_worker = ""
        self.prefill_retries = self.migrations = 0
        self.transfer_failure: WorkerLost | None = None  # set when the KV of this leg will not arrive
        self.timing: pb.Timing | None = None  # set with the final message
        # n > 1 (router/samples.py): the client's id (a sample runs on workers under an id of its own), this
        # sample's index, the other samples (sample 0, on its first leg only), and where a fork goes that
        # must continue alone.
        self.public_id = request_id
        self.choice = 0
        self.forks: list[RequestRun] = []
        self.on_detach = lambda run: None
        # The prompt's log-probabilities from this run's first token (sample 0's are its forks' too).
        self.prompt_logprobs: list[pb.TokenLogprobs] = []
        self.final_sent = False

    async def run(self):
        """Legs until finished: a lost prefill worker retries the leg elsewhere, a lost decode worker
        migrates the request (re-prefill prompt + output elsewhere), each within its limit."""
        while self.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            try:
                try:
                    async for message in self._leg():
                        yield message
                finally:
                    self._detach_forks()
            except WorkerLost as lost:
                if lost.worker_failed:
                    self.dispatcher.pool.lost(lost.worker)
                if self.output and self._ended_by_output():  # only the Finished message was lost
                    log.warning("request %s: %s after its last token; finished", self.request_id, lost.message)
                    continue
                log.warning(
                    "request %s: %s; %s",
                    self.request_id,
                    lost.message,
                    "retrying its prefill" if not self.output else f"migrating it ({len(self.output)} tokens out)",
                )
                if not self.output:  # nothing reached the client yet: retry the prefill
                    self.prefill_retries += 1
                    self.metrics.prefill_retries.inc()
                    if self.prefill_retries > self.config.max_prefill_retries:
                        raise ServingError(
                            "UNAVAILABLE", f"{lost.message}; gave up after {self.prefill_retries - 1} retries"
                        ) from None
                else:
                    self.migrations += 1
                    self.clock.reprefills += 1
                    self.metrics.migrations.inc()
                    if self.migrations > self.config.max_migrations:
                        raise ServingError(
                            "UNAVAILABLE", f"{lost.message}; gave up after {self.migrations - 1} migrations"
                        ) from None
        if not self.final_sent:  # a sample's last message may have gone out on its first leg
            yield self._final()

    def _detach_forks(self) -> None:
        """After a leg that carried forks: those that did not finish on it continue on legs of their own,
        but while this run is still to generate its first token (the leg is retried: a prefill worker
        lost, a KV transfer failed) the forks with no output ride its next leg."""
        retried = not self.output and self.finish_reason == pb.FINISH_REASON_UNSPECIFIED
        forks, self.forks = self.forks, []
        for fork in forks:
            if retried and not fork.output and not fork.final_sent:
                self.forks.append(fork)
            elif not fork.final_sent:
                self.on_detach(fork)

    async def _leg(self):
        """Prefill prompt + output so far, then decode until finished or handed back."""
        calls: list = []
        ticket = Ticket(self.request_id, len(self.prompt) + len(self.output), self.hashes)
        if not self.forks and self.dispatcher.prefill_locally(ticket, self.sampling.max_tokens - len(self.output)):
            async for message in self._local_leg(ticket):
                yield message
            return
        prefill = await self.dispatcher.dispatch(ticket)
        if self.clock.dispatched is None:
            self.clock.dispatched = time.monotonic()
            self.metrics.queue.observe(self.clock.dispatched - self.clock.arrival)
        self.prefill_worker = prefill.worker_id
        for fork in self.forks:
            fork.clock.dispatched, fork.prefill_worker = self.clock.dispatched, prefill.worker_id
        if prefill.spec.role == "colocated":
            async for message in self._colocated_leg(prefill, ticket):
                yield message
            return
        decode = call = grant = leg = None
        try:
            try:
                if self.sampling.max_tokens - len(self.output) > 1:
                    request = wpb.DecodeRequest(
                        request_id=self.request_id,
                        prompt_token_ids=self.prompt,
                        output_token_ids=self.output,
                        sampling=self._leg_sampling,
                        n=len(self.forks) + 1 if self.forks else 0,
                    )
                    deadline = time.monotonic() + self.config.lease_timeout_s
                    decode, call, grant = await self.dispatcher.lease(
                        request, len(self.prompt) + len(self.output), deadline
                    )
                    calls.append(call)
                    self.decode_worker = decode.worker_id
                    for fork in self.forks:
                        fork.decode_worker = decode.worker_id
                prefill_call = _start(
                    prefill.stub.Prefill,
                    wpb.PrefillRequest(
                        request_id=self.request_id,
                        prompt_token_ids=self.prompt,
                        output_token_ids=self.output,
                        sampling=self._leg_sampling,
                        destination=grant.destination if grant else None,
                    ),
                    "prefill",
                    prefill,
                )
                calls.append(prefill_call)
                first = (await _read(prefill_call, "prefill", prefill)).first_token
            finally:
                self.dispatcher.release(prefill, ticket)
            leg = LegTransfer(self._first_token(first))
            yield self._relay_first(first)
            no_decode = first.finish_reason != pb.FINISH_REASON_UNSPECIFIED or call is None  # no KV moves
            if no_decode:
                self._finish(first.finish_reason or pb.FINISH_REASON_LENGTH, first.stop_reason)
            # A stop string in sample 0's first token ends it only: its forks still decode on this call.
            if no_decode or (self.finish_reason != pb.FINISH_REASON_UNSPECIFIED and not self.forks):
                return
            self.transfer_failure = None
            transfer = asyncio.create_task(self._await_transfer(prefill_call, prefill, call, leg))
            try:
                decoded = (
                    self._decode_samples(call, decode, leg=leg) if self.forks else self._decode(call, decode, leg=leg)
                )
                async for message in decoded:
                    yield message
            except (WorkerLost, ServingError):
                if self.transfer_failure is not None:  # the decode call was ended for it, not by its worker
                    raise self.transfer_failure from None
                raise
            finally:
                transfer.cancel()
        finally:
            for c in calls:  # a finished call ignores this; an open one frees the request on its worker
                c.cancel()
            if decode is not None:
                self.dispatcher.lease_ended(decode)
            if leg is not None and leg.ms is not None:  # this leg moved KV
                self.clock.transfer_ms = leg.ms
                self.metrics.kv_transfer(leg.ms / 1e3, leg.nbytes)

    async def _colocated_leg(self, worker, ticket: Ticket):
        """A colocated worker does both phases on one call; it holds the credit to the end."""
        self.decode_worker = worker.worker_id
        call = _start(
            worker.stub.Prefill,
            wpb.PrefillRequest(
                request_id=self.request_id,
                prompt_token_ids=self.prompt,
                output_token_ids=self.output,
                sampling=self._leg_sampling,
                n=len(self.forks) + 1 if self.forks else 0,
            ),
            "colocated",
            worker,
        )
        for fork in self.forks:
            fork.decode_worker = worker.worker_id
        try:
            first = (await _read(call, "colocated", worker)).first_token
            self.dispatcher.prefilled(worker, ticket)
            self._first_token(first)
            yield self._relay_first(first)
            if self.forks:  # the worker forks them after the first token, even one that ended sample 0
                async for message in self._decode_samples(call, worker, "colocated"):
                    yield message
            elif self.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
                async for message in self._decode(call, worker, "colocated"):
                    yield message
        finally:
            call.cancel()  # a finished call ignores this; an open one frees the request on the worker
            self.dispatcher.release(worker, ticket)

    async def _local_leg(self, ticket: Ticket):
        """Conditional disaggregation: the decode worker prefills the request itself and streams every
        token of the leg, the first one included; no prefill worker, no KV transfer."""
        request = wpb.DecodeRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt,
            output_token_ids=self.output,
            sampling=self._leg_sampling,
            prefill_locally=True,
        )
        deadline = time.monotonic() + self.config.lease_timeout_s
        decode, call, _ = await self.dispatcher.lease(request, ticket.num_tokens, deadline)
        if self.clock.dispatched is None:
            self.clock.dispatched = time.monotonic()
            self.metrics.queue.observe(self.clock.dispatched - self.clock.arrival)
        self.prefill_worker = self.decode_worker = decode.worker_id
        self.metrics.local_prefills.inc()
        try:
            async for message in self._decode(call, decode):
                yield message
        finally:
            call.cancel()
            self.dispatcher.lease_ended(decode)

    def _first_token(self, first: wpb.FirstToken) -> float:
        """A leg's first token arrived; the request's first one sets TTFT and the cached tokens.
        Returns the time it arrived."""
        now = time.monotonic()
        if self.clock.first_token is None:
            self.clock.first_token, self.cached_tokens = now, first.cached_tokens
            if self.choice:  # the request's time to first token is its sample 0's
                return now
            self.metrics.first_token(
                now - self.clock.arrival, now - self.clock.dispatched, len(self.prompt), first.cached_tokens
            )
        return now

    async def _decode(self, call, worker, role: str = "decode", leg: LegTransfer | None = None):
        while True:
            event = await _read(call, role, worker)
            kind = event.WhichOneof("kind")
            if kind == "landed" and leg is not None:
                leg.landed_ms = (time.monotonic() - leg.first_token) * 1e3
                leg.nbytes = leg.nbytes or event.landed.bytes
            elif kind == "tokens":  # skip any the client already has (a re-prefilled leg restarts at len(output))
                if self.clock.first_token is None:  # a decode worker that prefilled the request itself
                    self._first_token(wpb.FirstToken(token_id=event.tokens.token_ids[0]))
                skip = max(0, len(self.output) - event.tokens.index)
                new = list(event.tokens.token_ids)[skip:]
                if new:
                    yield self._relay(new, event.tokens.logprobs[skip:], event.tokens.prompt_logprobs)
                if self.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    return  # a stop string matched: leaving cancels the decode call
            elif kind == "finished":
                self._finish(event.finished.finish_reason, event.finished.stop_reason)
                return
            elif kind == "preempted":  # re-prefill prompt + output on another leg
                self.output = list(event.preempted.output_token_ids)
                self.clock.reprefills += 1
                self.metrics.preemptions.inc()
                return

    async def _decode_samples(self, call, worker, role: str = "decode", leg: LegTransfer | None = None):
        """The first leg's call of a request with n > 1 samples: each event names its sample (0: this run,
        i: ``forks[i - 1]``). Every sample's messages go out as they come, its last one as soon as it ends
        here. The call is read until every sample has ended on the worker; one that a stop string ended
        here is only no longer relayed (the worker decodes it on, to its EOS or max_tokens). A handed-back
        sample continues on legs of its own once the call has ended (``run``, ``_detach_forks``)."""
        runs = [self, *self.forks]
        unfinished = pb.FINISH_REASON_UNSPECIFIED
        relayed = set()  # samples still relayed to the client
        for i, run in enumerate(runs):
            if run.finish_reason == unfinished:
                relayed.add(i)
            else:  # sample 0, ended by a stop string in its first token
                yield run._final()
        on_worker = set(range(len(runs)))
        while on_worker:
            event = await _read(call, role, worker)
            kind = event.WhichOneof("kind")
            if kind == "landed" and leg is not None:
                leg.landed_ms = (time.monotonic() - leg.first_token) * 1e3
                leg.nbytes = leg.nbytes or event.landed.bytes
            elif kind == "tokens" and event.tokens.sample in relayed:
                run = runs[event.tokens.sample]
                if run.clock.first_token is None:  # a forked sample's first token, sampled on the worker
                    run._first_token(wpb.FirstToken(token_id=event.tokens.token_ids[0]))
                skip = max(0, len(run.output) - event.tokens.index)
                new = list(event.tokens.token_ids)[skip:]
                if new:  # a fork's first message carries the prompt's log-probabilities, computed by sample 0's
                    prompt_logprobs = self.prompt_logprobs if run is not self else event.tokens.prompt_logprobs
                    yield run._relay(new, event.tokens.logprobs[skip:], prompt_logprobs)
                if run.finish_reason != unfinished:  # a stop string matched
                    relayed.discard(event.tokens.sample)
                    yield run._final()
            elif kind == "finished":
                on_worker.discard(event.finished.sample)
                if event.finished.sample in relayed:
                    relayed.discard(event.finished.sample)
                    run = runs[event.finished.sample]
                    run._finish(event.finished.finish_reason, event.finished.stop_reason)
                    yield run._final()
            elif kind == "preempted":  # this sample goes on alone: re-prefill prompt + its output
                sample = event.preempted.sample
                on_worker.discard(sample)
                if sample in relayed:
                    relayed.discard(sample)
                    runs[sample].output = list(event.preempted.output_token_ids)
                    runs[sample].clock.reprefills += 1
                    self.metrics.preemptions.inc()

    async def _await_transfer(self, prefill_call, prefill, decode_call, leg: LegTransfer) -> None:
        """After the first token the prefill call reports the KV transfer. If it fails, or the prefill
        worker is lost before reporting, the KV will never land: the decode call is ended at once (the
        decode worker frees the lease) and the leg runs again, rather than waiting out the decode
        worker's transfer deadline."""
        try:
            while (event := await read_call(prefill_call)) is not grpc.aio.EOF:  # read_call: a closed channel too
                if event.WhichOneof("kind") != "transfer":
                    continue
                if event.transfer.ok:
                    leg.result_ms = event.transfer.transfer_ms
                    leg.nbytes = event.transfer.bytes or leg.nbytes
                    return
                self.metrics.transfer_failures.inc()
                failure = WorkerLost(
                    "prefill",
                    prefill,
                    f"KV transfer from {prefill.worker_id} failed: {event.transfer.error}",
                    worker_failed=False,
                )
                break
            else:
                return
        except grpc.aio.AioRpcError as e:
            failure = WorkerLost(
                "prefill",
                prefill,
                f"prefill worker {prefill.worker_id} failed before its KV "
                f"transfer ended: {e.code().name}: {e.details()}",
            )
        self.transfer_failure = failure
        decode_call.cancel()

    @property
    def _leg_sampling(self) -> pb.SamplingParams:
        return self.resume_pb if self.output else self.sampling_pb

    def _relay_first(self, first: wpb.FirstToken) -> pb.GenerateResponse:
        logprobs = [first.logprobs] if first.HasField("logprobs") else []
        if not self.output:
            self.prompt_logprobs = list(first.prompt_logprobs)
        return self._relay([first.token_id], logprobs, first.prompt_logprobs)

    def _relay(self, tokens: list[int], logprobs=(), prompt_logprobs=()) -> pb.GenerateResponse:
        """Tokens to the client, with the text they complete (held back while it may become a stop), their
        log-probabilities and, with the first token, the prompt's. Its own cost is the relay's metric."""
        start = time.perf_counter()
        index = len(self.output)
        now = time.monotonic()
        self.metrics.relayed(len(tokens), now - self.clock.last_relay if self.clock.last_relay is not None else None)
        self.clock.last_relay = now
        self.dispatcher.relayed(len(tokens))
        self.output.extend(tokens)
        text, stop = self.stops.feed(self.detok.add_tokens(tokens))
        if stop is not None:
            self._finish(pb.FINISH_REASON_STOP, stop)
        response = pb.GenerateResponse(
            request_id=self.public_id,
            choice=self.choice,
            token_ids=tokens,
            text=text,
            index=index,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs if index == 0 else (),
        )
        self.metrics.relay_cost(len(tokens), time.perf_counter() - start)
        return response

    def _ended_by_output(self) -> bool:
        """Whether the tokens relayed so far already end the request (its worker was lost between the
        last token and the Finished message), by the engine's own rule; a new leg would generate past it."""
        reason = stop_reason(self.sampling, self.eos_token_ids, len(self.output), self.output[-1], False)
        if reason is not None:
            self._finish(FINISH_TO_PB[reason[0]], stop_reason_text(reason[1]))
        return self.finish_reason != pb.FINISH_REASON_UNSPECIFIED

    def _finish(self, reason: int, stop_reason: str) -> None:
        if self.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason, self.stop_reason = reason, stop_reason

    def _final(self) -> pb.GenerateResponse:
        text = ""
        if self.stops.matched is None:
            text, stop = self.stops.feed(self.detok.flush())
            if stop is None:
                text += self.stops.flush()
                stop = self.stops.matched
            if stop is not None:
                self.finish_reason, self.stop_reason = pb.FINISH_REASON_STOP, stop
        usage = pb.Usage(
            prompt_tokens=len(self.prompt), completion_tokens=len(self.output), cached_tokens=self.cached_tokens or 0
        )
        self.timing = self.clock.timing(self.prefill_worker, self.decode_worker)
        self.final_sent = True
        return pb.GenerateResponse(
            request_id=self.public_id,
            choice=self.choice,
            text=text,
            index=len(self.output),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            usage=usage,
            timing=self.timing,
        )

    def summary(self, outcome: Outcome, status: str, message: str = "") -> RequestSummary:
        """How the request ended, with the final message's timing (or the timing so far)."""
        finished = outcome == "finished"
        timing = self.timing
        if not finished or timing is None:
            timing = self.clock.timing(self.prefill_worker, self.decode_worker)
        finish_reason = finish_label(self.finish_reason) if finished else ""
        return RequestSummary(
            self.request_id,
            outcome,
            status,
            message,
            finish_reason,
            len(self.prompt),
            len(self.output),
            self.cached_tokens or 0,
            timing,
        )


_FATAL = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS)


def _call_failed(e: grpc.aio.AioRpcError, role: str, worker) -> Exception:
    """What a failed worker call means: a request error ends the client's call (ServingError); a
    transport failure (the worker or its node lost) is WorkerLost, which retries or migrates."""
    code = e.code()
    if code in _FATAL:
        return from_status(code, e.details())
    if code == grpc.StatusCode.ABORTED:
        return WorkerLost(role, worker, f"{role} worker {worker.worker_id}: {e.details()}", worker_failed=False)
    return WorkerLost(role, worker, f"{role} worker {worker.worker_id} failed: {code.name}: {e.details()}")


def _start(method, request, role: str, worker):
    """A worker call, started; a worker that left the pool since it was chosen is WorkerLost."""
    try:
        return start_call(method, request)
    except grpc.aio.AioRpcError as e:
        raise _call_failed(e, role, worker) from None


async def _read(call, role: str, worker):
    """The next event of a worker call (errors as ``_call_failed`` says)."""
    try:
        event = await read_call(call)
    except grpc.aio.AioRpcError as e:
        raise _call_failed(e, role, worker) from None
    if event is grpc.aio.EOF:
        raise WorkerLost(role, worker, f"{role} worker {worker.worker_id} ended the request without a result")
    return event
