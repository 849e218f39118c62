"""The live planner driving a simulated deployment of the tiny model (splitserve/planning/sim_planner.py).

The planner is the live one, with the profile model it uses when it is served. The deployment is
simulated and timed by a profile of the tiny preset (data/tiny-profile.json, written by ``splitserve
profile --quick`` on a 2-core machine: fixed, so that the run is the same everywhere), and its scaling
path is the one
``splitserve scale`` takes: workers start late, and drained ones hand back. Rates are set from the
oracle's own capacity of one worker, so the test holds on any machine:

- a load that shifts from prompt-heavy to output-heavy first adds prefill workers, then moves them to
  decode; attainment recovers after each change;
- steady load changes nothing for 10 intervals;
- however high the load, the bounds hold.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from splitserve.deploy.live_planner import Planner, profile_oracles
from splitserve.deploy.planner_settings import PlannerSettings
from splitserve.deploy.profile import Profile

PROFILE = Path(__file__).parent / "data" / "tiny-profile.json"

SETTINGS = PlannerSettings(
    enabled=True,
    profile="measured in the test",
    interval_s=5,
    window_s=10,
    ttft_ms=1000,
    tpot_ms=10,
    headroom=1.5,
    smoothing=0.7,
    stable_intervals=2,
    scale_down_intervals=3,
    cooldown_s=15,
    min_prefill=1,
    max_prefill=3,
    min_decode=1,
    max_decode=3,
)
PROMPT_HEAVY = (2048, 2)  # prompt tokens, output tokens
OUTPUT_HEAVY = (16, 512)


@pytest.fixture(scope="module")
def tiny_profile():
    return Profile.load(PROFILE)


@pytest.fixture(scope="module")
def tiny_setup(tiny_profile, tiny_model_dir):
    from splitserve.deploy.config import DeploymentConfig

    base = DeploymentConfig.from_dict(
        {"model": str(tiny_model_dir), "dtype": "float32", "engine": {"num_blocks": 2048, "max_num_seqs": 32}}
    )
    capacity, predict = profile_oracles(SETTINGS, base, tiny_profile)
    return base, capacity, predict


def workload(phases, seed: int = 0):
    """(prompt ids, output length) and arrival offsets: each phase is (seconds, rate, (prompt, output))."""
    requests, offsets, start = [], [], 0.0
    for seconds, rate, (prompt, output) in phases:
        n = round(seconds * rate)
        for i in range(n):
            k = len(requests) + seed * 100_000
            requests.append(([(7 + 31 * k + 13 * j) % 1000 + 3 for j in range(prompt)], output))
            offsets.append(start + i / rate)
        start += seconds
    return requests, offsets


def run(tiny_setup, tiny_profile, phases, settings=SETTINGS, start=(1, 1)):
    from splitserve.planning import plan
    from splitserve.planning.deployment import sim_config
    from splitserve.planning.sim_planner import PlannedSimulation
    from splitserve.planning.sim_workers import SimRequest

    base, capacity, predict = tiny_setup
    deployment = plan.with_roles(base, "disaggregated", prefill=(start[0], 1), decode=(start[1], 1))
    config = sim_config(deployment, {"prefill": tiny_profile, "decode": tiny_profile})
    sim = PlannedSimulation(config, Planner(settings, capacity, predict), startup_s=8.0)
    requests, offsets = workload(phases)
    jobs = [SimRequest(i, p, n, o) for i, ((p, n), o) in enumerate(zip(requests, offsets, strict=True))]
    sim.run(jobs)
    lost = [
        (job.index, job.error, len(job.output), job.output_len)
        for job in jobs
        if job.error or len(job.output) != job.output_len
    ]
    changes = [(i.at, i.decision.describe()) for i in sim.intervals if i.decision.applied]
    assert not lost, f"{len(lost)} lost or failed requests, e.g. {lost[:5]}; changes {changes}"
    return sim


def rate_for(tiny_setup, role: str, shape: tuple[int, int], workers: float) -> float:
    """The arrival rate that ``workers`` workers of ``role`` serve within the SLOs, by the oracle."""
    _, capacity, _ = tiny_setup
    return capacity(role, *shape, 1.0) * workers


def test_a_shift_from_prompt_heavy_to_output_heavy_moves_workers_the_right_way(tiny_setup, tiny_profile):
    prompt_rate = rate_for(tiny_setup, "prefill", PROMPT_HEAVY, 1.3)
    output_rate = rate_for(tiny_setup, "decode", OUTPUT_HEAVY, 1.3)
    assert prompt_rate * SETTINGS.headroom < rate_for(tiny_setup, "decode", PROMPT_HEAVY, 1), "one decode suffices"
    assert output_rate * SETTINGS.headroom < rate_for(tiny_setup, "prefill", OUTPUT_HEAVY, 1), "one prefill suffices"
    sim = run(tiny_setup, tiny_profile, [(60, prompt_rate, PROMPT_HEAVY), (90, output_rate, OUTPUT_HEAVY)])
    changes = [(i.at, i.decision.targets) for i in sim.intervals if i.decision.applied]
    first, second = [i for i in sim.intervals if i.at <= 60], [i for i in sim.intervals if i.at > 60]

    applied = [i for i in first if i.decision.applied]
    assert applied and applied[0].decision.targets["prefill"] >= 2, changes
    assert all(i.decision.targets["decode"] == 1 for i in first), changes
    before = [i.attainment for i in first if i.at <= applied[0].at and i.finished]
    after = [i.attainment for i in first if i.at >= applied[0].at + sim.startup_s + 20 and i.finished]
    assert after and min(before) < 0.9 <= min(after), (before, after)

    moved = [i for i in second if i.decision.applied]
    assert any(i.decision.targets["decode"] >= 2 for i in moved), changes
    final = sim.counts()
    assert final["prefill"] == 1 and final["decode"] >= 2, (final, changes)
    low = [i for i in second if i.finished and i.attainment < 0.9]
    settled = [i.attainment for i in second if i.at >= moved[-1].at + sim.startup_s + 20 and i.finished]
    assert low and settled and min(settled) >= 0.9, ([i.attainment for i in second], changes)


def test_steady_load_changes_nothing_for_ten_intervals(tiny_setup, tiny_profile):
    rate = rate_for(tiny_setup, "prefill", PROMPT_HEAVY, 0.6)  # one prefill, one decode serve it
    sim = run(tiny_setup, tiny_profile, [(SETTINGS.interval_s * 12, rate, PROMPT_HEAVY)])
    decided = sim.intervals[:10]
    assert len(decided) == 10 and not any(i.decision.applied for i in decided)
    assert all(i.counts == {"prefill": 1, "decode": 1} for i in decided)
    assert all(i.attainment >= 0.9 for i in decided if i.finished)


def test_bounds_hold_however_high_the_load(tiny_setup, tiny_profile):
    rate = rate_for(tiny_setup, "prefill", PROMPT_HEAVY, 5)
    sim = run(tiny_setup, tiny_profile, [(30, rate, PROMPT_HEAVY)])
    assert max(i.decision.targets["prefill"] for i in sim.intervals) == 3
    assert all(1 <= c <= 3 for i in sim.intervals for c in i.counts.values())
    assert max(i.counts["prefill"] for i in sim.intervals) == 3
    assert not math.isnan(sim.intervals[-1].attainment) or sim.intervals[-1].finished == 0


# ---- splitserve simulate --planner ---------------------------------------------------------------


def planner_config(tmp_path, mode: str = "disaggregated") -> Path:
    """A deployment config with SETTINGS as its planner: section, as an operator writes one."""
    import yaml

    section = {**vars(SETTINGS), "profile": str(PROFILE)}
    raw = {"mode": mode, "engine": {"num_blocks": 2048, "max_num_seqs": 32}, "planner": section}
    if mode != "disaggregated":
        section["enabled"] = False
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def simulate_cli(capsys, *args: str) -> tuple[int, str, str]:
    from splitserve.cli import main

    code = main(["simulate", "--profile", str(PROFILE), *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_simulate_planner_scales_a_prompt_heavy_load(tmp_path, capsys, tiny_profile):
    """``splitserve simulate --planner``: the config's planner resizes the simulated deployment. Prompt-heavy
    load at 1.3x one prefill worker's capacity (by the planner's own oracle) for 60 s adds a prefill worker,
    and the JSON result lists every interval; the text one prints them."""
    from splitserve.deploy.config import DeploymentConfig
    from splitserve.deploy.live_planner import profile_oracles

    config = planner_config(tmp_path)
    capacity, _ = profile_oracles(SETTINGS, DeploymentConfig.from_file(config), tiny_profile)
    rate = capacity("prefill", *PROMPT_HEAVY, 1.0) * 1.3
    workload = ["--dataset", "random", "--input-len", str(PROMPT_HEAVY[0]), "--output-len", str(PROMPT_HEAVY[1])]
    workload += ["--num-prompts", str(round(60 * rate)), "--request-rate", f"{rate:.6f}", "--seed", "1"]
    code, out, err = simulate_cli(capsys, "--config", str(config), "--planner", "--startup-s", "8", *workload, "--json")
    assert code == 0, err
    result = json.loads(out)
    intervals = result["planner"]
    assert len(intervals) >= 5 and intervals[0]["counts"] == {"prefill": 1, "decode": 1}
    applied = [i for i in intervals if i["applied"]]
    assert applied and applied[0]["targets"]["prefill"] >= 2, [i["decision"] for i in intervals]
    assert result["final_counts"]["prefill"] >= 2 and result["completed"] == round(60 * rate)
    later = [i for i in intervals if i["at_s"] >= applied[0]["at_s"] + 8]
    assert later and all(i["counts"]["prefill"] >= 2 for i in later), "the new worker is counted once it started"
    assert all(i["attainment"] is None or 0 <= i["attainment"] <= 1 for i in intervals)

    code, out, err = simulate_cli(capsys, "--config", str(config), "--planner", "--startup-s", "8", *workload)
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("planner: ")]
    assert len(lines) == 1 and f"{len(intervals)} decisions every 5 s, {len(applied)} applied" in lines[0]
    assert out.count("within the planner's SLOs") == len(intervals)


def test_simulate_planner_refuses_what_it_cannot_plan(tmp_path, capsys):
    code, _, err = simulate_cli(capsys, "--config", str(planner_config(tmp_path, "colocated")), "--planner")
    assert code == 2 and "error: mode: the live planner sizes prefill and decode" in err
    code, _, err = simulate_cli(capsys, "--planner", "--rates", "1,2", "--goodput", "ttft:100")
    assert code == 2 and "error: --planner: " in err
    code, _, err = simulate_cli(capsys, "--planner", "--startup-s", "-1", "--num-prompts", "1")
    assert code == 2 and "error: --startup-s: " in err
