"""What ``scripts/sim_fidelity.py`` judges its rows and sweeps by, on hand-made runs (no server): attainment
from per-request lists (it must agree with bench's own ``good_requests``), the binding SLOs taken from a
run, the knee of a sweep and its error, the sweep's rates, and a sweep through the simulator by bench
sweep's own ``run_sweep``."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from splitserve.bench.datasets import BenchRequest
from splitserve.bench.metrics import RequestRecord, per_request_lists, summarize
from splitserve.bench.runner import BenchConfig
from splitserve.bench.sweep import run_sweep
from splitserve.planning import fidelity
from splitserve.planning.fidelity import (
    attainment,
    binding_slos,
    compare_knees,
    compare_under,
    goodput,
    knee,
    knee_error,
    relative_error,
    simulator_bench,
    sweep_rates,
)
from splitserve.planning.simulator import simulate
from tests.planning.test_simulator import disaggregated, prompt


def record(ttft_ms: float, tpot_ms: float, output_len: int = 5, error: str = "") -> RequestRecord:
    ttft = ttft_ms / 1e3
    return RequestRecord(
        10,
        output_len,
        ttft_s=0.0 if error else ttft,
        e2el_s=0.0 if error else ttft + tpot_ms / 1e3 * (output_len - 1),
        output_len=0 if error else output_len,
        error_code=error,
        error=error,
    )


def run_of(records: list[RequestRecord], duration_s: float = 10.0, slos=None) -> dict:
    """A result as bench writes it: the summary and the per-request lists."""
    return summarize(records, duration_s, (50, 90), slos) | per_request_lists(records)


# ---- attainment ---------------------------------------------------------------------------------------


def test_attainment_counts_every_request_and_agrees_with_bench():
    records = [
        record(100, 10),  # meets both
        record(100, 30),  # misses TPOT
        record(300, 10),  # misses TTFT
        record(200, 15),  # exactly at the TTFT SLO: meets
        record(150, 999, output_len=1),  # one token: TPOT 0, meets (vLLM's rule)
        record(0, 0, error="UNAVAILABLE: worker lost"),  # failed: misses
    ]
    slos = {"ttft": 200.0, "tpot": 20.0}
    run = run_of(records, 4.0, slos)
    assert attainment(run, slos) == pytest.approx(3 / 6)
    assert attainment(run, slos) * len(records) == run["good_requests"]  # bench's own count
    assert goodput(run, slos) == pytest.approx(run["request_goodput"]) == pytest.approx(3 / 4.0)
    assert attainment(run, {"ttft": 200.0}) == pytest.approx(4 / 6)
    assert attainment(run, {"ttft": 1e9, "e2el": 1e9}) == pytest.approx(5 / 6)


def test_attainment_needs_the_per_request_lists_and_an_slo():
    summary_only, _ = simulate(disaggregated(), [(prompt(10), 4)], [0.0], goodput={"ttft": 50.0})
    with pytest.raises(ValueError, match="per_request=True"):
        attainment(summary_only, {"ttft": 50.0})
    with pytest.raises(ValueError, match="^slos: "):
        attainment(run_of([record(1, 1)]), {})


def test_a_simulated_run_keeps_its_per_request_lists_when_asked():
    work = [(prompt(10, i), 4) for i in range(3)]
    result, _ = simulate(disaggregated(), work, [0.0, 0.0, 1.0], (50, 90), {"ttft": 25.0}, per_request=True)
    assert result["errors"] == ["", "", ""] and result["output_lens"] == [4, 4, 4]
    # test_simulator's step: 10 ms + 1 ms a prompt token; the first two share one, the third is alone.
    assert result["ttfts"] == pytest.approx([30e-3, 30e-3, 20e-3])
    assert attainment(result, {"ttft": 25.0}) == pytest.approx(1 / 3) and result["good_requests"] == 1


# ---- the binding SLOs ---------------------------------------------------------------------------------


def test_binding_slos_are_the_runs_percentiles_over_its_successful_requests():
    # TTFT 10, 20, ..., 100 ms: numpy's p90 of ten values lies between the 9th and the 10th, at 91 ms.
    records = [record(10 * (i + 1), 2 * (i + 1)) for i in range(10)]
    records += [record(0, 0, error="UNAVAILABLE: x"), record(5000, 999, output_len=1)]
    # The failed request counts for neither; the one-token one for TTFT only (TTFT list: 11 values).
    slos = binding_slos(run_of(records), 90)
    assert slos["tpot"] == pytest.approx(18.2)  # 2..20 ms: between 18 and 20
    assert slos["ttft"] == pytest.approx(100.0)  # 10, ..., 100, 5000: index 0.9 * 10 = 9 exactly, 100 ms
    assert binding_slos(run_of(records[:10]), 50) == {"ttft": pytest.approx(55.0), "tpot": pytest.approx(11.0)}
    # The run judged by its own p50 SLOs: at most half meet both.
    assert attainment(run_of(records[:10]), binding_slos(run_of(records[:10]), 50)) == pytest.approx(0.5)


def test_binding_slos_refuse_what_has_no_percentile():
    with pytest.raises(ValueError, match="^percentile: "):
        binding_slos(run_of([record(1, 1)]), 100)
    with pytest.raises(ValueError, match="no successful request"):
        binding_slos(run_of([record(0, 0, error="UNAVAILABLE: x")]), 90)
    with pytest.raises(ValueError, match="more than one output token"):
        binding_slos(run_of([record(5, 0, output_len=1)]), 90)


def test_rows_are_compared_in_points_of_attainment_and_relative_goodput():
    slos = {"ttft": 100.0, "tpot": 10.0}
    real = run_of([record(50, 5)] * 6 + [record(500, 5)] * 4, duration_s=10.0)  # 60%, 0.6 req/s
    sim = run_of([record(50, 5)] * 9 + [record(500, 5)], duration_s=9.0)  # 90%, 1.0 req/s
    out = compare_under(real, sim, slos)
    assert out["real_attainment"] == pytest.approx(0.6) and out["sim_attainment"] == pytest.approx(0.9)
    assert out["attainment_error_pp"] == pytest.approx(30.0)  # sim - real: positive, optimistic
    assert out["goodput_error"] == pytest.approx((1.0 - 0.6) / 0.6)
    assert compare_under(sim, real, slos)["attainment_error_pp"] == pytest.approx(-30.0)
    assert relative_error(0.0, 0.0) == 0.0 and relative_error(0.0, 1.0) is None


# ---- the knee -----------------------------------------------------------------------------------------


def test_knee_between_two_rates_is_linear():
    # 0.95 at 2 req/s, 0.75 at 4: 0.9 is a quarter of the way down, at 2.5 req/s.
    k = knee([1, 2, 4, 8], [1.0, 0.95, 0.75, 0.2], 0.9)
    assert k["status"] == "interpolated" and k["rate"] == pytest.approx(2.5) and k["between"] == [2, 4]
    assert k["text"] == "2.5"


def test_knee_at_a_rate_that_meets_the_target_exactly_is_that_rate():
    k = knee([1, 2, 4], [1.0, 0.9, 0.5], 0.9)
    assert k["rate"] == pytest.approx(2.0) and k["status"] == "interpolated"
    # At the ends of the range: the lowest rate exactly at the target is the knee; the highest is a bound.
    assert knee([1, 2], [0.9, 0.5], 0.9)["text"] == "1"
    assert knee([1, 2], [1.0, 0.9], 0.9)["text"] == "not reached (>= 2)"


def test_knee_never_crossed_is_not_reached_on_either_side():
    above = knee([1, 2, 4], [1.0, 0.97, 0.93], 0.9)
    assert above["status"] == "at_least" and above["text"] == "not reached (>= 4)"
    below = knee([1, 2, 4], [0.8, 0.6, 0.1], 0.9)
    assert below["status"] == "below_range" and below["text"] == "not reached (< 1)"
    assert knee_error(above, knee([1, 2], [1.0, 0.5], 0.9)) is None
    assert knee_error(below, below) is None


def test_knee_of_a_curve_that_is_not_monotone_is_the_highest_rate_meeting_the_target():
    # A dip at 2 req/s (noise) that recovers at 4: the crossing after 4 counts, as in bench sweep's goodput.
    k = knee([1, 2, 4, 8], [0.95, 0.85, 0.92, 0.52], 0.9)
    assert k["between"] == [4, 8] and k["rate"] == pytest.approx(4 + 0.02 / 0.40 * 4)


def test_knee_refuses_mismatched_or_unsorted_sweeps():
    with pytest.raises(ValueError, match="^attainments: "):
        knee([1, 2], [1.0], 0.9)
    with pytest.raises(ValueError, match="^rates: "):
        knee([2, 1], [1.0, 0.5], 0.9)


def test_knees_of_a_real_and_a_simulated_sweep_and_their_error():
    slos = {"ttft": 100.0, "tpot": 10.0}

    def run(good: int) -> dict:  # ten requests, `good` of them within the SLOs
        return run_of([record(50, 5)] * good + [record(500, 5)] * (10 - good))

    rates = [1.0, 2.0, 3.0]
    out = compare_knees(rates, [run(10), run(8), run(2)], [run(10), run(10), run(6)], slos, 0.9)
    assert out["real_attainments"] == pytest.approx([1.0, 0.8, 0.2])
    assert out["real_knee"]["rate"] == pytest.approx(1.5)  # 1.0 -> 0.8: 0.9 halfway
    assert out["sim_knee"]["rate"] == pytest.approx(2.25)  # 1.0 -> 0.6: a quarter of the way
    assert out["knee_error"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="^real, sim: "):
        compare_knees(rates, [run(10)], [run(10)] * 3, slos)


# ---- the sweep ----------------------------------------------------------------------------------------


def test_sweep_rates_span_the_range_of_the_capacity():
    assert sweep_rates(5.0, 5, 0.2, 1.2) == [1.0, 2.25, 3.5, 4.75, 6.0]
    assert sweep_rates(0.01, 2, 0.1, 2.0) == pytest.approx([0.01, 0.02])  # at least 0.01 req/s
    for points, low, high, field in ((1, 0.2, 1.2, "--sweep-points"), (3, 1.2, 0.2, "--sweep-range")):
        with pytest.raises(ValueError, match=f"^{field}: "):
            sweep_rates(5.0, points, low, high)
    with pytest.raises(ValueError, match="^--sweep-points: .*repeat"):
        sweep_rates(0.001, 3, 0.5, 1.0)  # every rate rounds to the 0.01 floor


def test_a_simulated_sweep_runs_through_bench_sweep(tmp_path, monkeypatch):
    # No plots (test_sweep checks them): nor matplotlib's import, which takes most of a second.
    monkeypatch.setitem(sys.modules, "splitserve.bench.plots", SimpleNamespace(plot_sweep=lambda *args: []))
    slos = {"ttft": 60.0, "tpot": 20.0}
    config = BenchConfig(goodput=slos, progress=False, seed=3)
    asked = []

    def requests(i: int) -> list[BenchRequest]:
        asked.append(i)
        return [BenchRequest(prompt(10, 10 * i + j), 4) for j in range(6)]

    kept = []

    def run(*args):
        kept.append(simulator_bench(disaggregated())(*args))
        return kept[-1]

    sweep = run_sweep(requests, config, [1.0, 50.0, 400.0], 0.9, tmp_path, "toy", run=run)
    assert asked == [0, 1, 2] and [r["request_rate"] for r in kept] == [1.0, 50.0, 400.0]
    # Each rate's attainment by bench sweep's count and by the per-request lists agree, and load hurts it.
    attained = [r["slo_attainment"] for r in sweep["results"]]
    assert attained == pytest.approx([attainment(r, slos) for r in kept])
    assert attained[0] == 1.0 and attained[-1] < attained[0]
    assert (tmp_path / "rate_400.json").is_file() and sweep["goodput"]["status"] == "interpolated"
    assert fidelity.knee([1.0, 50.0, 400.0], attained, 0.9)["rate"] == pytest.approx(sweep["goodput"]["rate"])
