"""The bench's timeline without a deployment: two readings make the run's breakdown, the table shows it, and
a server without metrics is told apart (tests/bench/test_bench_serving.py runs it against a deployment)."""

from __future__ import annotations

import pytest

from splitserve.bench.timeline import (
    PHASE_ORDER,
    Endpoints,
    Reading,
    TimelineUnavailable,
    WorkerReading,
    breakdown,
    format_timeline,
)
from splitserve.v1 import splitserve_pb2 as pb
from splitserve.worker_common.loop_clock import PHASES


def make_reading(at: float, run: float, idle: float, relay_s: float, tokens: int, **workers) -> Reading:
    phases = dict.fromkeys(PHASES, 0.01) | {"run": run, "idle": idle}
    readings = {"decode-0": WorkerReading("decode-0", "decode", at, phases)}
    readings |= {worker_id: WorkerReading(worker_id, role, at, p) for worker_id, (role, p) in workers.items()}
    return Reading(relay_s, tokens, readings)


def test_the_table_orders_every_phase_a_worker_books():
    assert sorted(PHASE_ORDER) == sorted(PHASES) and PHASE_ORDER[0] == "run" and PHASE_ORDER[-1] == "idle"


def test_two_readings_make_the_runs_breakdown():
    before = make_reading(100.0, run=1.0, idle=5.0, relay_s=0.001, tokens=10)
    after = make_reading(104.0, run=3.0, idle=6.9, relay_s=0.003, tokens=110)
    timeline = breakdown(before, after)
    (worker,) = timeline["workers"]
    assert (worker["worker_id"], worker["role"], worker["wall_s"]) == ("decode-0", "decode", 4.0)
    assert list(worker["phases_s"]) == list(PHASE_ORDER)
    assert worker["phases_s"]["run"] == pytest.approx(2.0) and worker["phases_s"]["idle"] == pytest.approx(1.9)
    assert worker["phases_s"]["stream"] == 0.0
    assert worker["sum_s"] == pytest.approx(3.9) and worker["diff_s"] == pytest.approx(-0.1)
    assert timeline["router"] == {
        "relayed_tokens": 100,
        "relay_s": pytest.approx(0.002),
        "relay_us_per_token": pytest.approx(20.0),
    }
    table = format_timeline(timeline)
    rows = {line.split(":")[0].strip(): line.split(":")[1].split() for line in table.splitlines() if ":" in line}
    assert rows["Wall clock"] == ["4.000"]
    assert rows["run (model)"] == ["2.000", "50.0%"] and rows["idle"] == ["1.900", "47.5%"]
    assert rows["Sum - wall clock"] == ["-0.100", "-2.5%"]
    assert rows["Busy (all but idle)"] == ["2.000", "50.0%"] and rows["Model (run) of busy"] == ["100.0%"]
    assert rows["Relay cost per token (us)"] == ["20.00"] and rows["Relayed tokens"] == ["100"]


def test_a_worker_restarted_or_new_during_the_run_is_left_out():
    restarted = dict.fromkeys(PHASES, 0.0)
    before = make_reading(0.0, run=1.0, idle=1.0, relay_s=0.0, tokens=0, **{"prefill-0": ("prefill", {"run": 9.0})})
    after = make_reading(
        2.0,
        run=1.5,
        idle=2.0,
        relay_s=0.0,
        tokens=0,
        **{"prefill-0": ("prefill", restarted)},
        **{"prefill-1": ("prefill", restarted)},
    )
    timeline = breakdown(before, after)
    assert [w["worker_id"] for w in timeline["workers"]] == ["decode-0"]
    assert timeline["router"]["relay_us_per_token"] == 0.0  # no token relayed: no division by zero


def test_workers_in_role_order_and_without_any_a_line_says_so():
    phases = dict.fromkeys(PHASES, 1.0)
    workers = {"prefill-0": ("prefill", phases), "colocated-0": ("colocated", phases)}
    timeline = breakdown(make_reading(0.0, 1.0, 1.0, 0.0, 0, **workers), make_reading(1.0, 2.0, 1.0, 0.0, 0, **workers))
    assert [w["worker_id"] for w in timeline["workers"]] == ["prefill-0", "decode-0", "colocated-0"]
    assert "No worker reported" in format_timeline({"workers": [], "router": timeline["router"]})


def test_a_deployment_without_metrics_has_no_endpoints():
    with pytest.raises(TimelineUnavailable, match="--metrics-port"):
        Endpoints.of_status(pb.GetStatusResponse(model="tiny"))
    status = pb.GetStatusResponse(metrics_address="127.0.0.1:1")
    status.workers.add(worker_id="decode-0", role="decode", metrics_address="")
    with pytest.raises(TimelineUnavailable, match="no worker serves metrics"):
        Endpoints.of_status(status)
    status.workers.add(worker_id="prefill-0", role="prefill", metrics_address="127.0.0.1:2")
    assert Endpoints.of_status(status) == Endpoints("127.0.0.1:1", {"prefill-0": ("prefill", "127.0.0.1:2")})


def test_an_endpoint_that_does_not_answer_is_unavailable():
    endpoints = Endpoints("127.0.0.1:1", {})  # port 1: nothing listens
    with pytest.raises(TimelineUnavailable, match="cannot read http://127.0.0.1:1/metrics"):
        endpoints.read()
