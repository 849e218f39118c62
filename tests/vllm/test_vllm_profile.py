"""``splitserve profile --backend vllm``: a vllm-backend worker's steps measured as the worker takes them
(splitserve/planning/measure_vllm.py), fitted into the same profile format, and taken by ``simulate`` and
``plan`` as a splitserve engine's profile is."""

from __future__ import annotations

import json
import subprocess
import sys

CLI = [sys.executable, "-m", "splitserve.cli"]


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_profile_simulate_and_plan_a_vllm_worker(tmp_path, serving_model):
    out = tmp_path / "vllm-profile.json"
    done = run(
        "profile", "--backend", "vllm", "--model", str(serving_model), "--quick", "--threads", "1", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vllm engine" in done.stdout
    profile = json.loads(out.read_text())
    assert profile["notes"]["backend"] == "vllm"
    assert profile["notes"]["block_size"] == 128  # vLLM's CPU block, not this package's 16
    assert profile["parts"]["steps"] == "measured" and profile["transfer"] is not None
    c = profile["step_coefficients"]
    assert c["decodes"] > 0 and c["prefill_tokens"] > 0
    # Every step's shape is what vLLM scheduled: prefills with their cached context, decodes at theirs.
    shapes = profile["steps"]
    assert any(s["prefill_tokens"] > 0 and s["prefill_attention"] > s["prefill_tokens"] for s in shapes)
    assert any(s["decodes"] > 1 and s["prefill_tokens"] == 0 for s in shapes)
    assert any(s["decodes"] > 0 and s["prefill_tokens"] > 0 for s in shapes)  # the mixed steps
    sim = run(
        "simulate", "--profile", str(out), "--dataset", "chat", "--num-prompts", "10", "--request-rate", "5", "--json"
    )
    assert sim.returncode == 0, sim.stderr[-2000:]
    result = json.loads(sim.stdout.strip().splitlines()[-1])
    assert result["completed"] == 10
    plan = run(
        "plan", "--profile", str(out), "--slo", "ttft:1000", "tpot:100", "--devices", "2",
        "--dataset", "chat", "--num-prompts", "10", "--min-duration", "1", "--json",
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr[-2000:]
    rows = json.loads(plan.stdout)
    assert rows and {row["mode"] for row in rows} == {"disaggregated", "colocated"}


def test_profile_a_tensor_parallel_vllm_worker(tmp_path, serving_model):
    """``--tp 2``: rank 0's vLLM engine schedules and times the steps while rank 1 (spawned, a vLLM engine for
    its shard) runs each of them; the profile says TP 2 and the steps are measured."""
    out = tmp_path / "vllm-tp2.json"
    done = run(
        "profile", "--backend", "vllm", "--model", str(serving_model), "--quick", "--threads", "1", "--tp", "2",
        "--no-transfer", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TP 2, vllm engine" in done.stdout
    profile = json.loads(out.read_text())
    assert profile["tensor_parallel_size"] == 2 and profile["notes"]["backend"] == "vllm"
    assert profile["parts"]["steps"] == "measured" and profile["transfer"] is None
    steps = profile["steps"]  # each step timed as rank 0 ran it with rank 1 (the fit's split of them varies)
    assert any(s["decodes"] > 1 for s in steps) and any(s["prefill_tokens"] > 0 for s in steps)
    assert all(s["seconds"] > 0 for s in steps) and profile["step_coefficients"]["const"] > 0
