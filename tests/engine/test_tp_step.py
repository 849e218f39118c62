"""Rank 0 drives a tensor-parallel engine (engine/tp/step.py), on CPU with gloo and real processes
(tests/engine/tp_ranks.py): rank 0's ``LLM.generate`` sends each step's plan, rank 1 ``follow``s it.

Covered: greedy output equal to TP 1 token for token (the tiny preset, with and without chunked prefill,
and Qwen2's two KV heads split), the followers owning no block manager, the plan's msgpack round trip and
strict decoding, a follower that exits failing rank 0's generate and a rank 0 that exits or stalls failing
the follower's loop, each within the group's timeout; and TP 1 sending nothing.
"""

from __future__ import annotations

import random
from dataclasses import fields

import msgpack
import numpy as np
import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.core import EngineConfig, EngineCore
from splitserve.engine.tp.step import PLAN_VERSION, Foreign, Notice, PlanError, StepPlan, Stop, Tick, decode, encode
from tests.engine import tp_ranks
from tests.engine.parity import make_prompts, torch_threads
from tests.engine.test_model_runner_prep import make_item, make_runner
from tests.engine.test_tensor_parallel import FakeGroup

GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
CHUNKED = {"prefill_chunk_size": 7, "max_num_batched_tokens": 23}
PLAN = {"tensor_parallel_step": "plan"}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(2, [3, 17, 40])


def tp1_tokens(model_dir, prompts: list[list[int]], **options) -> list[list[int]]:
    llm = LLM(model_dir, dtype="float32", block_size=16, num_blocks=256, **options)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(**GREEDY))]


def make_plan() -> StepPlan:
    """A plan from the runner of a batch of two decodes, a fresh prompt and a later chunk."""
    rng = random.Random(1)
    runner = make_runner()
    items = [
        make_item(runner, rng, "d0", 6, 5, 1, 1),
        make_item(runner, rng, "d1", 10, 9, 1, 0),
        make_item(runner, rng, "p0", 7, 0, 7, 0),
        make_item(runner, rng, "p1", 20, 8, 6, 1),
    ]
    plan, sampled = runner.plan(items)
    assert [s.request.request_id for s in sampled] == ["d0", "d1", "p0"]  # p1's chunk ends mid-prompt
    return plan


def test_greedy_output_equals_tp1(tiny_model_dir, arch_model_dirs, prompts):
    tiny, qwen2 = str(tiny_model_dir), str(arch_model_dirs["qwen2"])
    runs = [(tiny, prompts, GREEDY, {}), (tiny, prompts, GREEDY, CHUNKED), (qwen2, prompts, GREEDY, {})]
    ranks = tp_ranks.run_ranks(tp_ranks.lead_or_follow, 2, runs)
    assert sorted(ranks) == [0, 1]
    for i, (model_dir, _, _, options) in enumerate(runs):
        assert ranks[0][i]["tokens"] == tp1_tokens(model_dir, prompts, **options), f"run {i}"
        assert ranks[0][i]["in_use"] == 0
        assert ranks[1][i]["blocks"] is None  # the follower owns no block manager
    # One step per token (the prompts prefill together in the first), more with the prompts in chunks.
    assert ranks[1][0]["steps"] == ranks[1][2]["steps"] == GREEDY["max_tokens"] < ranks[1][1]["steps"]


def same_plan(a: StepPlan, b: StepPlan) -> bool:
    """Equal field for field (arrays by dtype, shape and values)."""
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            if not (isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y)):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def test_plan_round_trips_through_msgpack():
    plan = make_plan()
    assert plan.num_decodes == 2 and plan.prefill_chunks.tolist() == [[2, 9, 0], [9, 15, 8]]
    assert same_plan(decode(encode(plan)), plan)
    assert isinstance(decode(encode(Stop())), Stop)


def test_a_changed_field_is_not_the_same_plan():
    plan = make_plan()
    other = decode(encode(plan))
    other.slot_offsets[0] += 1
    assert not same_plan(other, plan)


def tamper(edit) -> bytes:
    message = msgpack.unpackb(encode(make_plan()), raw=False)
    edit(message)
    return msgpack.packb(message, use_bin_type=True)


def as_float32(message: dict) -> None:
    array = np.zeros(len(np.frombuffer(message["plan"]["input_ids"]["data"], np.int64)), np.float32)
    message["plan"]["input_ids"] = {"dtype": array.dtype.str, "shape": list(array.shape), "data": array.tobytes()}


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda m: m.update(version=PLAN_VERSION + 1), "version"),
        (lambda m: m.pop("version"), "version"),
        (lambda m: m.update(kind="go"), "kind"),
        (lambda m: m.update(extra=1), "extra"),
        (lambda m: m["plan"].pop("slot_blocks"), "slot_blocks"),
        (lambda m: m["plan"].update(max_position=1.5), "max_position"),
        (lambda m: m["plan"].update(max_position=True), "max_position"),
        (as_float32, "input_ids"),
        (lambda m: m["plan"]["positions"].update(shape=[3]), "positions"),  # data for another shape
        (lambda m: m["plan"]["decode_tables"].update(shape=[-1, 2]), "decode_tables"),
        (lambda m: m["plan"]["sample_rows"].pop("dtype"), "dtype"),
    ],
)
def test_malformed_plan_is_refused_by_name(edit, field):
    with pytest.raises(PlanError, match=f"^{field}: "):
        decode(tamper(edit))


def test_tick_stop_and_notice_round_trip_and_are_checked():
    assert decode(encode(Tick())) == Tick() and decode(encode(Stop())) == Stop()
    assert decode(encode(Notice(b"\x00for the worker"))) == Notice(b"\x00for the worker")
    assert decode(encode(Foreign(b"\x80a vllm step"))) == Foreign(b"\x80a vllm step")
    assert decode(encode(Foreign(b"x"))) != Notice(b"x")
    foreign = msgpack.packb({"version": PLAN_VERSION, "kind": "foreign", "payload": 3}, use_bin_type=True)
    with pytest.raises(PlanError, match="^payload: expected bytes"):
        decode(foreign)
    notice = msgpack.packb({"version": PLAN_VERSION, "kind": "notice", "payload": "text"}, use_bin_type=True)
    with pytest.raises(PlanError, match="^payload: expected bytes"):
        decode(notice)
    tick = msgpack.packb({"version": PLAN_VERSION, "kind": "tick", "plan": {}}, use_bin_type=True)
    with pytest.raises(PlanError, match="^plan: not a field"):
        decode(tick)


def test_inconsistent_plan_is_refused_by_name():
    plan = make_plan()
    short = StepPlan(**{**vars(plan), "slot_blocks": plan.slot_blocks[:-1]})
    with pytest.raises(PlanError, match="^slot_blocks: "):
        decode(encode(short))
    with pytest.raises(PlanError, match="^payload: "):
        decode(b"\xc1 not msgpack")


def test_follower_that_exits_fails_rank0s_generate_within_the_timeout(tiny_model_dir, prompts):
    ranks = tp_ranks.run_ranks(tp_ranks.follower_exits, 2, str(tiny_model_dir), prompts, group_timeout_s=2.0)
    assert sorted(ranks) == [0]
    assert ranks[0]["error"] is not None and "on tensor-parallel rank 0 of 2" in ranks[0]["error"]
    assert ranks[0]["elapsed"] < 2.0 + 1


@pytest.mark.parametrize("stall", [False, True])
def test_rank0_that_exits_or_stalls_fails_the_followers_loop_within_the_timeout(tiny_model_dir, prompts, stall):
    ranks = tp_ranks.run_ranks(tp_ranks.leader_exits, 2, str(tiny_model_dir), prompts, stall, group_timeout_s=2.0)
    assert sorted(ranks) == [1]
    result = ranks[1]
    assert result["error"] is not None and "broadcast on tensor-parallel rank 1 of 2" in result["error"]
    assert result["steps"] == 4  # it followed generate's steps first
    assert result["waited"] < 2.0 + 1.5
    if stall:
        assert result["waited"] > 1.5  # a silent rank 0 is given the whole timeout


def test_tp1_has_no_channel(tiny_model_dir, prompts):
    llm = LLM(tiny_model_dir, dtype="float32", block_size=16, num_blocks=256, **PLAN)
    assert llm.core.tp_group is None and llm.runner.channel is None
    with llm:
        tokens = [o.token_ids for o in llm.generate(prompts, SamplingParams(**GREEDY))]
    assert tokens == tp1_tokens(tiny_model_dir, prompts)


def test_follower_has_no_block_manager_or_scheduler(tiny_model_dir):
    options = {"tensor_parallel_size": 2, "tensor_parallel_rank": 1, "num_blocks": 16, **PLAN}
    core = EngineCore(EngineConfig(model_dir=str(tiny_model_dir), **options), tp_group=FakeGroup(1, 2))
    assert core.blocks is None and core.runner.channel is None and core.decode_path == "dynamic"
    with pytest.raises(ValueError, match="^tensor_parallel_rank: rank 1 follows"):
        core.make_scheduler()
    with pytest.raises(ValueError, match="^tensor_parallel_step: "):
        EngineConfig(model_dir=str(tiny_model_dir), tensor_parallel_step="ring")
