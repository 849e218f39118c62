"""Point-to-point byte transport for one (sender, receiver) pair, with deadlines.

- ``choose_backend`` is the one place that picks NCCL (KV on CUDA) or gloo (KV on CPU).
- ``bind_store`` / ``connect_store`` (from ``splitserve.engine.tp.distributed``) host and join the rendezvous
  ``TCPStore`` on the advertised address only.
- ``create_pair_group`` builds a 2-rank group from a ``PrefixStore`` without ``init_process_group``,
  so any number of pairs coexist in one process and workers come and go freely; the gloo device is
  built from the advertised address, never from hostname resolution.
- ``Communicator`` moves contiguous byte tensors to the pair's one peer. Every wait has a deadline:
  a dead or silent peer surfaces as ``TransferError`` within it, never as gloo's 30-minute default.
  CUDA payloads on gloo are staged through pinned host memory (gloo would hand a device pointer to TCP).
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from splitserve.engine.tp.distributed import NCCL_POLL_S, create_group, timeout_delta

# The store helpers live in the engine (its tensor-parallel group uses them too); imported here for the
# pair groups and re-exported for the sender and receiver.
from splitserve.engine.tp.distributed import bind_store as bind_store
from splitserve.engine.tp.distributed import connect_store as connect_store

Backend = Literal["gloo", "nccl"]

# A failed NCCL peer must not take the survivor down; set before any NCCL group exists.
os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # 2: abort the communicator, keep the process


class TransferError(RuntimeError):
    """The transport failed: timeout, peer gone, connection dropped. The pair's group is unusable."""


def choose_backend(device: torch.device, configured: str = "auto") -> Backend:
    if configured == "gloo":
        return "gloo"
    nccl_ok = device.type == "cuda" and dist.is_nccl_available()
    if configured == "nccl":
        if not nccl_ok:
            raise ValueError(f"backend: NCCL needs the KV cache on CUDA with NCCL available (device {device})")
        return "nccl"
    return "nccl" if nccl_ok else "gloo"


def create_pair_group(
    backend: Backend, store: dist.Store, prefix: str, rank: int, local_host: str, timeout_s: float, device: torch.device
) -> dist.ProcessGroup:
    """Build this side of a 2-rank group; blocks until the peer joins, at most ``timeout_s``."""
    if backend == "gloo":
        return create_group("gloo", store, prefix, rank, 2, local_host, timeout_s, device)
    prefixed = dist.PrefixStore(prefix, store)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout_delta(timeout_s)
    group = dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    # NCCL creates its communicator on first use: do that now, inside the setup deadline.
    probe = torch.zeros(1, device=device)
    work = group.send([probe], 1, 0) if rank == 0 else group.recv([probe], 0, 0)
    Pending(work, group, None).wait(timeout_s)
    return group


def open_communicator(
    backend: Backend, store: dist.Store, prefix: str, rank: int, local_host: str, timeout_s: float, device: torch.device
) -> Communicator:
    """The default communicator factory: a real 2-rank torch.distributed group."""
    group = create_pair_group(backend, store, prefix, rank, local_host, timeout_s, device)
    return GroupCommunicator(group, rank, backend, device)


CommunicatorFactory = Callable[[Backend, dist.Store, str, int, str, float, torch.device], "Communicator"]


class Pending:
    """An operation in flight; ``wait`` returns when it completed or raises TransferError by the deadline."""

    def __init__(self, work, group, on_done=None) -> None:
        self._work, self._group, self._on_done = work, group, on_done

    def wait(self, timeout_s: float) -> None:
        try:
            if isinstance(self._group, dist.ProcessGroupGloo):
                self._work.wait(timeout_delta(timeout_s))
            else:  # NCCL: poll, so that the deadline is ours and not the watchdog's
                deadline = time.monotonic() + timeout_s
                while not self._work.is_completed():
                    if time.monotonic() > deadline:
                        raise TransferError(f"operation did not complete within {timeout_s:.1f}s")
                    time.sleep(NCCL_POLL_S)
                self._work.wait()
        except TransferError:
            raise
        except Exception as e:  # gloo/NCCL raise RuntimeError and friends with transport details
            raise TransferError(f"{type(e).__name__}: {e}") from None
        if self._on_done is not None:
            self._on_done()


class Communicator(ABC):
    """Moves contiguous tensors to and from the pair's one peer, in posting order (one FIFO)."""

    @abstractmethod
    def isend(self, tensor: torch.Tensor) -> Pending: ...

    @abstractmethod
    def irecv(self, tensor: torch.Tensor) -> Pending: ...

    @abstractmethod
    def abort(self) -> None:
        """Make every pending and future operation fail promptly; idempotent."""


class GroupCommunicator(Communicator):
    """A torch.distributed 2-rank group (gloo or NCCL), staging CUDA tensors through pinned host
    memory on gloo and running NCCL on a dedicated stream."""

    def __init__(self, group: dist.ProcessGroup, rank: int, backend: Backend, device: torch.device) -> None:
        self.group, self.peer, self.backend, self.device = group, 1 - rank, backend, device
        self.staged = backend == "gloo" and device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if backend == "nccl" and device.type == "cuda" else None
        self._aborted = False

    def isend(self, tensor: torch.Tensor) -> Pending:
        if self.staged:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor)  # synchronous: the device data is in host memory before TCP sees it
            return Pending(self.group.send([host], self.peer, 0), self.group)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                return Pending(self.group.send([tensor], self.peer, 0), self.group)
        return Pending(self.group.send([tensor], self.peer, 0), self.group)

    def irecv(self, tensor: torch.Tensor) -> Pending:
        if self.staged:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return Pending(self.group.recv([host], self.peer, 0), self.group, on_done=lambda: tensor.copy_(host))
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                work = self.group.recv([tensor], self.peer, 0)
            return Pending(work, self.group, on_done=lambda: self.stream.synchronize())
        return Pending(self.group.recv([tensor], self.peer, 0), self.group)

    def abort(self) -> None:
        if self._aborted:
            return
        self._aborted = True
        try:
            self.group.abort()
        except Exception:  # already broken, or a backend without abort: dropping it is what counts
            pass
