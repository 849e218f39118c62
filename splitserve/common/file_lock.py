"""An exclusive lock between processes on one machine, with a deadline.

``fcntl.flock`` on a file of its own: the kernel releases it when its holder exits, killed or not, so a
process that dies holding it never blocks the next one (unlike a lock that is a file's existence, such as
torch's extension-build baton). The wait is polled and ends at ``timeout_s`` with ``FileLockTimeout``."""

from __future__ import annotations

import fcntl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

POLL_S = 0.05


class FileLockTimeout(TimeoutError):
    pass


@contextmanager
def file_lock(path: Path, timeout_s: float, what: str = "the lock") -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created with its folder) for the block; wait at most
    ``timeout_s`` seconds for another process to release it, then raise ``FileLockTimeout`` naming ``what``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    with open(path, "a") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise FileLockTimeout(
                        f"{what}: another process has held {path} for more than {timeout_s:g} s"
                    ) from None
                time.sleep(POLL_S)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
