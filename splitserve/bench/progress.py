"""The benchmark's progress line and its timed run, shared by both backends."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Iterable


class Progress:
    """A one-line progress bar on stderr, redrawn at most every 0.2 s."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30) -> None:
        self.total, self.enabled, self.width = total, enabled, width
        self.done = self.failed = 0
        self.start = self.drawn = time.monotonic()

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        now = time.monotonic()
        if self.enabled and (now - self.drawn >= 0.2 or self.done == self.total):
            self.drawn = now
            filled = self.width * self.done // max(self.total, 1)
            failed = f", {self.failed} failed" if self.failed else ""
            sys.stderr.write(
                f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} requests"
                f"{failed}, {now - self.start:.1f}s"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            sys.stderr.write("\n")
            sys.stderr.flush()


async def run_timed(
    sends: Callable[[float], Iterable[Awaitable[object]]], progress: Progress, start_at: float | None = None
) -> float:
    """Run every request at once, each told the common start (``time.perf_counter``), and return the wall
    time from that start until the last one ended; the progress line is closed either way.

    The start is now, or ``start_at``: an instant of this process's ``time.time()`` (a load client on Ray
    gets the driver's start in its own clock, ``splitserve.bench.ray_clients``); each request then waits
    until it is due after it."""
    start = time.perf_counter()
    if start_at is not None:
        start += start_at - time.time()
    try:
        await asyncio.gather(*sends(start))
    finally:
        progress.close()
    return time.perf_counter() - start
