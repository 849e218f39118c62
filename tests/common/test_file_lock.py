"""splitserve.common.file_lock: the wait ends at its deadline, and a holder that dies releases the lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from splitserve.common.file_lock import FileLockTimeout, file_lock

HOLDER = """
import sys, time
from pathlib import Path
from splitserve.common.file_lock import file_lock
with file_lock(Path(sys.argv[1]), 5.0):
    print("held", flush=True)
    time.sleep(60)
"""


def start_holder(path):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_lock_times_out_naming_what_waited(tmp_path):
    path = tmp_path / "sub" / "x.lock"
    holder = start_holder(path)
    try:
        start = time.monotonic()
        with pytest.raises(FileLockTimeout, match=r"the test's cache: another process has held .*x\.lock"):
            with file_lock(path, 0.3, "the test's cache"):
                pass
        assert 0.3 <= time.monotonic() - start < 3.0
    finally:
        holder.kill()
        holder.wait(10)


def test_a_killed_holder_releases_the_lock_at_once(tmp_path):
    path = tmp_path / "x.lock"
    holder = start_holder(path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(10)
    start = time.monotonic()
    with file_lock(path, 5.0):
        assert time.monotonic() - start < 1.0
    assert path.exists()  # the lock is the flock, not the file: the file stays


def test_the_lock_is_free_again_after_the_block_even_when_it_raised(tmp_path):
    path = tmp_path / "x.lock"
    with pytest.raises(RuntimeError, match="inside"):
        with file_lock(path, 1.0):
            raise RuntimeError("inside")
    start = time.monotonic()
    with file_lock(path, 1.0):
        assert time.monotonic() - start < 0.5
