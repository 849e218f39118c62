"""``LocalEngine``: this repository's engine (``splitserve.engine.core.EngineCore`` and its ``Scheduler``)
behind the workers' ``Engine`` interface (``splitserve.worker_common.engine_api``).

One step, as every worker takes it: schedule ▸ run the model ▸ apply the results. The scheduler and the
block manager are shared with handler threads and transfer callbacks, so the worker's lock is held around
the scheduler's and the block manager's calls and never while the model runs. What a worker does with the
results (send a first token, start a transfer, stream tokens) stays in the worker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.engine.core import EngineConfig, EngineCore
from splitserve.engine.kv_cache.block_manager import BlockEvent
from splitserve.engine.kv_cache.cache import KVCache
from splitserve.engine.scheduler.request import FinishReason, Request
from splitserve.engine.scheduler.scheduler import Scheduler, SchedulerOutput
from splitserve.engine.tp.distributed import CollectiveError, TPGroup
from splitserve.engine.tp.step import PlanChannel
from splitserve.worker_common.engine_api import ModelFacts, ScheduledStep, StepKind, StepResult
from splitserve.worker_common.loop_clock import LoopClock
from splitserve.worker_common.metrics import WorkerMetrics


def model_facts(core: EngineCore) -> ModelFacts:
    model = core.model_config
    return ModelFacts(
        vocab_size=model.vocab_size,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=str(core.dtype).removeprefix("torch."),
        weights_checksum=core.weights_checksum,
        block_size=core.config.block_size,
    )


@dataclass(frozen=True)
class LocalStep:
    """A ``ScheduledStep`` of this engine: the scheduler's output, not to be read outside this module."""

    output: SchedulerOutput

    @property
    def is_empty(self) -> bool:
        return self.output.is_empty

    @property
    def requests(self) -> tuple[Request, ...]:
        return tuple(item.request for item in self.output.scheduled)

    @property
    def sampling(self) -> tuple[Request, ...]:
        return tuple(item.request for item in self.output.scheduled if item.samples)

    @property
    def preempted(self) -> tuple[Request, ...]:
        return self.output.preempted

    @property
    def prompt_work(self) -> bool:
        return any(r.num_tokens - r.num_computed_tokens > 1 for r in self.requests)


class LocalEngine:
    """An ``EngineCore``, the scheduler of the worker's mode (``EngineCore.make_scheduler``'s keywords) and
    the worker's lock. ``metrics``, when given, times each step (``WorkerMetrics.step``) and books the loop
    thread's schedule, run and apply to its clock (``WorkerMetrics.loop``)."""

    def __init__(
        self, core: EngineCore, lock: threading.RLock, metrics: WorkerMetrics | None = None, **scheduler_mode
    ) -> None:
        self.core, self.lock, self.metrics = core, lock, metrics
        # The worker loop's clock: schedule, run and apply are booked to their phases (worker_common.loop_clock).
        self.clock = metrics.loop if metrics is not None else LoopClock()
        self.scheduler: Scheduler = core.make_scheduler(**scheduler_mode)
        self._model = model_facts(core)

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        lock: threading.RLock,
        metrics: WorkerMetrics | None = None,
        *,
        record_block_events: bool = False,
        tp_group: TPGroup | None = None,
        **scheduler_mode,
    ) -> LocalEngine:
        core = EngineCore(config, record_block_events=record_block_events, tp_group=tp_group)
        return cls(core, lock, metrics, **scheduler_mode)

    # ---- requests -------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        with self.lock:
            self.scheduler.add(request)

    def add_running(self, request: Request) -> None:
        with self.lock:
            self.scheduler.add_running(request)

    def fork(self, parent_id: str, child: Request) -> None:
        with self.lock:
            self.scheduler.fork(parent_id, child)

    def finish(self, request_id: str, reason: FinishReason) -> None:
        with self.lock:
            self.scheduler.finish(request_id, reason)

    @property
    def num_running(self) -> int:
        with self.lock:
            return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        with self.lock:
            return len(self.scheduler.waiting)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ---- the step -------------------------------------------------------------------------------

    def schedule(self) -> LocalStep:
        """This step's work (maybe empty, maybe with requests preempted to make room)."""
        previous = self.clock.enter("schedule")
        with self.lock:
            step = LocalStep(self.scheduler.schedule())
        self.clock.enter(previous)
        return step

    def run(
        self, step: ScheduledStep, kind: StepKind | None = None, on_layer_done: Callable[[int], None] | None = None
    ) -> StepResult:
        """Run the scheduled step on the model, timed for the metrics, and apply the sampled tokens."""
        if not isinstance(step, LocalStep):
            raise TypeError(f"step: not a step of this engine: {type(step).__name__}")
        kind = kind or ("prefill" if step.prompt_work else "decode")
        output = step.output
        previous = self.clock.enter("run")
        start = time.monotonic()
        sampled = self.core.runner.execute(output, on_layer_done=on_layer_done)
        if self.metrics is not None:
            self.metrics.step(kind, time.monotonic() - start, len(output.scheduled), output.num_tokens)
        self.clock.enter("apply")
        with self.lock:
            advanced = self.scheduler.update(output, sampled)
        self.clock.enter(previous)
        return StepResult(kind, tuple(advanced), step.preempted)

    def step(self, kind: StepKind | None = None, on_layer_done: Callable[[int], None] | None = None) -> StepResult:
        scheduled = self.schedule()
        if scheduled.is_empty:
            return StepResult(kind or "decode", (), scheduled.preempted)
        return self.run(scheduled, kind, on_layer_done)

    # ---- KV blocks ------------------------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int, request: Request | None = None) -> bool:
        with self.lock:
            return self.core.blocks.allocate(request_id, num_tokens)

    def block_table(self, request_id: str) -> list[int]:
        with self.lock:
            return list(self.core.blocks.block_table(request_id))

    def free(self, request_id: str) -> None:
        with self.lock:
            self.core.blocks.free(request_id)

    @property
    def num_free_blocks(self) -> int:
        with self.lock:
            return self.core.blocks.num_free_blocks

    def kv_figures(self) -> tuple[int, int, int]:
        with self.lock:
            b = self.core.blocks
            return b.num_blocks, b.num_used_blocks, b.num_cached_blocks

    @property
    def kv_cache(self) -> KVCache:
        return self.core.kv_cache

    def cached_hashes(self) -> list[int]:
        with self.lock:
            return self.core.blocks.cached_hashes()

    def take_block_events(self) -> list[BlockEvent]:
        with self.lock:
            return self.core.blocks.take_events()

    @property
    def prefix_block_size(self) -> int:
        return self.core.config.block_size

    # ---- model facts and checks -----------------------------------------------------------------

    @property
    def model(self) -> ModelFacts:
        return self._model

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def check_request(self, token_ids: list[int], sampling) -> None:
        self.core.check_request(token_ids, sampling)

    # ---- status ---------------------------------------------------------------------------------

    @property
    def decode_graphs(self) -> str:
        return self.core.decode_graphs

    @property
    def linear_kernels(self) -> str:
        return self.core.linear_kernels

    # ---- tensor parallelism ---------------------------------------------------------------------

    @property
    def plan_channel(self) -> PlanChannel | None:
        return self.core.runner.channel

    def keep_alive(self) -> None:
        channel = self.core.runner.channel
        if channel is not None and time.monotonic() - channel.last_sent > self.core.tp_group.timeout_s / 4:
            channel.tick()

    def group_broken(self, error: Exception) -> bool:
        channel = self.core.runner.channel
        return isinstance(error, CollectiveError) or (channel is not None and channel.broken)

    def close(self) -> None:
        self.core.close()
