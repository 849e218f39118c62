"""Which cores a worker process runs on, and how many torch threads it runs there.

A cpu set is written as Linux writes it (``taskset -c``, ``Cpus_allowed_list`` in /proc/<pid>/status):
``"0-3,8"``, or in YAML as a list of ints ``[0, 1, 2, 3, 8]``. A role's ``cpus`` holds one set, which
every replica of the role shares, or one set per replica: ``"0-1|2-3"`` as vLLM's
``VLLM_CPU_OMP_THREADS_BIND`` binds one set per rank, or a list of lists ``[[0, 1], [2, 3]]``.

A process pins itself with :func:`pin` before its torch thread pool starts: every thread it has
then (Ray's and gRPC's included) moves to the set, and every thread started later inherits it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("splitserve.worker")

CpuSet = tuple[int, ...]


def parse_cpu_list(text: str) -> CpuSet:
    """``"0-2,5"`` -> ``(0, 1, 2, 5)``; refuses empty parts, reversed ranges and repeats."""
    cpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{text!r} is not a cpu list such as '0-3,8'")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"{text!r}: the range {part.strip()} runs backwards")
        cpus.extend(range(low, high + 1))
    return check_cpu_set(cpus)


def format_cpu_list(cpus) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"`` (the inverse of :func:`parse_cpu_list`); ``()`` -> ``""``."""
    parts, ordered = [], sorted(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def check_cpu_set(cpus: Any) -> CpuSet:
    """A non-empty list of distinct cpu numbers >= 0, as a tuple in the given order."""
    if isinstance(cpus, str):
        return parse_cpu_list(cpus)
    if isinstance(cpus, int) and not isinstance(cpus, bool):
        cpus = [cpus]  # `cpus: 3` in YAML
    if not isinstance(cpus, (list, tuple)) or not cpus:
        raise ValueError(f"must be a non-empty list of cpu numbers or a cpu list such as '0-3', got {cpus!r}")
    bad = [c for c in cpus if not isinstance(c, int) or isinstance(c, bool) or c < 0]
    if bad:
        raise ValueError(f"cpu numbers must be ints >= 0, got {bad[0]!r}")
    repeated = sorted({c for c in cpus if list(cpus).count(c) > 1})
    if repeated:
        raise ValueError(f"cpu {repeated[0]} is listed twice")
    return tuple(cpus)


def parse_cpu_sets(value: Any) -> tuple[CpuSet, ...]:
    """A role's ``cpus``: one set for all replicas, or one per replica ("0-1|2-3", [[0, 1], [2, 3]]).
    Sets of different replicas may not overlap (that would put two workers on one core)."""
    if isinstance(value, str):
        sets = tuple(parse_cpu_list(part) for part in value.split("|"))
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, (list, tuple, str)) for v in value):
        sets = tuple(check_cpu_set(v) for v in value)
    else:
        sets = (check_cpu_set(value),)
    for i, cpus in enumerate(sets):
        for j in range(i):
            shared = sorted(set(cpus) & set(sets[j]))
            if shared:
                raise ValueError(f"the sets of replicas {j} and {i} share cpu {shared[0]}")
    return sets


def usable_cpus() -> CpuSet:
    """The cpus this process may run on now."""
    return tuple(sorted(os.sched_getaffinity(0)))


def pin(cpus: CpuSet) -> None:
    """Confine this whole process to ``cpus``: each of its threads now, and so every thread it starts
    later. Raises ValueError naming ``cpus`` when a cpu is not one this process may use."""
    usable = set(usable_cpus())
    outside = [c for c in cpus if c not in usable]
    if outside:
        raise ValueError(
            f"cpus: {format_cpu_list(outside)} not usable on this node (pid {os.getpid()} may "
            f"run on {format_cpu_list(usable)})"
        )
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def thread_count(threads: int | None, cpus: CpuSet | None) -> int | None:
    """Torch threads for a worker: ``threads`` if given, else one per pinned cpu, else None (torch's
    default)."""
    if threads is not None:
        return threads
    return len(cpus) if cpus else None
