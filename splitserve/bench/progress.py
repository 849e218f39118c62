"""The benchmark's progress line, drawn by both backends."""

from __future__ import annotations

import sys
import time


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
