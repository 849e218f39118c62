"""The live planner on a simulated deployment (``splitserve simulate --planner``).

The planner is the live one (``splitserve.deploy.live_planner.Planner``, its hysteresis and cool-down
included). It reads a ``LoadWindow`` (the router's own class), which the simulated router feeds as the
real router feeds its own: an arrival at admission, and each finished request's prompt, output, TTFT and
decode time. Every ``interval_s`` it decides. An applied change takes the path of ``splitserve scale``:

- a new worker starts, and takes work only after ``startup_s`` (a real one loads its weights and
  registers);
- a removed worker, the newest of its role first, drains: nothing new is routed to it, a decode worker
  hands its requests back (they migrate), and a prefill worker finishes what it holds;
- the next decision comes ``interval_s`` after the change is complete, as the live loop awaits ``scale``
  before it sleeps again.

Each interval is recorded with its counts, its snapshot, the decision, and the SLO attainment of the
requests that finished in it. Tests and ``--planner`` read how the deployment moved and whether
attainment recovered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.deploy.live_planner import Decision, Planner
from splitserve.planning.sim_workers import SimRequest
from splitserve.planning.simulator import SimConfig, Simulation
from splitserve.router.load import LoadSnapshot, LoadWindow


@dataclass
class Interval:
    at: float
    counts: dict[str, int]  # workers serving or starting, per role, when the decision was taken
    snapshot: LoadSnapshot
    decision: Decision
    finished: int  # requests finished since the previous decision
    attainment: float  # ... the share of them that met both SLOs (nan: none finished)


class PlannedSimulation(Simulation):
    def __init__(self, config: SimConfig, planner: Planner, startup_s: float = 10.0) -> None:
        if config.mode != "disaggregated":
            raise ValueError("mode: the live planner sizes prefill and decode (mode disaggregated)")
        super().__init__(config)
        self.planner = planner
        self.startup_s = startup_s
        planner.clock = lambda: self.time
        self.load = LoadWindow(planner.settings.window_s, clock=lambda: self.time)
        self.load.started = 0.0
        self.intervals: list[Interval] = []
        self.starting: set[str] = set()
        self._total = 0
        self._counted = 0  # requests in ``done`` when the last interval was recorded

    def run(self, requests: Sequence[SimRequest]) -> list[SimRequest]:
        self._total = len(requests)
        self.at(self.planner.settings.interval_s, self._tick)
        return super().run(requests)

    # ---- what the router's LoadWindow sees ------------------------------------------------------

    def _arrive(self, job: SimRequest) -> None:
        self.load.arrived()
        super()._arrive(job)

    def _finish(self, job: SimRequest) -> None:
        super()._finish(job)
        first_ms = (job.first_token_s - job.arrival_s) * 1e3
        self.load.finished(len(job.prompt), len(job.output), first_ms, (job.finished_s - job.first_token_s) * 1e3)

    # ---- the planner's loop ---------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Workers per role as the launcher counts them: serving or starting, not draining."""
        return {
            role: len(self.serving(role)) + sum(w.startswith(role) for w in self.starting)
            for role in ("prefill", "decode")
        }

    def _tick(self) -> None:
        snapshot = self.load.snapshot()
        recent = self.load.snapshot(since=self.planner.settled_at)
        current = self.counts()
        decision = self.planner.decide(snapshot, current, recent)
        finished = self.done[self._counted :]
        self._counted = len(self.done)
        self.intervals.append(
            Interval(self.time, current, snapshot, decision, len(finished), self._attainment(finished))
        )
        wait = self._apply(decision.targets, current) if decision.applied else 0.0
        if decision.applied:
            self.planner.settled_at = self.time + wait
        if len(self.done) < self._total and self._events:  # nothing else due: every request has ended
            self.at(self.time + wait + self.planner.settings.interval_s, self._tick)

    def _attainment(self, jobs: list[SimRequest]) -> float:
        s = self.planner.settings
        good = 0
        for job in jobs:
            if job.error or job.finished_s is None:
                continue
            ttft_ms = (job.first_token_s - job.arrival_s) * 1e3
            tokens = len(job.output)
            tpot_ms = (job.finished_s - job.first_token_s) * 1e3 / (tokens - 1) if tokens > 1 else 0.0
            good += ttft_ms <= s.ttft_ms and tpot_ms <= s.tpot_ms
        return good / len(jobs) if jobs else float("nan")

    def _apply(self, targets: dict[str, int], current: dict[str, int]) -> float:
        """``splitserve scale`` to ``targets``; returns how long it takes (a new worker's start)."""
        wait = 0.0
        for role, target in targets.items():
            for _ in range(target - current[role]):
                worker = self.spawn(role, healthy=False)
                self.starting.add(worker.worker_id)
                self.at(self.time + self.startup_s, lambda w=worker.worker_id: self._started(w))
                wait = self.startup_s
            serving = sorted(self.serving(role), key=lambda w: int(w.worker_id.rsplit("-", 1)[1]))
            for worker in serving[target:][::-1]:
                self.drain(worker.worker_id)
        return wait

    def _started(self, worker_id: str) -> None:
        self.starting.discard(worker_id)
        self.ready(worker_id)
