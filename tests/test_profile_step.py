"""scripts/profile_step.py end to end on the tiny preset: its wall-clock phases are the calls a step really
makes (host prep is the plan and its tensors, not a method the step no longer calls), each takes time, and
together they account for the step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "profile_step.py"
PHASES = ("schedule", "host prep", "forward", "LM head", "sampling", "rest of execute", "update")


def test_the_phases_of_a_decode_step_cover_it(tiny_model_dir):
    # Plain kernels: no timing of the linear layers at load, which is not what this test is about.
    args = ["--model", str(tiny_model_dir), "--dtype", "float32", "--batch", "4", "--context", "16"]
    args += ["--steps", "2", "--warmup", "1", "--prefill-len", "0", "--threads", "1", "--json", "--linear-kernel=plain"]
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    (batch,) = json.loads(out.stdout)["batches"]
    phases, step = batch["phases_ms"], batch["step_ms_mean"]
    assert set(phases) == {*PHASES, "rest of the step"}
    assert all(phases[p] > 0 for p in PHASES), phases
    # The phases are timed inside the step: they cannot exceed it, and what they leave out is small.
    assert 0 <= phases["rest of the step"] < 0.5 * step, phases
    assert sum(phases.values()) == step or abs(sum(phases.values()) - step) < 1e-6 * step
    assert batch["parts_ms"]["host prep"] > 0, "the operators of the plan's tensors fall in its range"
