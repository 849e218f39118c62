"""The live planner: resize prefill and decode as the traffic changes (the deployment config's ``planner:``,
off by default).

Every ``interval_s`` it reads the router's own figures (``router.load``: arrival rate, prompt and output
lengths, TTFT and TPOT percentiles over ``window_s``) and decides:

1. **predict** the next interval's arrival rate: an exponentially weighted mean of the measured ones
   (``smoothing``), never below the rate measured now;
2. **capacity** of one prefill and one decode worker for requests of the measured shape, within the SLOs:
   the simulator (``splitserve.planning.plan.max_rate``), timed by the profile, cached per shape;
3. **correct** it by how far the measured latencies are from what the simulator predicts for the current
   deployment at the current load (a phase measured 1.5x slower than simulated gets 1/1.5 the capacity);
4. **size** each phase for the predicted rate times ``headroom``, within ``min_*``/``max_*``;
5. **apply** only a change that the last ``stable_intervals`` decisions agree on (all up, or all down; a
   scale-down needs ``scale_down_intervals``), and not within ``cooldown_s`` of the last change, through
   the same path as ``splitserve scale`` (new workers register; removed ones drain, their requests migrate).

So steady load never oscillates and one noisy interval never scales. Each decision is logged
(``splitserve.planner``), counted in the router's metrics and shown by ``splitserve status``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from splitserve.planning.profile import Profile
from splitserve.planning.settings import PlannerSettings

log = logging.getLogger("splitserve.planner")


@dataclass
class Decision:
    at: float
    targets: dict[str, int]  # role -> workers wanted
    current: dict[str, int]
    rate: float  # measured arrivals (req/s)
    predicted: float
    prompt_tokens: float
    output_tokens: float
    corrections: dict[str, float]
    applied: bool = False
    reason: str = ""

    def describe(self) -> str:
        changes = [
            f"{r} {self.current[r]} -> {self.targets[r]}" for r in self.targets if self.targets[r] != self.current[r]
        ]
        what = ", ".join(changes) if changes else "no change"
        state = "applied" if self.applied else (self.reason or "waiting")
        return (
            f"{what} ({state}; arrivals {self.rate:.3g} req/s, predicted {self.predicted:.3g}; prompt "
            f"{self.prompt_tokens:.0f}, output {self.output_tokens:.0f} tokens; corrections "
            + ", ".join(f"{r} {c:.2f}" for r, c in self.corrections.items())
            + ")"
        )


CapacityFn = Callable[[str, int, int], float]  # (role, prompt tokens, output tokens) -> req/s of one worker
PredictFn = Callable[[dict[str, int], float, int, int], tuple[float, float]]  # -> (ttft p90 ms, tpot p90 ms)


@dataclass
class Planner:
    """The decisions, without I/O: ``decide`` takes a load snapshot and the current counts."""

    settings: PlannerSettings
    capacity: CapacityFn
    predict: PredictFn
    clock: Callable[[], float] = time.monotonic
    history: deque = field(default_factory=lambda: deque(maxlen=32))
    last_change: float = -math.inf
    predicted_rate: float | None = None

    def decide(self, snapshot, current: dict[str, int]) -> Decision:
        s = self.settings
        now = self.clock()
        rate = snapshot.arrival_rate
        self.predicted_rate = (
            rate if self.predicted_rate is None else (s.smoothing * rate + (1 - s.smoothing) * self.predicted_rate)
        )
        predicted = max(self.predicted_rate, rate)
        prompt = round(snapshot.mean_prompt_tokens) or 1
        output = round(snapshot.mean_output_tokens) or 1
        corrections = self._corrections(snapshot, current, rate, prompt, output)
        targets = {}
        for role in ("prefill", "decode"):
            one = self.capacity(role, prompt, output) / corrections[role]
            need = math.ceil(predicted * s.headroom / one - 1e-9) if one > 0 else s.bounds(role)[1]
            low, high = s.bounds(role)
            targets[role] = min(max(need, low), high)
        decision = Decision(now, targets, dict(current), rate, predicted, prompt, output, corrections)
        self.history.append(decision)
        self._gate(decision)
        return decision

    def _corrections(self, snapshot, current, rate: float, prompt: int, output: int) -> dict[str, float]:
        """Measured over simulated latency at the current deployment and load, per phase (1 without data)."""
        if snapshot.finished < 5 or rate <= 0:
            return {"prefill": 1.0, "decode": 1.0}
        ttft, tpot = self.predict(current, rate, prompt, output)
        ratio = lambda measured, simulated: min(max(measured / simulated, 0.5), 4.0) if simulated > 0 else 1.0  # noqa: E731
        return {"prefill": ratio(snapshot.ttft_p90_ms, ttft), "decode": ratio(snapshot.tpot_p90_ms, tpot)}

    def _gate(self, decision: Decision) -> None:
        """Hysteresis and cool-down: mark the decision applied only when it should be."""
        s = self.settings
        if decision.targets == decision.current:
            decision.reason = "steady"
            return
        if decision.at - self.last_change < s.cooldown_s:
            decision.reason = "cooling down"
            return
        up = any(decision.targets[r] > decision.current[r] for r in decision.targets)
        needed = s.stable_intervals if up else s.scale_down_intervals
        recent = list(self.history)[-needed:]
        agree = len(recent) == needed and all(
            d.current == decision.current and _direction(d) == _direction(decision) for d in recent
        )
        if not agree:
            decision.reason = f"waiting for {needed} agreeing intervals"
            return
        if not up:  # down only as far as every recent decision wanted
            decision.targets = {r: max(d.targets[r] for d in recent) for r in decision.targets}
        decision.applied = True
        self.last_change = decision.at


def _direction(decision: Decision) -> tuple[int, ...]:
    return tuple(
        (decision.targets[r] > decision.current[r]) - (decision.targets[r] < decision.current[r])
        for r in decision.targets
    )


# ---- wired to a running deployment ------------------------------------------------------------------


def simulator_oracles(settings: PlannerSettings, base, profile: Profile, requests: int = 60):
    """``capacity`` and ``predict`` answered by the simulator on requests of the measured shape."""
    from splitserve.planning import plan

    slo = plan.Slo(settings.ttft_ms, settings.tpot_ms, 0.9)
    cache: dict[tuple, float] = {}

    def workload(prompt: int, output: int):
        return [
            ([(7 + 31 * i + 13 * j) % (profile.model.vocab_size - 1) for j in range(prompt)], output)
            for i in range(requests)
        ]

    def bucket(n: int) -> int:
        return 1 << max(0, round(math.log2(max(n, 1)) * 2) // 2)  # powers of two (and between): cache hits

    def capacity(role: str, prompt: int, output: int) -> float:
        key = (role, bucket(prompt), bucket(output))
        if key not in cache:
            other = "decode" if role == "prefill" else "prefill"
            deployment = plan.with_roles(base, "disaggregated", **{role: (1, 1), other: (4, 1)})
            one = plan.Slo(slo.ttft_ms if role == "prefill" else 1e12, slo.tpot_ms if role == "decode" else 1e12, 0.9)
            work = workload(key[1], key[2])
            profiles = {"prefill": profile, "decode": profile}
            cache[key] = plan.max_rate(lambda r: plan.attainment(deployment, profiles, work, r, one, 0) >= 0.9)
        return cache[key]

    def predict(current: dict[str, int], rate: float, prompt: int, output: int) -> tuple[float, float]:
        from splitserve.bench.arrivals import arrival_offsets
        from splitserve.planning.deployment import sim_config
        from splitserve.planning.simulator import simulate

        deployment = plan.with_roles(
            base, "disaggregated", prefill=(current["prefill"], 1), decode=(current["decode"], 1)
        )
        work = workload(bucket(prompt), bucket(output))
        result, _ = simulate(
            sim_config(deployment, {"prefill": profile, "decode": profile}),
            work,
            arrival_offsets(len(work), rate),
            (90,),
        )
        return result["p90_ttft_ms"], result["p90_tpot_ms"]

    return capacity, predict


class LivePlanner:
    """The planner's loop on the router's event loop: read, decide, apply through ``scale``."""

    def __init__(
        self,
        planner: Planner,
        router,
        scale: Callable[[dict[str, int]], Awaitable[dict[str, int]]],
        counts: Callable[[], dict[str, int]],
    ) -> None:
        self.planner, self.router, self.scale, self.counts = planner, router, scale, counts
        self.decisions = 0
        self.changes = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _run(self) -> None:
        settings = self.planner.settings
        while True:
            await asyncio.sleep(settings.interval_s)
            try:
                await self.tick()
            except Exception as e:  # a planner bug must not take the router down
                log.error("planner: %s: %s", type(e).__name__, e)

    async def tick(self) -> Decision:
        settings = self.planner.settings
        snapshot = self.router.load.snapshot(settings.window_s)
        current = self.counts()
        loop = asyncio.get_running_loop()
        decision = await loop.run_in_executor(None, self.planner.decide, snapshot, current)
        self.decisions += 1
        outcome = "applied" if decision.applied else ("steady" if decision.reason == "steady" else "held")
        self.router.metrics.planner_decisions.labels(outcome).inc()
        if decision.applied:
            self.changes += 1
            log.info("planner: %s", decision.describe())
            try:
                await self.scale({r: n for r, n in decision.targets.items() if n != current[r]})
            except (ValueError, RuntimeError, TimeoutError) as e:
                decision.reason = f"scale failed: {e}"
                log.warning("planner: scale failed: %s", e)
        stamp = time.strftime("%H:%M:%S")
        self.router.planner_status = f"{decision.describe()} at {stamp}"
        return decision


def planner_for(settings: PlannerSettings, base, router, scale, counts: Callable[[], dict[str, int]]) -> LivePlanner:
    profile = Profile.load(settings.profile)
    capacity, predict = simulator_oracles(settings, base, profile)
    return LivePlanner(Planner(settings, capacity, predict), router, scale, counts)


def counts_of(actors: Mapping[str, object]) -> dict[str, int]:
    """Workers per role from the launcher's actor table (worker ids are ``<role>-<n>``)."""
    out = {"prefill": 0, "decode": 0}
    for worker_id in actors:
        role = worker_id.rpartition("-")[0]
        if role in out:
            out[role] += 1
    return out
