"""``scripts/bench_disagg.py --compare affinity``'s ratios: pinned over unpinned, rate by rate."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("bench_disagg_script", ROOT / "scripts" / "bench_disagg.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_row(rate: float, ttft: float, tpot: float, tok_s: float) -> dict:
    return {
        "request_rate": rate,
        "median_ttft_ms": ttft,
        "p90_ttft_ms": 2 * ttft,
        "median_tpot_ms": tpot,
        "p90_tpot_ms": 2 * tpot,
        "output_throughput": tok_s,
    }


def test_ratios_per_rate_over_the_unpinned_run():
    bench = load_script()
    pinned = [make_row(1, 100, 10, 300), make_row(2, 150, 0, 500), make_row(4, 1, 1, 1)]
    unpinned = [make_row(1, 200, 20, 200), make_row(2, 100, 0, 400)]
    ratios = bench.rate_ratios(pinned, unpinned)
    assert [r["request_rate"] for r in ratios] == [1, 2]  # a rate only one run reached is left out
    assert (
        ratios[0]["median_ttft_ms"] == 0.5 and ratios[0]["p90_tpot_ms"] == 0.5 and ratios[0]["output_throughput"] == 1.5
    )
    assert ratios[1]["median_ttft_ms"] == 1.5 and math.isnan(ratios[1]["median_tpot_ms"])
