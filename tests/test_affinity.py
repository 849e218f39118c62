"""CPU sets as people write them, and pinning a whole process (every thread, and the ones it starts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.worker_common.affinity import format_cpu_list, parse_cpu_list, parse_cpu_sets, thread_count

ROOT = Path(__file__).resolve().parent.parent


def test_cpu_lists_round_trip_as_linux_writes_them():
    assert parse_cpu_list("0-2,5") == (0, 1, 2, 5)
    assert parse_cpu_list(" 7 ") == (7,)
    assert format_cpu_list((5, 0, 1, 2)) == "0-2,5" and format_cpu_list(()) == ""
    assert format_cpu_list(parse_cpu_list("0-3,8,10-11")) == "0-3,8,10-11"


def test_one_set_for_all_replicas_or_one_per_replica():
    assert parse_cpu_sets([0, 1]) == parse_cpu_sets("0-1") == parse_cpu_sets("0,1") == ((0, 1),)
    assert parse_cpu_sets(3) == ((3,),)
    assert parse_cpu_sets("0-1|2-3") == parse_cpu_sets([[0, 1], "2-3"]) == ((0, 1), (2, 3))
    assert thread_count(None, (0, 1)) == 2 and thread_count(1, (0, 1)) == 1 and thread_count(None, None) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "not a cpu list"),
        ("1-", "not a cpu list"),
        ("a", "not a cpu list"),
        ("3-1", "runs backwards"),
        ([], "non-empty"),
        ([0, 0], "cpu 0 is listed twice"),
        ("0-2,1", "cpu 1 is listed twice"),
        ([-1], "ints >= 0"),
        ([True], "ints >= 0"),
        ([0.5], "ints >= 0"),
        ("0-1|1-2", "replicas 0 and 1 share cpu 1"),
    ],
)
def test_bad_cpu_sets_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        parse_cpu_sets(value)


PIN = """
import os, threading
from splitserve.worker_common.affinity import pin
early = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True)
early.start()  # a thread that runs before the pin moves too
pin((CPU,))
seen = []
late = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
late.start(); late.join()
tasks = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}
assert os.sched_getaffinity(0) == {CPU} and seen == [{CPU}] and all(v == {CPU} for v in tasks.values()), (tasks, seen)
assert len(tasks) >= 2
try:
    pin((MISSING,))
except ValueError as e:
    print(e)
"""


def test_pin_moves_every_thread_and_refuses_cpus_the_process_may_not_use():
    usable = sorted(os.sched_getaffinity(0))
    cpu, missing = usable[-1], max(usable) + 1
    code = PIN.replace("MISSING", str(missing)).replace("CPU", str(cpu))
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"cpus: {missing} not usable on this node") and f"may run on {cpu})" in done.stdout


def test_worker_cli_refuses_bad_cpus_before_loading_anything(capsys):
    from splitserve.decode_worker.worker import DecodeWorker
    from splitserve.worker_common.cli import main

    with pytest.raises(SystemExit):
        main("decode", DecodeWorker, ["--model", "/nowhere", "--cpus", "1-0"])
    assert "--cpus: '1-0': the range 1-0 runs backwards" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main("decode", DecodeWorker, ["--model", "/nowhere", "--cpus", "0", "--threads", "2"])
    assert "threads: 2 threads on 1 pinned cpus" in capsys.readouterr().err
