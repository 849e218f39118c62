"""Where a worker's loop thread spends its wall clock: every second in exactly one phase.

The clock is always in one phase; ``enter`` closes the phase in progress (adds its time since the last
switch) and opens the next, so the phases add up to the time since ``start`` by construction, and what
nobody named shows up as the phase it fell into, never as a gap::

    commands ─▶ stream ─▶ schedule ─▶ stream ─▶ run ─▶ apply ─▶ stream ─▶ … ─▶ idle ─▶ commands …
                             └ lock_wait ┘             └ lock_wait ┘

* ``commands``: the loop handles its inbox (adds, cancels, admissions, drains).
* ``schedule``: the engine picks the step's work (``Engine.schedule``), lock wait excluded.
* ``run``: the model: forward and sampling, the part of ``Engine.run`` outside the lock (the layer hook that
  queues a prefill's KV layer groups runs inside the forward, so it counts here).
* ``apply``: the engine applies the sampled tokens to its scheduler, under the lock.
* ``stream``: the rest of the worker's ``step``: turning results into the requests' events, starting and
  committing KV transfers, publishing prefix-cache events.
* ``lock_wait``: the loop thread waits for the worker's lock, held by a handler thread or a transfer
  callback (``TimedLock``); booked whichever phase asked for the lock.
* ``idle``: nothing to do: waiting for a command or a wake-up.
* ``other``: the loop's start, a tensor-parallel rank 0's idle keep-alive, failing requests after an error,
  and a test deployment's fault-point delays (``Faults``).

Only the loop thread enters phases (``enter`` ignores other threads); a scrape reads the totals from another
thread (``seconds``), the phase in progress included, under a small lock so that the counters never go back.
"""

from __future__ import annotations

import threading
import time
from typing import Literal

Phase = Literal["commands", "schedule", "run", "apply", "stream", "lock_wait", "idle", "other"]
PHASES: tuple[Phase, ...] = ("commands", "schedule", "run", "apply", "stream", "lock_wait", "idle", "other")


class LoopClock:
    """The loop thread's phases (``PHASES``), as seconds since ``start``."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()  # a scrape reads a consistent total; held for a few float additions
        self._closed: dict[Phase, float] = dict.fromkeys(PHASES, 0.0)
        self._phase: Phase = "other"
        self._since = time.perf_counter()
        self.thread: int | None = None  # the loop thread's ident, once started

    def start(self) -> None:
        """The calling thread is the loop: its phases count from now (in ``other`` until it enters one)."""
        with self._mutex:
            self._closed = dict.fromkeys(PHASES, 0.0)
            self._phase, self._since = "other", time.perf_counter()
            self.thread = threading.get_ident()

    def enter(self, phase: Phase) -> Phase:
        """Close the phase in progress and open ``phase``; returns the one closed (to go back to it). A no-op
        on any other thread than the loop's (an engine stepped by a test or a tool, a clock not started)."""
        if threading.get_ident() != self.thread:
            return phase
        with self._mutex:
            now = time.perf_counter()
            previous = self._phase
            self._closed[previous] += now - self._since
            self._phase, self._since = phase, now
        return previous

    @property
    def phase(self) -> Phase:
        return self._phase

    def seconds(self) -> dict[Phase, float]:
        """Each phase's seconds so far, the one in progress up to now (any thread)."""
        with self._mutex:
            totals = dict(self._closed)
            totals[self._phase] += time.perf_counter() - self._since
        return totals


class TimedLock:
    """The worker's lock: a reentrant lock whose waits on the loop thread are booked to ``lock_wait``.

    An uncontended acquire (or a reentrant one) takes the lock at once and books nothing; only a wait is timed,
    and only the loop thread's (handler threads' waits are not the loop's time)."""

    def __init__(self, clock: LoopClock) -> None:
        self._lock = threading.RLock()
        self._clock = clock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        if threading.get_ident() != self._clock.thread:
            return self._lock.acquire(timeout=timeout)
        previous = self._clock.enter("lock_wait")
        try:
            return self._lock.acquire(timeout=timeout)
        finally:
            self._clock.enter(previous)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self._lock.release()
