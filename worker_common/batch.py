"""One continuous batch's step, as every worker takes it: schedule ▸ run the model ▸ apply the results.

The scheduler and the block manager are shared with handler threads and transfer callbacks, so the
worker's lock is held around the scheduler's calls and never while the model runs. What a worker does
with the results (send a first token, start a transfer, stream tokens) stays in the worker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

from splitserve.engine.core import EngineCore
from splitserve.engine.scheduler.request import Request
from splitserve.engine.scheduler.scheduler import Scheduler, SchedulerOutput
from splitserve.worker_common.metrics import WorkerMetrics

StepKind = Literal["prefill", "decode"]  # "prefill" if the step computes prompt tokens


class Batch:
    def __init__(self, core: EngineCore, scheduler: Scheduler, lock: threading.RLock, metrics: WorkerMetrics) -> None:
        self.core, self.scheduler, self.lock, self.metrics = core, scheduler, lock, metrics

    def schedule(self) -> SchedulerOutput:
        """This step's work (maybe empty, maybe with requests preempted to make room)."""
        with self.lock:
            return self.scheduler.schedule()

    def run(
        self, output: SchedulerOutput, kind: StepKind, on_layer_done: Callable[[int], None] | None = None
    ) -> list[Request]:
        """Run the scheduled step on the model, timed for the metrics, and apply the sampled tokens;
        returns the requests that got a token (some of them finished by it)."""
        start = time.monotonic()
        sampled = self.core.runner.execute(output, on_layer_done=on_layer_done)
        self.metrics.step(kind, time.monotonic() - start, len(output.scheduled), output.num_tokens)
        with self.lock:
            return self.scheduler.update(output, sampled)
