"""Process groups built without ``init_process_group``, and the tensor-parallel group of a worker.

- ``bind_store`` hosts a rendezvous ``TCPStore`` on the advertised address only: a plain TCPStore
  listens on every interface whatever host it is given, so it gets a socket already bound.
  ``connect_store`` joins one. (KV transfer uses both for its pair groups.)
- ``create_group`` builds one rank of a ``size``-rank group from a ``PrefixStore``: no global default
  group, so a process may hold its TP group and any number of KV-transfer pairs at once. The gloo
  device is built from the advertised address, never from hostname resolution; NCCL creates its
  communicator with a first collective inside the setup deadline.
- ``TPGroup`` is what the model calls: in-place sum ``all_reduce`` and ``broadcast``. Every call is
  bounded by the group's timeout: a dead or silent rank raises ``CollectiveError``, never hangs for
  gloo's 30-minute default. On gloo the call waits with that deadline; on NCCL it is enqueued on the
  current stream (a host wait per layer would stall the GPU) and the communicator's own timeout, set
  at creation, aborts it.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Literal

import torch
import torch.distributed as dist

# How often a wait on NCCL work polls for completion, so that a deadline is ours and not NCCL's
# watchdog's: NCCL calls finish in microseconds to milliseconds, and a sleeping poll costs no core.
NCCL_POLL_S = 0.0005

Backend = Literal["gloo", "nccl"]

# A failed NCCL peer must not take the survivor down; set before any NCCL group exists.
os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # 2: abort the communicator, keep the process


class CollectiveError(RuntimeError):
    """A collective failed or missed its deadline (a rank died, stalled or dropped its connection).
    The group is unusable afterwards."""


def timeout_delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def bind_store(host: str, port: int = 0, timeout_s: float = 10.0) -> tuple[dist.TCPStore, int]:
    """A rendezvous store serving on ``host:port`` only (port 0: any free port); returns (store, port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    bound_port = sock.getsockname()[1]
    store = dist.TCPStore(
        host,
        bound_port,
        is_master=True,
        timeout=timeout_delta(timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
    return store, bound_port


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timeout_delta(timeout_s))


def create_group(
    backend: Backend,
    store: dist.Store,
    prefix: str,
    rank: int,
    size: int,
    local_host: str,
    timeout_s: float,
    device: torch.device,
) -> dist.ProcessGroup:
    """Build rank ``rank`` of a ``size``-rank group; blocks until every rank joined, at most ``timeout_s``."""
    if not 0 <= rank < size:
        raise ValueError(f"rank: must be 0 to {size - 1}, got {rank}")
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout_delta(timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        return dist.ProcessGroupGloo(prefixed, rank, size, opts)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout_delta(timeout_s)
    group = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    # NCCL creates its communicator on first use: do that now, inside the setup deadline.
    probe = torch.zeros(1, device=device)
    work = group.allreduce([probe])
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            group.abort()
            raise CollectiveError(f"{prefix}: NCCL group of {size} did not form within {timeout_s:.1f}s")
        time.sleep(NCCL_POLL_S)
    work.wait()
    return group


class TPGroup:
    """The ranks of one tensor-parallel worker: each holds a shard of the model and they run every
    step together. Collectives act in place on tensors of this rank's device."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, backend: Backend, timeout_s: float) -> None:
        self.group, self.rank, self.size, self.backend, self.timeout_s = group, rank, size, backend, timeout_s

    @classmethod
    def join(
        cls,
        backend: Backend,
        store: dist.Store,
        prefix: str,
        rank: int,
        size: int,
        local_host: str,
        timeout_s: float,
        setup_timeout_s: float,
        device: torch.device,
    ) -> TPGroup:
        """``create``, once every rank has reached the store (each waits at most ``setup_timeout_s``): ranks
        that start seconds apart (a process to spawn, torch to import) meet first, so that the group's own,
        short ``timeout_s`` measures only its collectives."""
        barrier = dist.PrefixStore(f"{prefix}joined/", store)
        barrier.set(str(rank), "1")
        try:
            barrier.wait([str(r) for r in range(size)], timeout_delta(setup_timeout_s))
        except Exception as e:  # the store raises its own error types on a timeout
            raise CollectiveError(
                f"{prefix}: rank {rank} of {size}: the other ranks did not join within {setup_timeout_s:.0f}s ({e})"
            ) from None
        return cls.create(backend, store, prefix, rank, size, local_host, timeout_s, device)

    @classmethod
    def create(
        cls,
        backend: Backend,
        store: dist.Store,
        prefix: str,
        rank: int,
        size: int,
        local_host: str,
        timeout_s: float,
        device: torch.device,
    ) -> TPGroup:
        group = create_group(backend, store, prefix, rank, size, local_host, timeout_s, device)
        return cls(group, rank, size, backend, timeout_s)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it. Every rank ends with the same bits."""
        self._wait(self.group.allreduce([tensor]), "all_reduce")
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s, in place; returns it."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self._wait(self.group.broadcast([tensor], opts), "broadcast")
        return tensor

    def abort(self) -> None:
        """Make pending and later collectives fail promptly (the other ranks see a closed peer)."""
        try:
            self.group.abort()
        except Exception:  # already broken, or a backend without abort: dropping it is what counts
            pass

    def _wait(self, work, op: str) -> None:
        if self.backend == "nccl":
            work.wait()  # the stream waits, not the host; the communicator's timeout bounds it
            return
        try:
            work.wait(timeout_delta(self.timeout_s))
        except Exception as e:  # gloo raises RuntimeError and friends with transport details
            raise CollectiveError(
                f"{op} on tensor-parallel rank {self.rank} of {self.size} failed within {self.timeout_s:.1f}s "
                f"(a rank died or stalled): {type(e).__name__}: {e}"
            ) from None
