"""A receiver's close ends its pairs' lane threads, not only their groups: a lane thread left inside a gloo
call when the interpreter exits ends the process with std::terminate ("terminate called without an active
exception"), which is how scripts/gpu_check.sh's in-process profile once ended."""

import subprocess
import sys
import threading

from splitserve.planning.measure import Grid, ModelShape, measure_transfers

SHAPE = ModelShape("t", "llama", 2, 64, 4, 2, 16, 128, 256)


def test_close_leaves_no_lane_thread_running():
    samples, _ = measure_transfers(SHAPE, "float32", 16, Grid().scaled(0.3), "cpu", in_process=True)
    assert samples
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kv-")]


def test_a_process_that_measured_in_process_exits_cleanly():
    script = (
        "from splitserve.planning.measure import Grid, ModelShape, measure_transfers\n"
        "measure_transfers(ModelShape('t', 'llama', 2, 64, 4, 2, 16, 128, 256), 'float32', 16,"
        " Grid().scaled(0.3), 'cpu', in_process=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-2000:]
