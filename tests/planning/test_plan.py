"""``splitserve plan`` on a toy device whose best answer is known: prefill is expensive (10 ms + 1 ms a
prompt token: a 100-token prompt takes 110 ms) and decode cheap (2 ms + 0.1 ms a sequence), with a tight
TPOT SLO. Disaggregated, one decode worker keeps up with three prefill workers, so on 4 devices the best
is 3 prefill + 1 decode; a colocated worker's decodes wait behind its 110 ms prefills and miss the TPOT
SLO at any useful rate."""

from __future__ import annotations

import pytest

from splitserve.deploy.config import DeploymentConfig
from splitserve.deploy.profile import ModelShape, Profile, TransferCost
from splitserve.planning import plan

MS = 1e-3
SLO = plan.Slo(ttft_ms=1000.0, tpot_ms=20.0, attainment=0.9)


def toy(tp: int = 1) -> Profile:
    model = ModelShape("toy", "LlamaForCausalLM", 2, 64, 4, 2, 16, 128, 1000, 4096)
    c = {
        "const": 2 * MS,
        "prefill_tokens": 1.08 * MS,
        "prefill_attention": 0.0,
        "decodes": 0.1 * MS,
        "decode_context": 0.0,
    }
    return Profile(model, "float32", 4, "cpu", "toy", 1, tp, c, TransferCost(1 * MS, 1e12))


WORKLOAD = [([100 + 7 * i + j for j in range(100)], 10) for i in range(40)]
BASE = DeploymentConfig.from_dict({"engine": {"num_blocks": 4096}})


def test_best_split_gives_each_phase_what_it_needs():
    assert plan._best_split(9.0, 100.0, 1, 1, 4) == (3, 1, 27.0)
    assert plan._best_split(9.0, 10.0, 1, 1, 4) == (2, 2, 18.0)
    assert plan._best_split(9.0, 100.0, 2, 1, 4) is not None and plan._best_split(9.0, 100.0, 4, 1, 4) is None
    assert plan._best_split(0.0, 100.0, 1, 1, 4) is None


def test_max_rate_finds_the_threshold():
    assert plan.max_rate(lambda r: r <= 3.7, iterations=30) == pytest.approx(3.7, rel=1e-3)
    assert plan.max_rate(lambda r: False) == 0.0


def test_search_finds_three_prefill_one_decode_on_four_devices():
    ranked = plan.search(BASE, {1: toy()}, WORKLOAD, SLO, plan.Budget(devices=4))
    best = ranked[0]
    assert (best.mode, best.counts, best.tp) == (
        "disaggregated",
        {"prefill": 3, "decode": 1},
        {"prefill": 1, "decode": 1},
    )
    # one prefill worker computes ~9 prompts a second; over 40 requests a backlog of under a second still
    # meets the 1 s TTFT SLO, so three of them are found to sustain a little more than 3 x 9
    assert 20 < best.rate < 45
    assert best.checked_attainment is not None and best.checked_attainment >= 0.8
    colocated = [c for c in ranked if c.mode == "colocated"]
    assert not colocated or colocated[0].goodput_per_device < best.goodput_per_device / 2


def test_the_inverse_fewest_devices_for_a_rate():
    best = plan.fewest_devices(BASE, {1: toy()}, WORKLOAD, SLO, rate=12.0, devices_per_node=8)
    assert best is not None and best.mode == "disaggregated"
    assert best.counts == {"prefill": 2, "decode": 1} and best.devices == 3


def test_the_winner_is_a_deployment_file_serve_accepts(tmp_path):
    candidate = plan.Candidate("disaggregated", {"prefill": 3, "decode": 1}, {"prefill": 2, "decode": 1}, 20.0)
    text = plan.to_yaml(plan.deployment_config(BASE, candidate), {"model": "/models/m", "prefill": {"threads": 2}})
    (tmp_path / "plan.yaml").write_text(text)
    config = DeploymentConfig.from_file(tmp_path / "plan.yaml")
    assert (config.prefill.replicas, config.prefill.tensor_parallel_size, config.prefill.threads) == (3, 2, 2)
    assert (config.decode.replicas, config.decode.tensor_parallel_size, config.model) == (1, 1, "/models/m")


def test_conditional_disaggregation_is_considered_and_written():
    """Every 100-token prompt is short under a 200-token threshold: the decode worker prefills them all, so
    the conditional variant of the best split is searched whole and ranks below the pure split here."""
    ranked = plan.search(BASE, {1: toy()}, WORKLOAD, SLO, plan.Budget(devices=4), local_prefill=(200,))
    conditional = [c for c in ranked if c.local_prefill_max_tokens == 200]
    assert len(conditional) == 1 and "local prefill <= 200" in conditional[0].describe()
    assert conditional[0].goodput_per_device < ranked[0].goodput_per_device
    config = plan.deployment_config(BASE, conditional[0])
    assert config.router.local_prefill_max_tokens == 200
    assert "local_prefill_max_tokens: 200" in plan.to_yaml(config)


def test_local_prefill_threshold_from_the_profile():
    from splitserve.planning.plan import local_prefill_threshold

    profile = toy()  # a prompt of n tokens: 2 ms + 1.08 ms per token
    assert local_prefill_threshold(profile, tpot_ms=100) == 44  # 2 + 44 * 1.08 = 49.5 ms <= half of 100
    assert local_prefill_threshold(profile, tpot_ms=300) == 137  # 2 + 137 * 1.08 = 150 ms
    assert local_prefill_threshold(profile, tpot_ms=3) == 0  # one token's step already takes over half
