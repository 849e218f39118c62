"""scripts/bench_linear.py end to end on the small preset's shapes: the engine's row times what the tuner picks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_linear.py"


def test_without_native_bf16_the_engine_row_times_the_float32_compute_paths_the_tuner_weighs():
    """Where bf16 is not native (here: $SPLITSERVE_CPU_ISA without avx512_bf16) the engine's load times a bf16
    weight on its float32 copies too, so the benchmark's tuner must, and its "engine" row must time the path
    picked (it used to count every float32-compute path as F.linear, and to skip a shape oneDNN could not pack).
    The panel kernel is switched off so that no capped build is compiled for this test."""
    env = dict(os.environ, SPLITSERVE_CPU_ISA="avx2,fma", SPLITSERVE_CPU_GEMV="0")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "small", "--dtypes", "bfloat16", "--batches", "1,16"]
        + ["--repeats", "1", "--gemm-size", "256", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    entry = json.loads(out.stdout)["dtypes"]["bfloat16"]
    timed = [c for c in entry["tuner"] if c["times_ms"]]
    assert len(timed) == 5  # every shape of the small preset is above the tuner's untimed size
    for choice in timed:
        assert {"plain", "upcast", "fp32", "fp32-packed"} <= choice["times_ms"].keys(), choice
        assert "gemv" not in choice["times_ms"]  # switched off
    engine = {r["m"]: r["ms"] for r in entry["rows"] if r["path"] == "engine"}
    assert set(engine) == {1, 16} and all(ms > 0 for ms in engine.values())
