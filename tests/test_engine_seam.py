"""The engine seam (``splitserve.worker_common.engine_api``): the local engine satisfies the ``Engine``
interface, and a worker needs nothing of an engine beyond it (a fake engine drives a colocated worker's
requests from the call to its last token)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import pytest

from splitserve.colocated_worker.worker import ColocatedWorker
from splitserve.engine.core import EngineConfig
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.scheduler.request import RequestStatus
from splitserve.rpc import workers_pb2 as wpb
from splitserve.v1 import splitserve_pb2 as pb
from splitserve.worker_common.config import WorkerConfig
from splitserve.worker_common.engine_api import (
    Engine,
    FinishReason,
    KVRegion,
    ModelFacts,
    Request,
    ScheduledStep,
    StepKind,
    StepResult,
    TensorParallel,
)
from splitserve.worker_common.local_engine import LocalEngine
from splitserve.worker_common.messages import Emit, End

VOCAB = 100


@pytest.fixture(scope="module")
def local_engine(tiny_model_dir) -> LocalEngine:
    config = EngineConfig(model_dir=str(tiny_model_dir), dtype="float32", num_blocks=32)
    return LocalEngine.build(config, threading.RLock())


def test_the_local_engine_is_an_engine(local_engine):
    assert isinstance(local_engine, Engine) and isinstance(local_engine, TensorParallel)
    assert isinstance(local_engine.kv_cache, KVRegion)
    assert isinstance(local_engine.schedule(), ScheduledStep)
    facts = local_engine.model
    assert facts.block_size == 16 and facts.num_kv_heads == local_engine.kv_cache.spec.num_kv_heads
    assert local_engine.plan_channel is None and local_engine.decode_graphs == ""
    local_engine.keep_alive()  # no followers: nothing to tick


def test_the_local_engine_steps_a_request_to_its_end(local_engine):
    request = Request("r-0", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), seed=0)
    local_engine.add(request)
    assert (local_engine.num_waiting, local_engine.num_running) == (1, 0)
    kinds: list[StepKind] = []
    while not request.is_finished:
        result = local_engine.step()
        assert result.advanced == (request,) and result.preempted == ()
        kinds.append(result.kind)
    assert kinds == ["prefill", "decode", "decode"] and result.finished == (request,)
    assert request.num_output_tokens == 3 and request.finish_reason is FinishReason.LENGTH
    assert (local_engine.num_waiting, local_engine.num_running) == (0, 0)
    assert local_engine.kv_figures()[1] == 0  # its blocks are back (full ones stay in the prefix cache)
    assert local_engine.schedule().is_empty


def test_the_local_engine_refuses_a_step_of_another_engine(local_engine):
    with pytest.raises(TypeError, match="not a step of this engine"):
        local_engine.run(FakeStep(()))


def test_a_lease_is_allocated_and_freed_by_request_id(local_engine):
    free = local_engine.num_free_blocks
    assert local_engine.allocate("lease", 40)
    table = local_engine.block_table("lease")
    assert len(table) == 3 and local_engine.num_free_blocks == free - 3
    local_engine.free("lease")
    assert local_engine.num_free_blocks == free


# ---- a fake engine behind the interface ------------------------------------------------------


class FakeStep:
    def __init__(self, requests: tuple[Request, ...]) -> None:
        self.requests = requests

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def sampling(self) -> tuple[Request, ...]:
        return self.requests

    @property
    def preempted(self) -> tuple[Request, ...]:
        return ()

    @property
    def prompt_work(self) -> bool:
        return any(r.num_tokens - r.num_computed_tokens > 1 for r in self.requests)


class FakeEngine:
    """Computes a whole prompt in one step; each step's token is the last one plus one. No model, no blocks."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self.kinds: list[StepKind] = []
        self.model = ModelFacts(VOCAB, 2, 2, 8, "float32", "fake", 16)
        self.max_model_len = 64
        self.kv_cache = None  # nothing moves out of a colocated worker
        self.plan_channel = None
        self.decode_graphs = ""
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request

    def add_running(self, request: Request) -> None:
        request.num_computed_tokens = request.num_tokens - 1
        self.add(request)

    def finish(self, request_id: str, reason: FinishReason) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            request.status, request.finish_reason = RequestStatus.FINISHED, reason

    @property
    def num_running(self) -> int:
        return sum(r.num_computed_tokens > 0 for r in self.requests.values())

    @property
    def num_waiting(self) -> int:
        return len(self.requests) - self.num_running

    def schedule(self) -> FakeStep:
        return FakeStep(tuple(self.requests.values()))

    def run(
        self, step: ScheduledStep, kind: StepKind | None = None, on_layer_done: Callable[[int], None] | None = None
    ) -> StepResult:
        kind = kind or ("prefill" if step.prompt_work else "decode")
        self.kinds.append(kind)
        for request in step.requests:
            request.num_computed_tokens = request.num_tokens
            request.token_ids.append((request.token_ids[-1] + 1) % VOCAB)
            if request.num_output_tokens >= request.sampling.max_tokens:
                self.finish(request.request_id, FinishReason.LENGTH)
        if on_layer_done is not None:
            on_layer_done(self.model.num_layers)
        return StepResult(kind, step.requests)

    def step(self, kind: StepKind | None = None, on_layer_done: Callable[[int], None] | None = None) -> StepResult:
        return self.run(self.schedule(), kind, on_layer_done)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        return True

    def block_table(self, request_id: str) -> list[int]:
        return []

    def free(self, request_id: str) -> None:
        pass

    num_free_blocks = 0

    def kv_figures(self) -> tuple[int, int, int]:
        return 0, 0, 0

    def cached_hashes(self) -> list[int]:
        return []

    def take_block_events(self) -> list:
        return []

    prefix_block_size = 16

    def check_request(self, token_ids: list[int], sampling) -> None:
        if any(not 0 <= t < VOCAB for t in token_ids):
            raise ValueError("token_ids: outside the vocabulary")

    def keep_alive(self) -> None:
        pass

    def group_broken(self, error: Exception) -> bool:
        return False

    def close(self) -> None:
        pass


def drain(events: queue.Queue) -> list:
    out = []
    while not events.empty():
        out.append(events.get_nowait())
    return out


def test_a_fake_engine_drives_a_colocated_worker():
    engine = FakeEngine()
    assert isinstance(engine, Engine)
    config = WorkerConfig(role="colocated", worker_id="c-0", engine=EngineConfig(model_dir="unused"))
    worker = ColocatedWorker(config, engine=engine)
    sampling = pb.SamplingParams(max_tokens=3, seed=7)
    job = worker.accept(wpb.PrefillRequest(request_id="r-0", prompt_token_ids=[5, 6, 7], sampling=sampling))
    worker.handle_command(worker._inbox.get_nowait())  # the loop's Add
    assert worker.status_message().waiting == 1
    steps = 0
    while worker.step():
        steps += 1
    assert steps == 3 and engine.kinds == ["prefill", "decode", "decode"]
    events = drain(job.events)
    first, tokens, finished, end = events[0], events[1:3], events[3], events[4]
    assert isinstance(first, Emit) and first.message.first_token.token_id == 8
    assert [e.message.tokens.token_ids[0] for e in tokens] == [9, 10]
    assert [e.message.tokens.index for e in tokens] == [1, 2]
    assert finished.message.finished.finish_reason == pb.FINISH_REASON_LENGTH
    assert isinstance(end, End) and not worker.jobs
    status = worker.status_message()
    assert (status.running, status.waiting, status.kv_blocks_total) == (0, 0, 0)


def test_a_worker_on_the_local_engine_reports_its_linear_kernels(local_engine):
    """The status a worker sends carries the engine's compute dtype and every linear shape's kernel."""
    config = WorkerConfig(role="colocated", worker_id="c-1", engine=local_engine.core.config)
    worker = ColocatedWorker(config, engine=local_engine)
    kernels = worker.status_message().linear_kernels
    assert kernels == local_engine.linear_kernels and kernels.startswith("float32; ")
    assert "128x128 float32 plain" in kernels  # o_proj: too small to time, plain
