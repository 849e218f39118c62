"""One thread of a worker builds and runs its model (``worker_common.model_thread``), and the worker's other
threads run their torch work on themselves alone (``engine.threads.serial_torch``)."""

from __future__ import annotations

import threading

import pytest
import torch

from splitserve.colocated_worker.worker import ColocatedWorker
from splitserve.engine.core import EngineConfig
from splitserve.engine.threads import serial_torch, set_torch_threads
from splitserve.kv_transfer.endpoint import Endpoint
from splitserve.rpc import workers_pb2 as wpb
from splitserve.v1 import splitserve_pb2 as pb
from splitserve.worker_common.config import WorkerConfig
from splitserve.worker_common.local_engine import LocalEngine
from splitserve.worker_common.model_thread import ModelThread
from tests.threads import Background


def test_calls_and_the_loop_run_on_one_thread_in_order():
    mt = ModelThread("model-x", num_threads=2)
    seen: list[tuple[str, int]] = []
    first = mt.call(lambda: (seen.append((threading.current_thread().name, torch.get_num_threads())), 7)[1])
    assert first == 7
    mt.call(lambda: seen.append((threading.current_thread().name, torch.get_num_threads())))
    done = threading.Event()
    thread = mt.run(lambda: (seen.append((threading.current_thread().name, torch.get_num_threads())), done.set()))
    assert done.wait(5) and thread is mt.thread
    thread.join(5)
    assert not thread.is_alive()  # the loop returned: the thread ended
    assert seen == [("model-x", 2)] * 3
    with pytest.raises(RuntimeError, match="has ended"):
        mt.call(lambda: None)


def test_a_call_that_raises_raises_in_the_caller_and_the_thread_goes_on():
    mt = ModelThread("model-y")
    with pytest.raises(ValueError, match="bad weights"):
        mt.call(lambda: (_ for _ in ()).throw(ValueError("bad weights")))
    assert mt.call(lambda: threading.current_thread().name) == "model-y"
    mt.close()
    mt.thread.join(5)
    assert not mt.thread.is_alive()


def test_close_before_any_call_starts_no_thread():
    mt = ModelThread("model-z")
    mt.close()
    assert mt.thread is None
    with pytest.raises(RuntimeError):
        mt.run(lambda: None)


def test_serial_torch_on_another_thread_leaves_the_model_threads_count():
    """The model thread keeps its count when a handler thread, started later, takes one thread."""
    mt = ModelThread("model-w", num_threads=2)
    assert mt.call(torch.get_num_threads) == 2

    def handler() -> tuple[int, float]:
        serial_torch()
        out = torch.randn(512, 512) @ torch.randn(512, 512)  # big enough to go parallel with more threads
        return torch.get_num_threads(), float(out.abs().sum())

    set_torch_threads(2)  # the process-wide count a new thread starts from
    threads, total = Background(handler).result(30)
    assert threads == 1 and total > 0
    assert mt.call(torch.get_num_threads) == 2
    mt.close()
    # serial_torch changed the handler's thread only: a thread started after it still starts from 2.
    assert Background(torch.get_num_threads).result(30) == 2


def test_kv_transfer_threads_compute_on_themselves_alone():
    """Every thread a transfer endpoint starts (lanes, ack readers, the deadline watcher) is serial."""
    seen: list[int] = []
    done = threading.Event()

    class Probe(Endpoint):
        role = "decode"

    set_torch_threads(2)
    endpoint = Probe(None)
    try:
        endpoint._spawn(lambda: (seen.append(torch.get_num_threads()), done.set()), "kv-probe")
        assert done.wait(10) and seen == [1]
    finally:
        endpoint.close()
    assert torch.get_num_threads() == 2  # the caller's own count is untouched


def test_a_worker_builds_its_engine_on_the_thread_that_runs_its_loop(tiny_model_dir, monkeypatch):
    built_on: list[threading.Thread] = []
    build = LocalEngine.build

    def recording_build(*args, **kwargs):
        built_on.append(threading.current_thread())
        return build(*args, **kwargs)

    monkeypatch.setattr(LocalEngine, "build", staticmethod(recording_build))
    engine = EngineConfig(model_dir=str(tiny_model_dir), dtype="float32", num_blocks=32, num_threads=1)
    config = WorkerConfig(role="colocated", worker_id="c-mt", engine=engine, host="127.0.0.1", port=0)
    worker = ColocatedWorker(config)
    try:
        assert len(built_on) == 1 and built_on[0] is not threading.current_thread()
        assert built_on[0].name == "colocated-loop"
        worker.start()
        assert worker._thread is built_on[0]  # the same thread now runs the loop
        sampling = pb.SamplingParams(max_tokens=2, seed=7)
        job = worker.accept(wpb.PrefillRequest(request_id="r-mt", prompt_token_ids=[3, 4, 5], sampling=sampling))
        events = [job.events.get(timeout=30) for _ in range(3)]
        assert events[0].message.first_token.token_id >= 0
        assert worker.threads == 1
    finally:
        worker.stop()
    assert not worker._thread.is_alive()


def test_a_worker_stopped_before_it_started_ends_its_model_thread(tiny_model_dir):
    engine = EngineConfig(model_dir=str(tiny_model_dir), dtype="float32", num_blocks=32, num_threads=1)
    worker = ColocatedWorker(WorkerConfig(role="colocated", worker_id="c-ms", engine=engine))
    thread = worker.model_thread.thread
    assert thread is not None and thread.is_alive()
    worker.stop()
    thread.join(5)
    assert not thread.is_alive()


def test_a_worker_whose_engine_fails_to_build_ends_its_model_thread(tmp_path, monkeypatch):
    made: list[ModelThread] = []

    class Recorded(ModelThread):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr("splitserve.worker_common.base.ModelThread", Recorded)
    engine = EngineConfig(model_dir=str(tmp_path / "no-such-model"), dtype="float32", num_blocks=32, num_threads=1)
    with pytest.raises(Exception, match="no-such-model"):
        ColocatedWorker(WorkerConfig(role="colocated", worker_id="c-bad", engine=engine))
    assert len(made) == 1 and made[0].thread is not None  # the build ran on the model thread
    made[0].thread.join(5)
    assert not made[0].thread.is_alive()
