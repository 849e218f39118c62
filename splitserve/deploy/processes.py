"""Processes by pid, read from /proc (Linux): the ones a deployment started, and ending exactly those.

A pid alone can name another process once the first has exited and the kernel reuses the number, so a
process is recorded with its start time as well; every check and signal compares both.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

# How often ``wait_gone`` looks whether killed processes are gone: SIGKILLed processes go in milliseconds,
# and the whole wait is bounded by its caller's deadline (seconds).
GONE_POLL_S = 0.05

_STATE, _PPID, _START = 0, 1, 19  # fields of /proc/PID/stat after the command name: 3 (state), 4, 22


@dataclass(frozen=True)
class Process:
    pid: int
    start_ticks: int  # when it started, in clock ticks since boot


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # the command name, in parentheses, may hold spaces


def process(pid: int) -> Process | None:
    """The process running as ``pid`` now, if any."""
    fields = _stat(pid)
    return None if fields is None else Process(pid, int(fields[_START]))


def is_running(p: Process) -> bool:
    """Still the same process, and not exited (a zombie has exited; only its parent has not reaped it)."""
    fields = _stat(p.pid)
    return fields is not None and int(fields[_START]) == p.start_ticks and fields[_STATE] not in ("Z", "X")


def descendants(roots: Iterable[Process]) -> list[Process]:
    """Every process below these (children, their children, ...), from one pass over /proc."""
    children: dict[int, list[Process]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[_PPID]), []).append(Process(int(entry.name), int(fields[_START])))
    found: list[Process] = []
    todo = [p.pid for p in roots if is_running(p)]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child.pid)
    return found


def send(processes: Iterable[Process], signum: int) -> None:
    for p in processes:
        if is_running(p):
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass


def wait_gone(processes: Iterable[Process], timeout_s: float) -> list[Process]:
    """Wait until none of them runs, reaping those that are this process's children; returns those
    still running at the deadline."""
    processes = list(processes)
    deadline = time.monotonic() + timeout_s
    while True:
        for p in processes:
            try:
                os.waitpid(p.pid, os.WNOHANG)
            except ChildProcessError:  # not our child (or reaped already): its parent reaps it
                pass
        left = [p for p in processes if is_running(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(GONE_POLL_S)


def kill(processes: Iterable[Process], timeout_s: float) -> list[Process]:
    """SIGKILL them all at once; returns any still running ``timeout_s`` later."""
    processes = list(processes)
    send(processes, signal.SIGKILL)
    return wait_gone(processes, timeout_s)
