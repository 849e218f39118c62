"""Scheduler lifecycle, driven step by step without a model (the runner is faked by a rule)."""

from __future__ import annotations

import pytest

from splitserve.engine.kv_cache.block_manager import BlockManager
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.scheduler.request import FinishReason, Request, RequestStatus
from splitserve.engine.scheduler.scheduler import Scheduler, SchedulerConfig


def make_scheduler(num_blocks=32, block_size=4, eos=(), **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size), eos)


def make_request(rid: str, prompt_len: int, first: int = 1, **sampling) -> Request:
    sampling.setdefault("temperature", 0.0)
    return Request(rid, [first + i for i in range(prompt_len)], SamplingParams(**sampling))


def fake_step(s: Scheduler, next_token=lambda r: (r.token_ids[-1] + 1) % 1000):
    out = s.schedule()
    sampled = {i.request.request_id: next_token(i.request) for i in out.scheduled if i.samples}
    s.update(out, sampled)
    return out


def run_to_end(s: Scheduler, max_steps: int = 1000, **kw) -> list:
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished:
            return outs
        outs.append(fake_step(s, **kw))
    raise AssertionError("scheduler did not finish")


def assert_no_leak(s: Scheduler) -> None:
    s.blocks.check_integrity()
    assert s.blocks.num_used_blocks == 0
    assert not s.running and not s.waiting and not s.requests


def test_chunked_prefill_then_decode():
    s = make_scheduler(max_num_batched_tokens=8, prefill_chunk_size=5)
    r = make_request("a", 12, max_tokens=3)
    s.add(r)
    sizes = [o.scheduled[0].num_new_tokens for o in run_to_end(s)]
    assert sizes == [5, 5, 2, 1, 1]
    assert r.output_token_ids == [13, 14, 15]
    assert r.finish_reason is FinishReason.LENGTH
    assert_no_leak(s)


def test_budget_shared_between_decodes_and_new_prefills():
    s = make_scheduler(max_num_batched_tokens=6)
    s.add(make_request("a", 3, max_tokens=5))
    first = fake_step(s)
    assert [(i.request.request_id, i.num_new_tokens) for i in first.scheduled] == [("a", 3)]
    s.add(make_request("b", 10, first=100, max_tokens=2))
    second = fake_step(s)
    # a decodes one token, b's prompt gets the remaining 5 tokens of the budget.
    assert [(i.request.request_id, i.num_new_tokens) for i in second.scheduled] == [("a", 1), ("b", 5)]
    run_to_end(s)
    assert_no_leak(s)


def test_max_num_seqs_limits_running():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add(make_request(f"r{i}", 2, max_tokens=4))
    out = fake_step(s)
    assert len(out.scheduled) == 2 and len(s.waiting) == 2
    run_to_end(s)
    assert_no_leak(s)


def test_preemption_recomputes_and_finishes_everyone():
    # 6 blocks of 4 tokens: two requests of 8 + 12 output tokens cannot both fit.
    s = make_scheduler(num_blocks=6, block_size=4)
    a, b = make_request("a", 8, max_tokens=12), make_request("b", 8, first=50, max_tokens=12)
    s.add(a)
    s.add(b)
    outs = run_to_end(s)
    assert any(o.preempted for o in outs)
    assert b.num_preemptions >= 1
    # Recompute gives the same tokens as an uninterrupted run.
    assert a.output_token_ids == list(range(9, 21))
    assert b.output_token_ids == list(range(58, 70))
    assert_no_leak(s)


def test_prefix_cache_hit_skips_computed_blocks():
    s = make_scheduler(block_size=4)
    s.add(make_request("a", 10, max_tokens=1))
    run_to_end(s)
    b = make_request("b", 10, max_tokens=1)
    s.add(b)
    out = fake_step(s)
    assert b.num_cached_tokens == 8
    assert out.scheduled[0].num_new_tokens == 2
    assert_no_leak(s)
    assert s.blocks.num_cached_blocks == 2


@pytest.mark.parametrize(
    ("sampling", "reason", "stop_reason", "num_out"),
    [
        ({"max_tokens": 10}, FinishReason.STOP, None, 3),  # EOS (token 13) after 3 tokens
        ({"max_tokens": 10, "ignore_eos": True}, FinishReason.LENGTH, None, 10),
        ({"max_tokens": 10, "stop_token_ids": (12,)}, FinishReason.STOP, 12, 2),
        ({"max_tokens": 10, "min_tokens": 5, "ignore_eos": False}, FinishReason.LENGTH, None, 10),
    ],
)
def test_stop_conditions(sampling, reason, stop_reason, num_out):
    s = make_scheduler(eos=(13,))
    r = make_request("a", 10, **sampling)  # prompt 1..10, outputs 11, 12, 13, ...
    s.add(r)
    # With min_tokens the sampler suppresses EOS; emulate that by skipping 13.
    suppress = sampling.get("min_tokens", 0)
    run_to_end(s, next_token=lambda q: q.token_ids[-1] + (2 if suppress and q.token_ids[-1] == 12 else 1))
    assert (r.finish_reason, r.stop_reason, r.num_output_tokens) == (reason, stop_reason, num_out)
    assert_no_leak(s)


def test_max_model_len_stops_output():
    s = make_scheduler(max_model_len=12)
    r = make_request("a", 10, max_tokens=100)
    s.add(r)
    run_to_end(s)
    assert r.num_tokens == 12 and r.finish_reason is FinishReason.LENGTH
    assert_no_leak(s)


def test_finish_in_every_state_frees_blocks():
    s = make_scheduler(max_num_batched_tokens=4, max_num_seqs=1)
    a, b = make_request("a", 10, max_tokens=50), make_request("b", 3, max_tokens=5)
    s.add(a)
    s.add(b)
    fake_step(s)  # a mid-prefill, b waiting
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    s.finish("b", FinishReason.ABORT)
    s.finish("a", FinishReason.ABORT)
    s.finish("a", FinishReason.ABORT)  # idempotent
    assert a.finish_reason is FinishReason.ABORT
    assert_no_leak(s)


def test_add_refuses_bad_requests():
    s = make_scheduler(num_blocks=2, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match="do not fit"):
        s.add(make_request("a", 9))
    s2 = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        s2.add(make_request("a", 8))
    s3 = make_scheduler()
    s3.add(make_request("a", 2))
    with pytest.raises(ValueError, match="request_id"):
        s3.add(make_request("a", 2))


def test_hand_off_after_first_token_keeps_blocks_for_the_owner():
    """Prefill role: a request leaves after its first token, its blocks still allocated (the KV is
    being transferred); whether it is complete shows in finish_reason."""
    s = make_scheduler(hand_off_after_first_token=True, eos=(13,))
    going_on, done_at_first = make_request("a", 10, max_tokens=5), make_request("b", 12, max_tokens=5)
    s.add(going_on)
    s.add(done_at_first)  # its first token is 13 = EOS
    fake_step(s)
    assert not s.running and not s.requests
    assert going_on.output_token_ids == [11] and going_on.finish_reason is None
    assert done_at_first.finish_reason is FinishReason.STOP
    assert s.blocks.has_request("a") and s.blocks.has_request("b")
    s.blocks.free("a")
    s.blocks.free("b")
    assert_no_leak(s)


def test_add_running_decodes_a_request_whose_kv_arrived():
    """Decode role: blocks leased, KV present for all but the last token; the next step decodes it."""
    s = make_scheduler()
    r = Request.resume("a", [1, 2, 3, 4, 5], [6], SamplingParams(max_tokens=3, temperature=0.0), seed=1)
    assert s.blocks.allocate("a", r.num_tokens)
    s.add_running(r)
    out = fake_step(s)
    assert [(i.request.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 1)]
    run_to_end(s)
    assert r.output_token_ids == [6, 7, 8] and r.finish_reason is FinishReason.LENGTH
    assert_no_leak(s)
    with pytest.raises(ValueError, match="holds no blocks"):
        s.add_running(Request("b", [1], SamplingParams()))


def test_hand_back_preemption_returns_requests_instead_of_recomputing():
    s = make_scheduler(num_blocks=6, block_size=4, preemption="hand_back")
    requests = []
    for rid, first in (("a", 1), ("b", 50)):
        r = Request.resume(
            rid, [first + i for i in range(6)], [first + 6], SamplingParams(max_tokens=12, temperature=0.0), 1
        )
        assert s.blocks.allocate(rid, r.num_tokens)
        s.add_running(r)
        requests.append(r)
    outs = run_to_end(s)
    preempted = [r for o in outs for r in o.preempted]
    assert [r.request_id for r in preempted] == ["b"]
    assert preempted[0].finish_reason is FinishReason.PREEMPTED
    assert len(preempted[0].output_token_ids) >= 1  # what it generated goes back to the router
    assert requests[0].num_output_tokens == 12 and requests[0].finish_reason is FinishReason.LENGTH
    assert_no_leak(s)
