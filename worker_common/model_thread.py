"""The one thread of a worker process that runs the model: it builds the engine, then runs the loop.

Why one thread (libgomp's OpenMP teams, one per thread that ran a parallel region): ``engine.threads``. A
worker that built its engine on one thread (loading, weight packing, the linear tuner) and ran it on
another held two teams for good. Under the AVX2 caps (``scripts/as_avx2.sh``) a batch-1 decode step of the
qwen2.5-0.5b preset took 49 ms that way and 39-41 ms when one thread did both (docs/performance.md).

So a worker hands its engine's construction to this thread (``call``) and then its loop (``run``). Other
threads of the process (gRPC handlers, transfers) call ``engine.threads.serial_torch`` before any torch
work, so that what they compute runs on their own thread and never starts a team of its own.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from splitserve.engine.threads import set_torch_threads

T = TypeVar("T")

# How often a caller waiting for the model thread checks that it is still alive, and how often the idle
# thread checks whether it was closed.
POLL_S = 1.0


class ModelThread:
    """A thread that runs the calls it is given in order, then, last, a loop (``run``) until that returns."""

    def __init__(self, name: str, num_threads: int | None = None) -> None:
        """``num_threads``: torch threads of this thread (None: torch's default for a new thread)."""
        self.name, self.num_threads = name, num_threads
        self._jobs: queue.Queue[tuple[Callable[[], object], list, threading.Event] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the model thread and return what it returns (or raise what it raised)."""
        if self._closed:
            raise RuntimeError(f"{self.name}: the model thread has ended")
        box: list = []
        done = threading.Event()
        self._ensure_started()
        self._jobs.put((fn, box, done))
        while not done.wait(POLL_S):  # a thread that died without answering (it never should) is an error
            if not self._thread.is_alive():
                raise RuntimeError(f"{self.name}: the model thread ended before answering")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def run(self, loop: Callable[[], None]) -> threading.Thread:
        """Make ``loop`` the thread's last call: the thread ends when it returns. Returns the thread."""
        if self._closed:
            raise RuntimeError(f"{self.name}: the model thread has ended")
        self._closed = True
        self._ensure_started()
        self._jobs.put((loop, [], threading.Event()))
        self._jobs.put(None)
        return self._thread

    def close(self) -> None:
        """End the thread if no loop was given to it (a worker stopped before it started)."""
        if not self._closed:
            self._closed = True
            if self._thread is not None:
                self._jobs.put(None)

    def _ensure_started(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        # OpenMP's thread count is per calling thread: set it here, where the model is built and runs (a Ray
        # actor starts with OMP_NUM_THREADS=1, and a setting made on another thread does not carry over).
        if self.num_threads:
            set_torch_threads(self.num_threads)
        while True:
            try:
                job = self._jobs.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if job is None:
                return
            fn, box, done = job
            try:
                box.append((True, fn()))
            except BaseException as e:  # handed to the caller, who raises it
                box.append((False, e))
            finally:
                done.set()
