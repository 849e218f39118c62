"""The typed messages inside a worker: every loop refuses a command it has no case for, and
``stream_events`` turns a queue of events into a call's messages or its status, refusing anything else."""

from __future__ import annotations

import queue

import grpc
import pytest

from splitserve.colocated_worker.worker import ColocatedWorker
from splitserve.common.errors import ServingError
from splitserve.decode_worker.worker import DecodeWorker, _coalesce
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.scheduler.request import Request
from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.rpc import workers_pb2 as wpb
from splitserve.v1 import splitserve_pb2 as pb
from splitserve.worker_common.base import stream_events
from splitserve.worker_common.messages import Add, Admit, Cancel, Drain, Emit, End, Fail, make_event_queue
from splitserve.worker_common.prefill_edge.jobs import PrefillJob

WORKERS = [PrefillWorker, ColocatedWorker, DecodeWorker]


def make_bare(cls):
    """A worker with no engine: enough for a command that must be refused before touching any state."""
    return cls.__new__(cls)


@pytest.mark.parametrize("cls", WORKERS)
@pytest.mark.parametrize("command", [object(), ("cancel", None), "drain", None], ids=repr)
def test_an_unknown_command_raises(cls, command):
    with pytest.raises(TypeError, match="unknown worker command"):
        make_bare(cls).handle_command(command)


@pytest.mark.parametrize(("cls", "command"), [(PrefillWorker, Admit(None)), (ColocatedWorker, Admit(None))])
def test_a_command_of_another_worker_raises(cls, command):
    """A prefill-side loop has no case for Admit (a decode command): it raises instead of guessing."""
    with pytest.raises(TypeError, match="unknown worker command Admit"):
        make_bare(cls).handle_command(command)


def test_a_decode_workers_add_is_a_request_it_prefills_itself():
    """Conditional disaggregation: Add on a decode worker queues a local prefill (served end to end in
    tests/serving/test_conditional.py), never an admission."""
    worker, seen = make_bare(DecodeWorker), []
    worker._add_local, worker._admit = seen.append, lambda job: pytest.fail("Add is not an admission")
    job = object()
    worker.handle_command(Add(job))
    assert seen == [job]


def test_commands_name_their_job_not_its_id():
    a, b = object(), object()
    assert Cancel(a) == Cancel(a) and Cancel(a) != Cancel(b) and Drain() == Drain()
    with pytest.raises(AttributeError):
        Cancel(a).job = b  # frozen


class FakeContext:
    def __init__(self) -> None:
        self.aborted: tuple | None = None

    def abort(self, code, details):
        self.aborted = (code, details)
        raise RuntimeError("aborted")  # as grpc's does: abort never returns


def make_tokens(*ids: int, index: int = 0) -> wpb.DecodeEvent:
    return wpb.DecodeEvent(tokens=wpb.Tokens(token_ids=list(ids), index=index))


def test_stream_events_yields_messages_until_end():
    events = make_event_queue()
    for event in (Emit(make_tokens(1)), Emit(make_tokens(2, index=1)), End(), Emit(make_tokens(3))):
        events.put(event)
    sent = list(stream_events(events, FakeContext()))
    assert [list(m.tokens.token_ids) for m in sent] == [[1], [2]]
    assert events.qsize() == 1  # nothing is read past End


def test_stream_events_ends_a_failed_call_with_its_status():
    events = make_event_queue()
    events.put(Emit(make_tokens(1)))
    events.put(Fail(ServingError("ABORTED", "KV transfer failed")))
    context = FakeContext()
    stream = stream_events(events, context)
    assert list(next(stream).tokens.token_ids) == [1]
    with pytest.raises(RuntimeError, match="aborted"):
        next(stream)
    assert context.aborted == (grpc.StatusCode.ABORTED, "KV transfer failed")


@pytest.mark.parametrize("item", [make_tokens(1), None, ServingError("INTERNAL", "x"), "end"], ids=repr)
def test_stream_events_refuses_anything_but_an_event(item):
    """A bare protobuf message, an exception or a sentinel on the queue is a bug, not something to send."""
    events = make_event_queue()
    events.put(item)
    with pytest.raises(TypeError, match="unknown worker event"):
        list(stream_events(events, FakeContext()))


def test_decode_coalesces_queued_tokens_and_keeps_what_follows():
    events = make_event_queue()
    finished = Emit(wpb.DecodeEvent(finished=wpb.Finished()))
    for event in (Emit(make_tokens(2, index=1)), Emit(make_tokens(3, 4, index=2)), finished, End()):
        events.put(event)
    sent = list(stream_events(events, FakeContext(), merge=_coalesce))
    assert [m.WhichOneof("kind") for m in sent] == ["tokens", "finished"]
    assert list(sent[0].tokens.token_ids) == [2, 3, 4] and sent[0].tokens.index == 1


def test_decode_coalescing_keeps_each_tokens_logprobs_in_order():
    def entry(token: int) -> pb.TokenLogprobs:
        return pb.TokenLogprobs(token_id=token, logprob=-float(token), rank=1)

    events = make_event_queue()
    first = make_tokens(2, index=0)
    first.tokens.logprobs.append(entry(2))
    first.tokens.prompt_logprobs.append(entry(9))
    second = make_tokens(3, 4, index=1)
    second.tokens.logprobs.extend([entry(3), entry(4)])
    for event in (Emit(first), Emit(second), End()):
        events.put(event)
    (sent,) = list(stream_events(events, FakeContext(), merge=_coalesce))
    assert list(sent.tokens.token_ids) == [2, 3, 4]
    assert [e.token_id for e in sent.tokens.logprobs] == [2, 3, 4]
    assert [e.token_id for e in sent.tokens.prompt_logprobs] == [9]


def test_decode_coalescing_leaves_other_messages_alone():
    events: queue.Queue = make_event_queue()
    events.put(Emit(make_tokens(9)))
    landed = wpb.DecodeEvent(landed=wpb.KVLanded(wait_ms=1.0, bytes=10))
    assert _coalesce(landed, events) is landed
    assert events.qsize() == 1


def test_prefill_job_first_token_marks_it_done_with_its_timing():
    request = Request.resume("r1", [1, 2, 3], [7], SamplingParams(), 0)
    job = PrefillJob(request, destination=None)
    job.arrival, job.first_scheduled = 100.0, 100.25
    first = job.first_token(request)
    assert job.done and job.first_token_at is not None
    assert first.token_id == 7 and first.queue_ms == pytest.approx(250.0)
