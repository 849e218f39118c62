"""CUDA graphs of the static decode forward, one per batch bucket, captured at start-up and replayed per step.

A decode step of a small model on a fast GPU is bound by the host launching ~1,500 small kernels, not
by the GPU. A graph records those launches once and replays them with one call. What makes that
correct is ``splitserve.engine.runner.static_decode``: each bucket's forward reads only persistent buffers (refilled in
place before each replay) and the KV cache, at fixed addresses and shapes.

Lifecycle::

    DecodeGraphs(forward, buckets, hidden_size, ...)   # forward(bucket) -> hidden [bucket, hidden]
      .capture()   # largest bucket first: one eager warm-up, then capture into one shared memory pool
      .replay(b)   # per step, after the inputs are in the buffers: hidden rows [b, hidden]

Graphs share one memory pool, captured largest first so the smaller ones fit in what the largest
reserved; no intermediate outlives a replay, and replays never overlap (one engine step at a time).
Each graph copies its result into one persistent ``hidden`` buffer, outside the pool.

``GraphBackend`` is the seam: ``CudaGraphBackend`` drives torch.cuda; tests on a CPU use a fake
(tests/engine/fake_graphs.py) that records the captured operators on their tensors and replays those,
not the function, so an input the runner does not refill in place goes stale there as it does here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)


class GraphBackend(Protocol):
    def new_graph(self) -> Any: ...

    def capture(self, graph: Any, pool: Any, fn: Callable[[], None]) -> None:
        """Record ``fn``'s device work into ``graph``, allocating from ``pool`` (None: a new pool)."""

    def pool(self, graph: Any) -> Any: ...

    def synchronize(self) -> None: ...

    def memory_reserved(self) -> int: ...


class CudaGraphBackend:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def capture(self, graph: torch.cuda.CUDAGraph, pool: Any, fn: Callable[[], None]) -> None:
        with torch.cuda.graph(graph, pool=pool):
            fn()

    def pool(self, graph: torch.cuda.CUDAGraph) -> Any:
        return graph.pool()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)


@dataclass(frozen=True)
class CaptureStats:
    buckets: tuple[int, ...]
    seconds: float
    memory_bytes: int  # device memory the allocator reserved during capture (graph pool and warm-ups)

    def summary(self) -> str:
        """One line for logs and worker status."""
        sizes = f"batch {min(self.buckets)}-{max(self.buckets)}"
        mib = self.memory_bytes / (1 << 20)
        return f"{len(self.buckets)} graphs ({sizes}), captured in {self.seconds:.2f} s, {mib:.1f} MiB"


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[int], torch.Tensor],
        buckets: tuple[int, ...],
        hidden: torch.Tensor,
        backend: GraphBackend,
    ) -> None:
        """``hidden``: a persistent [max(buckets), hidden_size] buffer that every graph writes into."""
        self.forward = forward
        self.buckets = tuple(sorted(buckets, reverse=True))
        self.hidden = hidden
        self.backend = backend
        self.graphs: dict[int, Any] = {}
        self.stats: CaptureStats | None = None

    def capture(self) -> CaptureStats:
        self.backend.synchronize()
        start, reserved = time.perf_counter(), self.backend.memory_reserved()
        pool = None
        for bucket in self.buckets:
            self._run(bucket)  # warm-up: lazy initialisation and kernel selection happen outside the capture
            graph = self.backend.new_graph()
            self.backend.capture(graph, pool, lambda b=bucket: self._run(b))
            if pool is None:
                pool = self.backend.pool(graph)
            self.graphs[bucket] = graph
        self.backend.synchronize()
        elapsed = time.perf_counter() - start
        self.stats = CaptureStats(tuple(sorted(self.buckets)), elapsed, self.backend.memory_reserved() - reserved)
        log.info("decode CUDA graphs: %s", self.stats.summary())
        return self.stats

    def _run(self, bucket: int) -> None:
        self.hidden[:bucket].copy_(self.forward(bucket))

    def replay(self, bucket: int) -> torch.Tensor:
        """The forward of ``bucket`` on the current buffers: hidden states [bucket, hidden_size]."""
        self.graphs[bucket].replay()
        return self.hidden[:bucket]
