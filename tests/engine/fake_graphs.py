"""A CUDA-graph backend for the CPU (``engine.runner.cuda_graphs.GraphBackend``) that replays what it recorded.

A real CUDA graph records, at capture, every kernel the captured function launches with the addresses of
its arguments; a replay runs those kernels again on those addresses, and no Python runs. So a replay
sees a buffer only if the runner refilled the very tensor the capture read: a tensor put in its place
afterwards, a Python value changed since, or an input the runner computes per step outside the buffers
is not seen, and the step decodes on stale inputs.

The fake does the same with torch's own operators: ``capture`` runs the function once under a
``TorchDispatchMode`` that records every aten operator with the tensors it took and returned; ``replay``
runs those operators again on those same tensors, writing each result into the tensor the capture
returned (an operator that wrote in place, or returned a view, writes or aliases that tensor itself).
Nothing of the runner's Python runs at replay. A host read during capture (``.item()``, ``.tolist()``),
which a CUDA capture refuses, is refused here too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Operators that read a device value on the host: a CUDA graph capture fails on them.
HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise RuntimeError(f"{func}: a host read of a device value, which a CUDA graph capture cannot hold")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]))
        return out


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.storage_offset() == b.storage_offset()


class FakeGraph:
    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict, list[torch.Tensor]]] = []
        self.replays = 0

    def record(self, fn: Callable[[], None]) -> None:
        recorder = _Recorder()
        with recorder:
            fn()
        self.ops = recorder.ops

    def replay(self) -> None:
        """The recorded operators again, on the tensors the capture saw (their contents now)."""
        self.replays += 1
        for func, args, kwargs, recorded in self.ops:
            fresh = [t for t in tree_leaves(func(*args, **kwargs)) if isinstance(t, torch.Tensor)]
            for into, value in zip(recorded, fresh, strict=True):
                if not _same_memory(into, value):  # a new tensor: the capture's output address gets it
                    into.copy_(value)


class FakeGraphBackend:
    """Capture records the function's operators on its tensors; replay reruns those, not the function."""

    def __init__(self) -> None:
        self.captured: list[tuple[FakeGraph, object]] = []
        self.reserved = 0

    def new_graph(self) -> FakeGraph:
        return FakeGraph()

    def capture(self, graph: FakeGraph, pool, fn) -> None:
        graph.record(fn)
        self.captured.append((graph, pool))
        self.reserved += 3 << 20

    def pool(self, graph: FakeGraph) -> object:
        return ("pool of", graph)

    def synchronize(self) -> None:
        pass

    def memory_reserved(self) -> int:
        return self.reserved
