"""Samples of one prompt (``n`` > 1): a fork shares its parent's full prompt blocks and computes the rest
of the prompt itself, so each sample equals a single request with its seed, on one prefill."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.kv_cache.block_manager import BlockManager
from splitserve.engine.sampling.rng import sample_seed
from splitserve.engine.scheduler.request import Request
from tests.engine.test_scheduler import assert_no_leak, fake_step, make_scheduler, run_to_end


def test_block_manager_fork_shares_blocks_by_reference():
    blocks = BlockManager(8, 4)
    assert blocks.allocate("a", 10)  # 3 blocks
    blocks.fork("a", "b", 2)
    assert blocks.block_table("b") == blocks.block_table("a")[:2]
    assert blocks.num_used_blocks == 3
    blocks.check_integrity()
    with pytest.raises(ValueError, match="already has blocks"):
        blocks.fork("a", "b", 1)
    with pytest.raises(ValueError, match="num_blocks"):
        blocks.fork("a", "c", 4)
    blocks.free("a")
    assert blocks.num_used_blocks == 2  # b still holds the shared two
    blocks.free("b")
    blocks.check_integrity()
    assert blocks.num_used_blocks == 0


@pytest.mark.parametrize("prompt_len", [3, 8, 10])
def test_scheduler_fork_computes_only_the_prompt_tail(prompt_len):
    """Decode role: the parent's KV landed; a fork shares its full blocks short of the last prompt token."""
    s = make_scheduler(block_size=4, preemption="hand_back")
    prompt = list(range(1, prompt_len + 1))
    parent = Request.resume("a", prompt, [100], SamplingParams(max_tokens=4, temperature=0.0), seed=1)
    assert s.blocks.allocate("a", parent.num_tokens)
    s.add_running(parent)
    child = Request("a#1", prompt, SamplingParams(max_tokens=4, temperature=0.0), seed=2)
    s.fork("a", child)
    shared = (prompt_len - 1) // 4
    assert s.blocks.block_table("a#1") == s.blocks.block_table("a")[:shared]
    assert child.num_computed_tokens == child.num_cached_tokens == shared * 4
    out = fake_step(s)
    assert {(i.request.request_id, i.num_new_tokens) for i in out.scheduled} == {
        ("a", 1),
        ("a#1", prompt_len - shared * 4),
    }
    run_to_end(s)
    assert child.num_output_tokens == 4 and parent.num_output_tokens == 4
    assert_no_leak(s)


def test_scheduler_fork_refuses_another_prompt():
    s = make_scheduler()
    parent = Request.resume("a", [1, 2, 3], [4], SamplingParams(temperature=0.0), seed=1)
    assert s.blocks.allocate("a", parent.num_tokens)
    s.add_running(parent)
    with pytest.raises(ValueError, match="parent's prompt"):
        s.fork("a", Request("b", [1, 2], SamplingParams()))


def test_sample_seed_is_seed_plus_index_mod_2_64():
    assert [sample_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert sample_seed(2**64 - 1, 1) == 0


@pytest.fixture(scope="module")
def llm(tiny_model_dir, device) -> LLM:
    return LLM(tiny_model_dir, dtype="float32", device=device, num_blocks=128, block_size=4)


def _step(llm: LLM) -> None:
    output = llm.scheduler.schedule()
    llm.scheduler.update(output, llm.runner.execute(output))


def _fork_run(llm: LLM, prompt: list[int], sampling: SamplingParams, n: int) -> list[list[int]]:
    """Prefill the prompt once, fork n - 1 samples after the parent's first token, decode all to the end."""
    parent = Request("p", prompt, sampling, seed=sampling.seed if sampling.seed is not None else 0)
    parent_id = parent.request_id
    llm.scheduler.add(parent)
    while parent.num_output_tokens == 0:
        _step(llm)
    children = []
    for i in range(1, n):
        seed = sample_seed(parent.seed, i)
        child = Request(f"p#{i}", prompt, dataclasses.replace(sampling, seed=seed), seed=seed)
        llm.scheduler.fork(parent_id, child)
        children.append(child)
    shared = llm.blocks.block_table(parent_id)[: (len(prompt) - 1) // 4]
    assert shared and all(llm.blocks.block_table(c.request_id)[: len(shared)] == shared for c in children)
    while llm.has_unfinished_requests():
        _step(llm)
    llm.check_integrity()
    assert llm.kv_status()["in_use"] == 0
    return [parent.output_token_ids] + [c.output_token_ids for c in children]


def test_forked_samples_equal_single_requests(llm):
    prompt = list(range(5, 19))  # 14 tokens: 3 full blocks shared, 2 tokens recomputed per fork
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = _fork_run(llm, prompt, greedy, 3)
    assert outs[0] == outs[1] == outs[2]
    assert outs[0] == llm.generate([prompt], greedy)[0].token_ids
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    outs = _fork_run(llm, prompt, sampled, 3)
    singles = [
        llm.generate([prompt], dataclasses.replace(sampled, seed=sample_seed(11, i)))[0].token_ids for i in range(3)
    ]
    assert outs == singles
    assert len({tuple(o) for o in outs}) == 3  # the seeds differ, and so do the samples
