"""The live planner's decisions (splitserve/deploy/live_planner.py), on snapshots of the router's load and a fake
clock: a load that shifts from prompt-heavy to output-heavy moves workers the right way, steady load
changes nothing for 10 intervals, one noisy interval never scales, bounds and the cool-down hold."""

from __future__ import annotations

import pytest

from splitserve.deploy.live_planner import Planner
from splitserve.deploy.planner_settings import PlannerSettings
from splitserve.router.load import LoadSnapshot

SETTINGS = PlannerSettings(
    interval_s=10,
    headroom=1.0,
    smoothing=1.0,
    stable_intervals=3,
    scale_down_intervals=5,
    cooldown_s=60,
    min_prefill=1,
    max_prefill=4,
    min_decode=1,
    max_decode=4,
)


def snapshot(rate: float, prompt: int, output: int, finished: int = 50) -> LoadSnapshot:
    return LoadSnapshot(60.0, rate, finished, prompt, output, 100.0, 200.0, 20.0, 30.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_planner(settings: PlannerSettings = SETTINGS) -> tuple[Planner, Clock]:
    """One prefill worker serves 2000 / prompt req/s, one decode worker 200 / output req/s; the simulator's
    latencies equal the measured ones (no correction)."""
    clock = Clock()

    def capacity(role: str, prompt: int, output: int, slowdown: float) -> float:
        return (2000 / prompt if role == "prefill" else 200 / output) / slowdown

    return Planner(settings, capacity, lambda current, rate, p, o: (100.0, 20.0), clock), clock


def run(planner: Planner, clock: Clock, current: dict, snap: LoadSnapshot, intervals: int) -> list:
    decisions = []
    for _ in range(intervals):
        clock.now += planner.settings.interval_s
        decision = planner.decide(snap, current)
        decisions.append(decision)
        if decision.applied:
            current.update(decision.targets)
    return decisions


def test_a_shift_from_prompt_heavy_to_output_heavy_moves_workers_the_right_way():
    planner, clock = make_planner()
    current = {"prefill": 1, "decode": 1}
    # 3 req/s of 2000-token prompts and 10-token outputs: prefill needs 3, decode 1
    decisions = run(planner, clock, current, snapshot(3.0, 2000, 10), 3)
    assert [d.applied for d in decisions] == [False, False, True], "three agreeing intervals, then the change"
    assert current == {"prefill": 3, "decode": 1}
    # 3 req/s of 100-token prompts and 150-token outputs: decode needs 3, prefill 1
    decisions = run(planner, clock, current, snapshot(3.0, 100, 150), 12)
    applied = [d for d in decisions if d.applied]
    assert applied and applied[0].targets == {"prefill": 1, "decode": 3}
    assert current == {"prefill": 1, "decode": 3}
    after = [d for d in decisions if 0 < d.at - applied[0].at < 60]
    assert after and all(not d.applied for d in after), "nothing changes within the cool-down"


def test_steady_load_changes_nothing_for_ten_intervals():
    planner, clock = make_planner()
    current = {"prefill": 2, "decode": 2}
    decisions = run(planner, clock, current, snapshot(2.0, 1000, 100), 10)  # needs 1 prefill, 1 decode
    changed = [d for d in decisions if d.applied]
    assert len(changed) <= 1, "at most the one scale-down a sized deployment needs"
    settled = {"prefill": 1, "decode": 1} if changed else current
    more = run(planner, clock, dict(settled), snapshot(2.0, 1000, 100), 10)
    assert not any(d.applied for d in more) and all(d.reason == "steady" for d in more)


def test_one_noisy_interval_never_scales():
    planner, clock = make_planner()
    current = {"prefill": 1, "decode": 1}
    quiet, spike = snapshot(0.5, 1000, 100), snapshot(20.0, 1000, 100)
    for snap in [quiet, quiet, spike, quiet, quiet, spike, quiet]:
        run(planner, clock, current, snap, 1)
    assert current == {"prefill": 1, "decode": 1}


def test_bounds_hold_however_high_the_load():
    planner, clock = make_planner()
    current = {"prefill": 1, "decode": 1}
    decisions = run(planner, clock, current, snapshot(1000.0, 4000, 1000), 4)
    assert all(1 <= d.targets[r] <= 4 for d in decisions for r in d.targets)
    assert current == {"prefill": 4, "decode": 4}


def test_measured_latency_worse_than_simulated_corrects_the_capacity():
    clock = Clock()
    planner = Planner(
        SETTINGS, lambda role, p, o, slowdown: 10.0 / slowdown, lambda current, rate, p, o: (50.0, 10.0), clock
    )
    current = {"prefill": 1, "decode": 1}
    decision = run(planner, clock, current, snapshot(8.0, 100, 10), 1)[0]
    # measured p50 TTFT 100 ms against 50 predicted, TPOT 20 against 10: steps twice as slow, half the capacity
    assert decision.corrections == {"prefill": 2.0, "decode": 2.0}
    assert decision.targets == {"prefill": 2, "decode": 2}


def test_settings_are_checked_by_name():
    with pytest.raises(ValueError, match="^max_decode: 1 is below min_decode 2"):
        PlannerSettings(min_decode=2, max_decode=1)
    with pytest.raises(ValueError, match="^profile: "):
        PlannerSettings(enabled=True)
