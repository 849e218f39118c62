"""The live planner: resize prefill and decode as the traffic changes (the deployment config's ``planner:``,
off by default).

Every ``interval_s`` it reads the router's own figures (``router.load``: arrival rate, prompt and output
lengths, TTFT and TPOT percentiles over ``window_s``) and decides:

1. **predict** the next interval's arrival rate: an exponentially weighted mean of the measured ones
   (``smoothing``), never below the rate measured now;
2. **capacity** of one prefill and one decode worker for requests of the measured shape, within the SLOs
   (``ProfileModel``, from the profile's step costs, as Dynamo's planner reads its profiles): a prefill
   worker's throughput with full steps, at the utilization whose queueing keeps TTFT within the SLO; a
   decode worker's, the throughput of its largest batch whose step is within the TPOT SLO;
3. **correct** it by how far the measured latencies (p50) are from what the same model predicts for the
   current deployment at the current load: a phase measured 1.5x slower than predicted has its step costs
   taken 1.5x (within 0.5x and 4x);
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

from splitserve.deploy.config import DeploymentConfig
from splitserve.deploy.planner_settings import PlannerSettings
from splitserve.deploy.profile import Profile

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


# (role, prompt tokens, output tokens, slowdown) -> req/s one worker serves within the SLOs when its steps
# take ``slowdown`` times what the profile says
CapacityFn = Callable[[str, int, int, float], float]
# (workers per role, arrival rate, prompt tokens, output tokens) -> the predicted (TTFT p50 ms, TPOT p50 ms)
PredictFn = Callable[[dict[str, int], float, int, int], tuple[float, float]]


@dataclass
class Planner:
    """The decisions, without I/O: ``decide`` takes a load snapshot and the current counts."""

    settings: PlannerSettings
    capacity: CapacityFn
    predict: PredictFn
    clock: Callable[[], float] = time.monotonic
    history: deque = field(default_factory=lambda: deque(maxlen=32))
    last_change: float = -math.inf
    settled_at: float = -math.inf  # when the last change was complete (its new workers serving)
    predicted_rate: float | None = None

    def decide(self, snapshot, current: dict[str, int], recent=None) -> Decision:
        """``snapshot``: the router's load over the window; ``recent``: the same window, only the requests
        that arrived since ``settled_at`` (the corrections compare the current deployment's latencies
        only; None: no change yet, the snapshot's)."""
        s = self.settings
        now = self.clock()
        rate = snapshot.arrival_rate
        self.predicted_rate = (
            rate if self.predicted_rate is None else (s.smoothing * rate + (1 - s.smoothing) * self.predicted_rate)
        )
        predicted = max(self.predicted_rate, rate)
        prompt = round(snapshot.mean_prompt_tokens) or 1
        output = round(snapshot.mean_output_tokens) or 1
        corrections = self._corrections(snapshot if recent is None else recent, current, rate, prompt, output)
        targets = {}
        for role in ("prefill", "decode"):
            one = self.capacity(role, prompt, output, corrections[role])
            need = math.ceil(predicted * s.headroom / one - 1e-9) if one > 0 else s.bounds(role)[1]
            low, high = s.bounds(role)
            targets[role] = min(max(need, low), high)
        decision = Decision(now, targets, dict(current), rate, predicted, prompt, output, corrections)
        self.history.append(decision)
        self._gate(decision)
        return decision

    def _corrections(self, snapshot, current, rate: float, prompt: int, output: int) -> dict[str, float]:
        """Measured over predicted latency (p50) at the current deployment and load, per phase: how much
        slower than the profile the workers are (1 without enough data, or where the prediction is a
        queue without end, which no measurement can be compared with)."""
        if snapshot.finished < 5 or rate <= 0:
            return {"prefill": 1.0, "decode": 1.0}
        ttft, tpot = self.predict(current, rate, prompt, output)

        def ratio(measured: float, predicted: float) -> float:
            if not (0 < predicted < math.inf) or measured <= 0:
                return 1.0
            return min(max(measured / predicted, 0.5), 4.0)

        return {"prefill": ratio(snapshot.ttft_p50_ms, ttft), "decode": ratio(snapshot.tpot_p50_ms, tpot)}

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
        self.last_change = self.settled_at = decision.at  # the caller moves settled_at when the change is done


def _direction(decision: Decision) -> tuple[int, ...]:
    return tuple(
        (decision.targets[r] > decision.current[r]) - (decision.targets[r] < decision.current[r])
        for r in decision.targets
    )


# ---- wired to a running deployment ------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileModel:
    """What a profile says one worker sustains, and what latency a deployment shows, for requests of one
    shape (as Dynamo's planner reads its profiles: the figures at the SLO targets, not a simulated burst,
    which fits in the steps it fills at any rate while steady arrivals beyond capacity queue without end).
    ``slowdown`` scales the profile's step costs: the planner's measured-over-predicted correction."""

    profile: Profile
    deployment: DeploymentConfig  # the engine's budgets and the KV blocks
    ttft_ms: float
    tpot_ms: float

    def __post_init__(self) -> None:
        # The planner sizes a disaggregated deployment, and the TPOT it predicts spans each KV hand-off.
        self.profile.require_transfer("the planner's TPOT prediction spans each request's KV transfer")

    def _prefill_times(self, prompt: int, slowdown: float) -> tuple[float, float]:
        """(one prompt alone, one prompt's share of full steps), in seconds."""
        from splitserve.deploy.profile import StepShape

        p, engine = self.profile, self.deployment.engine
        budget = min(engine.max_num_batched_tokens, engine.prefill_chunk_size or engine.max_num_batched_tokens)
        chunks = [(start, min(budget, prompt - start)) for start in range(0, prompt, budget)]
        alone = sum(p.serving_step_s(StepShape.of([chunk]), 0) for chunk in chunks) + p.token_overhead_s
        fixed = p.step_coefficients["const"] + p.step_overhead_s
        packed = alone - fixed * len(chunks) + fixed * prompt / budget
        return alone * slowdown, packed * slowdown

    def prefill_capacity(self, prompt: int, slowdown: float = 1.0) -> float:
        """Requests per second one prefill worker sustains with TTFT within the SLO on average: its
        throughput with every step full (the fixed cost of a step shared by the prompts in it), times the
        utilization at which the queue in front of one prompt's own prefill time ``S`` still leaves TTFT
        within the SLO (M/D/1: ``S + rho S / 2(1 - rho) <= T``, so ``rho <= 2x / (1 + 2x)``, ``x = T/S - 1``)."""
        alone, packed = self._prefill_times(prompt, slowdown)
        x = (self.ttft_ms / 1e3 - self.profile.ttft_overhead_s) / alone - 1
        return (2 * x / (1 + 2 * x)) / packed if x > 0 else 0.0

    def _decode_step_s(self, batch: int, context: int, slowdown: float) -> float:
        from splitserve.deploy.profile import StepShape

        return self.profile.serving_step_s(StepShape.of((), [context] * batch), batch) * slowdown

    def _most_sequences(self, prompt: int, output: int) -> int:
        from splitserve.common.arith import ceil_div

        engine = self.deployment.engine
        per_request = ceil_div(prompt + output, engine.block_size)
        return max(1, min(engine.max_num_seqs, role_blocks(self.deployment, "decode", self.profile) // per_request))

    def decode_capacity(self, prompt: int, output: int, slowdown: float = 1.0) -> float:
        """Requests per second one decode worker sustains with its steps within the TPOT SLO: the throughput
        of the largest batch (within ``max_num_seqs`` and the KV blocks) whose step, at the context of a
        request halfway through its output, takes at most ``tpot_ms``."""
        steps = output - 1  # the first token comes from the prefill
        if steps < 1:
            return math.inf
        best, context = 0.0, prompt + output // 2
        for batch in range(1, self._most_sequences(prompt, output) + 1):
            step = self._decode_step_s(batch, context, slowdown)
            if step * 1e3 > self.tpot_ms:
                break
            best = max(best, batch / (steps * step))
        return best

    def capacity(self, role: str, prompt: int, output: int, slowdown: float = 1.0) -> float:
        if role == "decode":
            return self.decode_capacity(prompt, output, slowdown)
        return self.prefill_capacity(prompt, slowdown)

    def predict(self, current: dict[str, int], rate: float, prompt: int, output: int) -> tuple[float, float]:
        """TTFT and TPOT (ms) of ``current`` workers at ``rate``, by the same model: M/D/1 for the prefill
        queue (inf past saturation), and the decode batch that Little's law gives (``b = lambda T b-steps``)."""
        alone, packed = self._prefill_times(prompt, 1.0)
        rho = rate * packed / max(current["prefill"], 1)
        ttft = (alone + rho * alone / (2 * (1 - rho)) + self.profile.ttft_overhead_s) * 1e3 if rho < 1 else math.inf
        steps = max(output - 1, 0)
        if steps == 0:
            return ttft, 0.0
        per_worker, context = rate / max(current["decode"], 1), prompt + output // 2
        most, batch = self._most_sequences(prompt, output), 1.0
        for _ in range(50):
            batch = min(most, max(1.0, per_worker * steps * self._decode_step_s(round(batch), context, 1.0)))
        # A request's TPOT, as the router measures it, spans its KV transfer too (first token to last).
        transfer = self.profile.transfer_s(self.profile.kv_bytes(prompt))
        return ttft, (transfer / steps + self._decode_step_s(round(batch), context, 1.0)) * 1e3


def profile_oracles(settings: PlannerSettings, base, profile: Profile) -> tuple[CapacityFn, PredictFn]:
    """``capacity`` and ``predict`` from the workers' profile (``ProfileModel``), for the planner's SLOs."""
    model = ProfileModel(profile, base, settings.ttft_ms, settings.tpot_ms)
    return model.capacity, model.predict


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
        recent = self.router.load.snapshot(settings.window_s, since=self.planner.settled_at)
        current = self.counts()
        loop = asyncio.get_running_loop()
        decision = await loop.run_in_executor(None, self.planner.decide, snapshot, current, recent)
        self.decisions += 1
        outcome = "applied" if decision.applied else ("steady" if decision.reason == "steady" else "held")
        self.router.metrics.planner_decisions.labels(outcome).inc()
        if decision.applied:
            self.changes += 1
            log.info("planner: %s", decision.describe())
            try:
                await self.scale({r: n for r, n in decision.targets.items() if n != current[r]})
                self.planner.settled_at = self.planner.clock()
            except (ValueError, RuntimeError, TimeoutError) as e:
                decision.reason = f"scale failed: {e}"
                log.warning("planner: scale failed: %s", e)
        stamp = time.strftime("%H:%M:%S")
        self.router.planner_status = f"{decision.describe()} at {stamp}"
        return decision


def planner_for(settings: PlannerSettings, base, router, scale, counts: Callable[[], dict[str, int]]) -> LivePlanner:
    profile = Profile.load(settings.profile)
    capacity, predict = profile_oracles(settings, base, profile)
    return LivePlanner(Planner(settings, capacity, predict), router, scale, counts)


def counts_of(actors: Mapping[str, object]) -> dict[str, int]:
    """Workers per role from the launcher's actor table (worker ids are ``<role>-<n>``)."""
    out = {"prefill": 0, "decode": 0}
    for worker_id in actors:
        role = worker_id.rpartition("-")[0]
        if role in out:
            out[role] += 1
    return out


def role_blocks(deployment: DeploymentConfig, role: str, profile: Profile) -> int:
    """KV blocks of one worker of the role: its ``num_blocks``, the engine's, else what one rank's KV
    memory holds (every rank of a worker has the same count): the profile's ``kv_cache_bytes`` where it
    says what the device leaves after the weights (a GPU profile), else the engine's ``kv_cache_bytes``."""
    role_config = getattr(deployment, role)
    engine = deployment.engine
    if role_config.num_blocks or engine.num_blocks:
        return role_config.num_blocks or engine.num_blocks
    per_block = profile.block_bytes(engine.block_size, role_config.tensor_parallel_size)
    memory = int(profile.notes.get("kv_cache_bytes") or engine.kv_cache_bytes)
    return max(1, memory // per_block)
