"""torch's thread count, per thread.

torch's OpenMP on Linux is libgomp, which keeps a team of threads for every thread that has run a parallel
region. While a process holds more of them than it has cores, libgomp cuts its spin-wait at the end of
each region to about a hundred spins before sleeping, so every region of every step pays a wake-up. So in
a worker one thread builds and runs the model (``worker_common.model_thread``), and every other thread
that may touch a tensor (gRPC handlers, KV transfer lanes) calls ``serial_torch`` first: its torch work
then runs on itself alone and never starts a team.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

log = logging.getLogger("splitserve.engine")


def set_torch_threads(n: int) -> None:
    """Give the calling thread ``n`` torch threads for good. torch copies its process-wide count into a
    thread's OpenMP setting once, at the thread's first parallel call (``get_num_threads`` is one), so the
    count is set, that first call made, and the count set again: another thread setting its own count in
    between cannot change this one's."""
    torch.set_num_threads(n)
    torch.get_num_threads()
    torch.set_num_threads(n)


def serial_torch() -> None:
    """Run the calling thread's torch work on that thread alone: for a worker's threads other than the one
    that runs the model, before their first torch operation.

    Only this thread's OpenMP setting changes (libgomp's ``omp_set_num_threads`` is per thread), after
    torch has made its once-per-thread copy of the process-wide count. ``torch.set_num_threads`` is not
    used: it also sets that process-wide count and MKL's, and a served colocated worker given it on its
    gRPC threads ran its model on one thread at 16 streams (21.7 output tok/s against 38.7). Without
    libgomp (another OpenMP runtime) this does nothing."""
    omp_set_num_threads = _libgomp_set_num_threads()
    if omp_set_num_threads is None:
        return
    torch.get_num_threads()  # torch's copy into this thread's setting, made now, not after ours
    omp_set_num_threads(1)


@functools.cache
def _libgomp_set_num_threads():
    """``omp_set_num_threads`` of the libgomp this process's torch loaded, or None."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and line.rstrip().endswith((".so", ".so.1"))}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError) as e:
            log.debug("serial_torch: %s has no omp_set_num_threads: %s", path, e)
    return None
