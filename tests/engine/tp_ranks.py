"""Real tensor-parallel ranks for tests: ``run_ranks`` spawns ``size`` processes on 127.0.0.1 that form a
gloo ``TPGroup`` through a store the test process hosts, runs one function of this module on each, and
returns what each rank returned. Kept apart from the test file so that a rank imports only the engine."""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from splitserve.engine.tp.distributed import CollectiveError, TPGroup, bind_store, connect_store, timeout_delta

HOST = "127.0.0.1"
GROUP_TIMEOUT_S = 5.0  # every collective (default)
# Spawned ranks finish importing torch seconds apart on busy cores: they meet at a barrier on the store,
# with this much slack, before forming the group, so that the collectives' deadline measures only them.
SETUP_TIMEOUT_S = 30.0


def run_ranks(
    fn: Callable[..., Any],
    size: int,
    *args: Any,
    timeout_s: float = 60.0,
    group_timeout_s: float = GROUP_TIMEOUT_S,
) -> dict[int, Any]:
    """``fn(group, *args)`` on every rank of a group whose collectives wait at most ``group_timeout_s``;
    returns rank -> result for the ranks that returned (a rank that exits without returning is absent).
    A rank that raised fails the test with its traceback."""
    store, port = bind_store(HOST, 0, SETUP_TIMEOUT_S)
    ctx = mp.get_context("spawn")
    results: queue.Queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, port, rank, size, group_timeout_s, args, results))
        for rank in range(size)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"ranks did not finish within {timeout_s}s") from None
                continue
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    return got


def _rank_main(fn, port: int, rank: int, size: int, group_timeout_s: float, args: tuple, results) -> None:
    torch.set_num_threads(1)
    try:
        store = connect_store(HOST, port, SETUP_TIMEOUT_S)
        store.set(f"ready/{rank}", "1")
        store.wait([f"ready/{r}" for r in range(size)], timeout_delta(SETUP_TIMEOUT_S))
        group = TPGroup.create("gloo", store, "tp/", rank, size, HOST, group_timeout_s, torch.device("cpu"))
        results.put((rank, True, fn(group, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def generate(group: TPGroup, runs: list[tuple[str, list[list[int]], dict, dict]]) -> list[dict]:
    """For each (model_dir, prompts, sampling kwargs, engine options): a tensor-parallel ``LLM`` on this
    rank, ``generate`` on the prompts; the tokens, checksum, local KV heads and blocks left in use."""
    from splitserve.engine import LLM, SamplingParams

    out = []
    for model_dir, prompts, sampling, options in runs:
        llm = LLM(
            model_dir,
            tp_group=group,
            tensor_parallel_size=group.size,
            tensor_parallel_rank=group.rank,
            dtype="float32",
            block_size=16,
            **{"num_blocks": 256, **options},
        )
        outputs = llm.generate(prompts, SamplingParams(**sampling))
        llm.check_integrity()
        out.append(
            {
                "tokens": [o.token_ids for o in outputs],
                "checksum": llm.weights_checksum,
                "kv_heads": llm.kv_cache.spec.num_kv_heads,
                "q_heads": llm.model.layers[0].self_attn.num_heads,
                "in_use": llm.kv_status()["in_use"],
            }
        )
    return out


def collectives_then_rank_exits(group: TPGroup) -> dict:
    """A sum and a broadcast, then the last rank exits without a word; the others time their next
    all-reduce, which must fail."""
    summed = group.all_reduce(torch.tensor([float(group.rank + 1)])).tolist()
    shared = group.broadcast(torch.tensor([float(group.rank * 10 + 7)]), src=0).tolist()
    if group.rank == group.size - 1:
        os._exit(0)
    start = time.monotonic()
    try:
        group.all_reduce(torch.ones(4))
    except CollectiveError as e:
        return {"sum": summed, "broadcast": shared, "error": str(e), "elapsed": time.monotonic() - start}
    return {"sum": summed, "broadcast": shared, "error": None, "elapsed": time.monotonic() - start}


def rank_stalls(group: TPGroup) -> dict:
    """The last rank stays alive but silent past the timeout; the others' all-reduce must fail by it."""
    if group.rank == group.size - 1:
        time.sleep(group.timeout_s + 1)
        os._exit(0)  # without reporting: the test reads the waiting ranks only
    start = time.monotonic()
    try:
        group.all_reduce(torch.ones(4))
    except CollectiveError as e:
        return {"error": str(e), "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def _plan_engine(group: TPGroup, model_dir: str, options: dict):
    """Rank 0: an ``LLM`` that drives; another rank: the ``EngineCore`` that follows it."""
    from splitserve.engine import LLM
    from splitserve.engine.core import EngineConfig, EngineCore

    options = {
        "tensor_parallel_size": group.size,
        "tensor_parallel_rank": group.rank,
        "tensor_parallel_step": "plan",
        "dtype": "float32",
        "block_size": 16,
        "num_blocks": 256,
        **options,
    }
    if group.rank == 0:
        return LLM(model_dir, tp_group=group, **options)
    return EngineCore(EngineConfig(model_dir=model_dir, **options), tp_group=group)


def lead_or_follow(group: TPGroup, runs: list[tuple[str, list[list[int]], dict, dict]]) -> list[dict]:
    """For each (model_dir, prompts, sampling kwargs, engine options): rank 0 runs ``generate`` and closes;
    the others ``follow`` until then. Rank 0 reports tokens and blocks in use, the others steps run."""
    from splitserve.engine import SamplingParams
    from splitserve.engine.tp.step import follow

    out = []
    for model_dir, prompts, sampling, options in runs:
        engine = _plan_engine(group, model_dir, options)
        if group.rank > 0:
            out.append({"steps": follow(engine, group), "blocks": engine.blocks})
            continue
        with engine as llm:
            outputs = llm.generate(prompts, SamplingParams(**sampling))
        llm.check_integrity()
        out.append({"tokens": [o.token_ids for o in outputs], "in_use": llm.kv_status()["in_use"]})
    return out


def follower_exits(group: TPGroup, model_dir: str, prompts: list[list[int]]) -> dict:
    """The follower exits once its engine is built; rank 0 times ``generate``, which must fail."""
    from splitserve.engine import SamplingParams

    engine = _plan_engine(group, model_dir, {})
    if group.rank > 0:
        os._exit(0)
    start = time.monotonic()
    try:
        engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    except CollectiveError as e:
        return {"error": str(e), "elapsed": time.monotonic() - start}
    finally:
        engine.close()  # after a failed collective: sends nothing
    return {"error": None, "elapsed": time.monotonic() - start}


def leader_exits(group: TPGroup, model_dir: str, prompts: list[list[int]], stall: bool) -> dict:
    """Rank 0 runs one ``generate`` and then exits (or, with ``stall``, stays silent past the timeout)
    without Stop; the follower's loop must fail. It reports when its last plan arrived and when it failed."""
    from splitserve.engine import SamplingParams
    from splitserve.engine.tp.step import follow

    engine = _plan_engine(group, model_dir, {})
    if group.rank == 0:
        engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        if stall:
            time.sleep(group.timeout_s + 1)
        os._exit(0)
    runner = _TimedRunner(engine.runner)
    try:
        follow(runner, group)
    except CollectiveError as e:
        return {"error": str(e), "steps": runner.steps, "waited": time.monotonic() - runner.last}
    return {"error": None, "steps": runner.steps, "waited": time.monotonic() - runner.last}


class _TimedRunner:
    """A follower's runner that counts the plans it ran and notes when the last one ended."""

    def __init__(self, runner) -> None:
        self.inner, self.device, self.steps, self.last = runner, runner.device, 0, time.monotonic()

    def run_plan(self, plan):
        hidden = self.inner.run_plan(plan)
        self.steps, self.last = self.steps + 1, time.monotonic()
        return hidden
