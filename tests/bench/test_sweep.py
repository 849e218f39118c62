"""The sweep's goodput on hand-made attainment curves, its files and plots (with a stand-in for the
server: the end-to-end test runs a real sweep)."""

from __future__ import annotations

import json

import pytest

from splitserve.bench import sweep as sweep_module
from splitserve.bench.datasets import BenchRequest
from splitserve.bench.runner import BenchConfig
from splitserve.bench.sweep import describe_goodput, goodput_rate, parse_rates, run_sweep, slo_attainment

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_goodput_is_interpolated_where_attainment_crosses_the_target():
    # Meets 90% up to 4 req/s, 70% at 8: the line from (4, 0.95) to (8, 0.70) crosses 0.9 at 4.8.
    g = goodput_rate([1, 2, 4, 8], [1.0, 0.98, 0.95, 0.70], 0.9)
    assert g["status"] == "interpolated" and g["rate"] == pytest.approx(4.8) and g["between"] == [4, 8]
    assert goodput_rate([1, 2], [0.9, 0.5], 0.9)["rate"] == pytest.approx(1.0)  # exactly at the target
    # Not monotone: the highest rate that meets the target counts.
    assert goodput_rate([1, 2, 4, 8], [0.95, 0.85, 0.92, 0.52], 0.9)["rate"] == pytest.approx(4 + 0.02 / 0.4 * 4)
    assert goodput_rate([1, 2, 4], [0.99, 0.8, 0.6], 0.75)["rate"] == pytest.approx(2 + 0.05 / 0.2 * 2)


def test_goodput_outside_the_measured_range_says_so():
    below = goodput_rate([2, 4], [0.5, 0.1], 0.9)
    assert below == {"rate": 0.0, "status": "below_range", "between": [0.0, 2]}
    assert "below 2 req/s" in describe_goodput(below, 0.9)
    above = goodput_rate([2, 4], [1.0, 0.95], 0.9)
    assert above["status"] == "at_least" and above["rate"] == 4
    assert ">= 4 req/s" in describe_goodput(above, 0.9)


def test_attainment_counts_failed_requests_as_missing():
    assert slo_attainment({"good_requests": 9, "num_prompts": 12}) == 0.75
    assert slo_attainment({"good_requests": None, "num_prompts": 12}) == 0.0


def test_parse_rates():
    assert parse_rates("4, 1,2,2") == [1.0, 2.0, 4.0]
    for bad in ("", "1,x", "0,1", "1,inf"):
        with pytest.raises(ValueError, match="--rates"):
            parse_rates(bad)


def fake_benchmark(requests, offsets, config, model_id="", dataset=""):
    """Latency grows with the rate; above 3 req/s half the requests miss the SLOs."""
    rate = config.request_rate
    n = len(requests)
    result = {
        "request_rate": rate,
        "num_prompts": n,
        "good_requests": n if rate <= 3 else n // 2,
        "goodput_slos_ms": dict(config.goodput),
        "failed": 0,
        "ttfts": [0.1] * n,
    }
    for key in ("ttft", "tpot", "itl", "e2el", "client_queue"):
        result |= {
            f"{s}_{key}_ms": 10.0 * rate * (i + 1) for i, s in enumerate(("mean", "median", "std", "p90", "p99"))
        }
    return result


def test_sweep_writes_its_results_and_png_plots(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep_module, "benchmark", fake_benchmark)
    monkeypatch.setattr(sweep_module, "format_summary", lambda result, percentiles: "table")
    asked = []

    def requests(i):  # fresh prompts per rate
        asked.append(i)
        return [BenchRequest([5, 6, 7 + i], 4)] * 10

    config = BenchConfig(goodput={"ttft": 100.0, "tpot": 20.0}, progress=False)
    sweep = run_sweep(requests, config, [1, 2, 4], 0.9, tmp_path / "out")
    assert asked == [0, 1, 2]
    assert [r["slo_attainment"] for r in sweep["results"]] == [1.0, 1.0, 0.5]
    assert sweep["goodput"]["status"] == "interpolated" and sweep["goodput"]["rate"] == pytest.approx(2 + 0.1 / 0.5 * 2)
    assert "ttfts" not in sweep["results"][0]  # the per-request lists stay in rate_<R>.json
    saved = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert saved["goodput"]["rate"] == sweep["goodput"]["rate"] and saved["slos_ms"] == {"ttft": 100.0, "tpot": 20.0}
    assert json.loads((tmp_path / "out" / "rate_4.json").read_text())["ttfts"] == [0.1] * 10
    assert sorted(saved["plots"]) == ["attainment.png", "tpot.png", "ttft.png"]
    for name in saved["plots"]:
        assert (tmp_path / "out" / name).read_bytes()[:8] == PNG_MAGIC


def test_sweep_needs_slos_and_a_sane_target(tmp_path):
    with pytest.raises(ValueError, match="--goodput"):
        run_sweep(lambda i: [BenchRequest([1], 1)], BenchConfig(), [1.0], 0.9, tmp_path)
    with pytest.raises(ValueError, match="--attainment"):
        run_sweep(lambda i: [BenchRequest([1], 1)], BenchConfig(goodput={"ttft": 1.0}), [1.0], 1.5, tmp_path)
