"""The simulator against timelines computed by hand, on a toy profile whose costs are round numbers:

    step = 10 ms + 1 ms per prompt token + 2 ms per decoding sequence;  KV transfer = 5 ms

One request through prefill, transfer and decode; two requests contending for one prefill worker's token
budget (the real scheduler chunks the second); a request migrating off a lost decode worker; the same
request on a colocated worker. Each asserts the exact times."""

from __future__ import annotations

import pytest

from splitserve.bench.metrics import RequestRecord, summarize
from splitserve.deploy.profile import ModelShape, Profile, TransferCost
from splitserve.planning.simulator import RoleSpec, SimConfig, simulate

MS = 1e-3


def toy_profile(**coefficients) -> Profile:
    model = ModelShape("toy", "LlamaForCausalLM", 2, 64, 4, 2, 16, 128, 1000, 4096)
    c = {"const": 10 * MS, "prefill_tokens": 1 * MS, "prefill_attention": 0.0, "decodes": 2 * MS, "decode_context": 0.0}
    return Profile(model, "float32", 4, "cpu", "toy", 1, 1, {**c, **coefficients}, TransferCost(5 * MS, 1e18))


def disaggregated(prefill: int = 1, decode: int = 1, **config) -> SimConfig:
    profile = toy_profile()
    return SimConfig(
        mode="disaggregated",
        prefill=RoleSpec(prefill, profile, num_blocks=64, max_inflight=4),
        decode=RoleSpec(decode, profile, num_blocks=64, max_inflight=8),
        **config,
    )


def prompt(n: int, salt: int = 0) -> list[int]:
    return [100 + salt * 50 + i for i in range(n)]


def test_one_request_prefill_transfer_decode():
    result, sim = simulate(disaggregated(), [(prompt(10), 4)], [0.0])
    (job,) = sim.done
    # prefill: 10 + 10 = 20 ms -> first token; transfer 5 ms -> lands at 25; decode steps of 10 + 2 = 12 ms
    assert job.first_token_s == pytest.approx(20 * MS)
    assert job.itls_s == pytest.approx([17 * MS, 12 * MS, 12 * MS])
    assert job.finished_s == pytest.approx(61 * MS)
    assert result["mean_ttft_ms"] == pytest.approx(20)
    assert result["mean_tpot_ms"] == pytest.approx(41 / 3)
    assert result["mean_e2el_ms"] == pytest.approx(61) and result["completed"] == 1
    assert all(w.blocks.num_used_blocks == 0 for w in sim.workers.values()), "no block held at the end"
    assert result["mean_server_transfer_ms"] == pytest.approx(5) and result["mean_server_prefill_ms"] == pytest.approx(
        20
    )


def test_two_requests_contend_for_the_token_budget():
    """Budget 16: the first step takes request 0's 10 tokens and 6 of request 1's 20 (the real scheduler's
    chunking); the second step its other 14. Their decodes then share steps."""
    result, sim = simulate(disaggregated(max_num_batched_tokens=16), [(prompt(10), 2), (prompt(20, 1), 2)], [0.0, 0.0])
    first = {job.index: job for job in sim.done}
    assert first[0].first_token_s == pytest.approx(26 * MS)  # 10 + 16
    assert first[1].first_token_s == pytest.approx(50 * MS)  # 26 + 10 + 14
    # request 0 lands at 31 and decodes alone (12 ms): its last token at 43
    assert first[0].finished_s == pytest.approx(43 * MS)
    # request 1 lands at 55: a decode step of 12 ms -> 67
    assert first[1].finished_s == pytest.approx(67 * MS)
    assert result["completed"] == 2 and result["total_output_tokens"] == 4


def test_a_lost_decode_worker_migrates_the_request():
    """Two decode workers; decode-0 (picked first: both empty, most free blocks, the first) is lost at 40 ms,
    after the tokens at 20 (prefill) and 37. The router re-prefills prompt + 2 tokens (12 tokens: 22 ms) and
    leases decode-1; the stream continues without repeating or losing a token."""
    result, sim = simulate(disaggregated(decode=2, losses=((40 * MS, "decode-0"),)), [(prompt(10), 4)], [0.0])
    (job,) = sim.done
    assert job.legs == 2 and len(job.output) == 4 and not job.error
    # the second leg: prefill 40 -> 62 (its sampled token is the 3rd), transfer -> 67, one decode -> 79
    assert job.itls_s == pytest.approx([17 * MS, 25 * MS, 17 * MS])
    assert job.finished_s == pytest.approx(79 * MS)
    assert result["completed"] == 1
    assert sim.workers["decode-1"].blocks.num_used_blocks == 0


def test_colocated_one_request():
    profile = toy_profile()
    config = SimConfig(mode="colocated", colocated=RoleSpec(1, profile, num_blocks=64, max_inflight=4))
    _, sim = simulate(config, [(prompt(10), 3)], [0.0])
    (job,) = sim.done
    assert job.first_token_s == pytest.approx(20 * MS)
    assert job.itls_s == pytest.approx([12 * MS, 12 * MS])


def test_queue_bound_and_no_room_fail_with_the_routers_codes():
    config = disaggregated(max_queue=1)
    requests = [(prompt(10, i), 2) for i in range(8)]
    result, _ = simulate(config, requests, [0.0] * 8)
    assert result["failures"].get("RESOURCE_EXHAUSTED", 0) > 0
    assert result["completed"] + result["failed"] == 8


def test_results_have_the_benchs_keys():
    result, _ = simulate(disaggregated(), [(prompt(10), 4)], [0.0], goodput={"ttft": 50.0})
    expected = summarize([RequestRecord(10, 4)], 1.0, (90, 95, 99), {"ttft": 50.0})
    assert set(expected) <= set(result)
    assert result["good_requests"] == 1


def test_a_mode_without_its_workers_is_refused_by_name():
    with pytest.raises(ValueError, match="^decode: "):
        SimConfig(mode="disaggregated", prefill=RoleSpec(1, toy_profile(), 64, 4))


def test_conditional_disaggregation_prefills_a_short_prompt_on_the_decode_worker():
    """local_prefill_max_tokens 50: the 10-token prompt is prefilled on the decode worker (20 ms, no
    transfer) and decodes there (12 ms steps); the 80-token one goes to the prefill worker as before."""
    result, sim = simulate(
        disaggregated(local_prefill_max_tokens=50), [(prompt(10), 4), (prompt(80, 1), 2)], [0.0, 1.0]
    )
    jobs = {job.index: job for job in sim.done}
    short, long = jobs[0], jobs[1]
    assert short.local and short.first_token_s == pytest.approx(20 * MS)
    assert short.finished_s == pytest.approx(56 * MS), "20 + 3 x 12: no transfer"
    assert not long.local and long.first_token_s == pytest.approx(1.0 + 90 * MS)
    assert sim.workers["prefill-0"].steps == 1, "the prefill worker computed only the long prompt"
    assert result["completed"] == 2


def test_a_short_prompt_does_not_wait_behind_long_ones_for_prefill_credit():
    """As the router decides, at arrival: prefill-0 holds one request at a time; 80-token prompts at 0 and
    1 ms take it and wait for it; a 10-token prompt at 2 ms (under local_prefill_max_tokens 50) goes
    straight to the decode worker (first token at 2 + 20 ms), not to the back of the prefill queue."""
    profile = toy_profile()
    config = SimConfig(
        mode="disaggregated",
        prefill=RoleSpec(1, profile, num_blocks=64, max_inflight=1),
        decode=RoleSpec(1, profile, num_blocks=64, max_inflight=8),
        local_prefill_max_tokens=50,
    )
    _, sim = simulate(config, [(prompt(80), 2), (prompt(80, 1), 2), (prompt(10, 2), 4)], [0.0, 1 * MS, 2 * MS])
    jobs = {job.index: job for job in sim.done}
    assert not jobs[0].local and not jobs[1].local and jobs[2].local
    assert jobs[2].first_token_s == pytest.approx(22 * MS)
    assert jobs[1].first_token_s > 0.15, "the second long prompt waited for the first's prefill"
