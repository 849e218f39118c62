"""Profiles from published figures (splitserve/planning/roofline.py), and ``splitserve simulate --rates``:
the roofline's steps against the worked example of an 8B model on one H200 (datasheet peaks, every
fraction 1), the refusal of a TP size the weights do not fit, and a simulated sweep written as ``bench
sweep`` writes one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.deploy.profile import StepShape
from splitserve.planning.roofline import DEVICES, SHAPES, roofline_profile

PEAK = {"mfu": 1.0, "mbu": 1.0, "host_step_s": 0.0}


def test_the_roofline_of_llama_8b_on_one_h200():
    profile = roofline_profile(SHAPES["llama3.1-8b"], DEVICES["h200"], 1, **PEAK)
    # decode, batch 1, 1k context: every weight and the context's KV read once, 3.16 ms at 4.8 TB/s
    decode = profile.step_s(StepShape.of((), [1024]))
    assert decode == pytest.approx(3.16e-3, rel=0.02)
    # prefill of 2,048 tokens: 29.7 TFLOP at 989 TFLOP/s, plus one read of the weights (3.1 ms)
    prefill = profile.step_s(StepShape.of([(0, 2048)]))
    assert prefill == pytest.approx(29.7e12 / 989e12 + 3.13e-3, rel=0.03)
    assert profile.source.startswith("roofline of published figures, not measured")
    # Every part says it is not measured; the transfer is there, from the NIC's published bandwidth.
    assert all(label.endswith("not measured") for label in profile.parts.values()), profile.parts
    assert profile.transfer.bytes_per_s == DEVICES["h200"].network_bytes_per_s
    assert profile.notes["kv_cache_bytes"] == pytest.approx(0.9 * 141e9 - (6.98e9 + 2 * 0.525e9) * 2, rel=0.01)


def test_tensor_parallelism_divides_the_work_and_adds_all_reduces():
    one, four = (roofline_profile(SHAPES["llama3.1-70b"], DEVICES["h200"], t) for t in (2, 4))
    c1, c4 = one.step_coefficients, four.step_coefficients
    assert c4["decode_context"] == pytest.approx(c1["decode_context"] / 2)
    assert c1["prefill_tokens"] / 2 < c4["prefill_tokens"] < c1["prefill_tokens"], "the all-reduce's bytes"
    assert four.notes["kv_cache_bytes"] > one.notes["kv_cache_bytes"]
    with pytest.raises(ValueError, match="^tensor_parallel_size: Llama-3.1-70B .* does not fit on 1 x"):
        roofline_profile(SHAPES["llama3.1-70b"], DEVICES["h200"], 1)


def test_a_simulated_sweep_reads_as_a_measured_one(tmp_path):
    profile = Path(__file__).parent / "data" / "tiny-profile.json"
    cli = [sys.executable, "-m", "splitserve.cli", "simulate", "--profile", str(profile), "--dataset", "chat"]
    out = subprocess.run(
        [*cli, "--num-prompts", "40", "--rates", "2,400", "--goodput", "ttft:100", "tpot:10"]
        + ["--plot-dir", str(tmp_path), "--save-result", str(tmp_path / "sweep.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "goodput: " in out.stdout and out.stdout.count("rate ") == 2
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["request_rate"] for r in saved["results"]] == [2.0, 400.0]
    low, high = (r["slo_attainment"] for r in saved["results"])
    # Strict, and with the high rate's share inside (0, 1): equal attainments (both 0 or both 1) would pass
    # a ">=" and say nothing. The target (0.9) lies between the two, so the goodput rate is interpolated.
    assert 0.9 <= low <= 1.0 and 0.0 < high < 0.9 and high < low, (low, high)
    assert saved["goodput"]["status"] == "interpolated" and 2.0 < saved["goodput"]["rate"] < 400.0, saved["goodput"]
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["attainment.png", "tpot.png", "ttft.png"]
