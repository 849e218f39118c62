"""scripts/bench_tp.py end to end on the tiny preset with the smallest arguments: real TP 1 and TP 2
processes, the JSON object's keys, every figure positive, and the core plan."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_tp.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_tp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cores_are_split_one_per_rank_and_two_for_tp1():
    bench = load_script()
    assert bench.core_plan([3, 5, 7], 1) == [[3, 5]]
    assert bench.core_plan([3, 5, 7], 2) == [[3], [5]]
    assert bench.core_plan([0], 2) == [[], []]  # one usable core: nothing to pin apart


def test_tiny_preset_reports_every_figure(tmp_path: Path, tiny_model_dir: Path):
    (tmp_path / "tiny").symlink_to(tiny_model_dir)  # the script reads DIR/PRESET
    args = ["--presets", "tiny", "--models-dir", str(tmp_path), "--prompt-len", "32", "--decode-prompt-len", "8"]
    args += ["--new-tokens", "4", "--decode-batches", "1,2", "--repeats", "1", "--timeout", "90", "--json"]
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    assert out.stderr.startswith("cpu: ")  # the machine header comes first (stderr: stdout carries JSON)
    lines = out.stdout.strip().splitlines()
    assert any("TP2/TP1" in line for line in lines)  # the table
    result = json.loads(lines[-1])
    assert result["dtype"] == "float32" and result["prompt_len"] == 32 and result["decode_batches"] == [1, 2]
    assert {"machine", "cores", "presets"} <= set(result)
    tiny = result["presets"]["tiny"]
    assert set(tiny) == {"tp1", "tp2", "ratio", "all_reduce_share"}
    speeds = {"prefill_tok_s", "decode_b1_tok_s", "decode_b2_tok_s"}
    assert set(tiny["tp1"]) == set(tiny["tp2"]) == set(tiny["ratio"]) == speeds
    assert set(tiny["all_reduce_share"]) == {"prefill", "decode_b1", "decode_b2", "all_reduce_calls_per_step"}
    figures = [v for part in tiny.values() for v in part.values()]
    assert all(v > 0 for v in figures), tiny
    assert all(0 < tiny["all_reduce_share"][k] < 1 for k in ("prefill", "decode_b1", "decode_b2"))
    # Two all-reduces per layer (attention output, MLP output): the tiny preset has 2 layers.
    assert tiny["all_reduce_share"]["all_reduce_calls_per_step"] == 4
