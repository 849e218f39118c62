"""Metrics against hand-computed examples (vLLM's definitions), SLO parsing and the summary table."""

from __future__ import annotations

import math

import pytest

from splitserve.bench.metrics import (
    RequestRecord,
    format_summary,
    meets_slos,
    parse_goodput,
    parse_percentiles,
    per_request_lists,
    summarize,
)


def make_records() -> list[RequestRecord]:
    """Three successes (one with a single output token) and three failures, over a 2 s run."""
    a = RequestRecord(
        10,
        4,
        due_s=0.0,
        sent_s=0.0,
        ttft_s=0.1,
        itls_s=[0.02, 0.03, 0.05],
        e2el_s=0.2,
        output_len=4,
        cached_tokens=16,
        server_timing={
            "queue_ms": 1.0,
            "prefill_ms": 50.0,
            "transfer_ms": 4.0,
            "first_token_ms": 60.0,
            "decode_ms": 100.0,
            "total_ms": 170.0,
        },
    )
    b = RequestRecord(
        20,
        1,
        due_s=0.5,
        sent_s=0.75,
        ttft_s=0.3,
        e2el_s=0.3,
        output_len=1,
        server_timing={
            "queue_ms": 3.0,
            "prefill_ms": 70.0,
            "transfer_ms": 0.0,
            "first_token_ms": 80.0,
            "decode_ms": 0.0,
            "total_ms": 80.0,
        },
    )
    c = RequestRecord(5, 3, due_s=1.0, sent_s=1.0, ttft_s=0.2, itls_s=[0.1, 0.1], e2el_s=0.4, output_len=3)
    failed = [
        RequestRecord(7, 4, due_s=1.2, sent_s=1.25, error_code="UNAVAILABLE", error="UNAVAILABLE: no worker"),
        RequestRecord(7, 4, due_s=1.3, sent_s=1.3, error_code="UNAVAILABLE", error="UNAVAILABLE: no worker"),
        RequestRecord(
            7,
            4,
            due_s=1.4,
            sent_s=1.4,
            ttft_s=0.5,
            output_len=2,
            error_code="DEADLINE_EXCEEDED",
            error="DEADLINE_EXCEEDED: Deadline Exceeded",
        ),
    ]
    return [a, b, c, *failed]


def test_counts_throughputs_and_failures():
    m = summarize(make_records(), duration_s=2.0)
    assert (m["completed"], m["failed"]) == (3, 3)
    assert m["failures"] == {"UNAVAILABLE": 2, "DEADLINE_EXCEEDED": 1}
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (35, 8)  # successful requests only
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(21.5)
    assert m["total_cached_tokens"] == 16
    assert m["request_goodput"] is None and m["good_requests"] is None  # no SLOs given


def test_latency_statistics_by_hand():
    m = summarize(make_records(), duration_s=2.0, percentiles=(50, 90, 99.9))
    # TTFT of the successes: 100, 300, 200 ms.
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))  # population std, as numpy and vLLM
    assert m["p90_ttft_ms"] == pytest.approx(280)  # linear: 200 + 0.8 * 100
    assert m["p99.9_ttft_ms"] == pytest.approx(299.8)
    # TPOT: (200 - 100) / 3 and (400 - 200) / 2; the one-token request is left out.
    assert m["mean_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    assert m["p50_tpot_ms"] == m["median_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    # ITL pooled over requests: 20, 30, 50, 100, 100 ms.
    assert m["mean_itl_ms"] == pytest.approx(60) and m["median_itl_ms"] == pytest.approx(50)
    assert m["p90_itl_ms"] == pytest.approx(100)
    # E2EL: 200, 300, 400 ms.
    assert m["mean_e2el_ms"] == pytest.approx(300) and m["std_e2el_ms"] == pytest.approx(math.sqrt(20000 / 3))
    # Client queue over every request sent: 0, 250, 0, 50, 0, 0 ms.
    assert m["mean_client_queue_ms"] == pytest.approx(50) and m["p50_client_queue_ms"] == pytest.approx(0)
    # Server timing means over the successes that carry it.
    assert m["mean_server_prefill_ms"] == pytest.approx(60) and m["mean_server_transfer_ms"] == pytest.approx(2)


def test_goodput_counts_successes_within_every_slo():
    records = make_records()
    assert summarize(records, 2.0, slos={"ttft": 250, "tpot": 50})["good_requests"] == 1  # a only
    # A one-token request has TPOT 0 for goodput (vLLM): a and b meet 50 ms, c (100 ms) does not.
    m = summarize(records, 2.0, slos={"tpot": 50})
    assert m["good_requests"] == 2 and m["request_goodput"] == pytest.approx(1.0)
    assert summarize(records, 2.0, slos={"e2el": 300})["good_requests"] == 2
    assert summarize(records, 2.0, slos={"ttft": 1000, "tpot": 1000, "e2el": 1000})["good_requests"] == 3
    assert not meets_slos(records[-1], {"ttft": 1e9})  # a failure never counts


def test_empty_lists_count_as_zero():
    m = summarize([RequestRecord(5, 4, error_code="UNAVAILABLE")], duration_s=1.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0 and m["p99_tpot_ms"] == 0 and m["mean_itl_ms"] == 0


def test_per_request_lists_are_aligned_and_in_seconds():
    lists = per_request_lists(make_records())
    assert lists["input_lens"] == [10, 20, 5, 7, 7, 7]
    assert lists["output_lens"] == [4, 1, 3, 0, 0, 0]  # a failure counts no output, as in vLLM
    assert lists["ttfts"] == [0.1, 0.3, 0.2, 0.0, 0.0, 0.0]
    assert lists["tpots"][:3] == pytest.approx([0.1 / 3, 0.0, 0.1])
    assert lists["itls"][0] == [0.02, 0.03, 0.05] and lists["itls"][5] == []
    assert lists["client_queue_times"] == pytest.approx([0, 0.25, 0, 0.05, 0, 0])
    assert lists["errors"][:3] == ["", "", ""] and lists["errors"][3].startswith("UNAVAILABLE")
    assert len({len(v) for v in lists.values()}) == 1


def test_parse_goodput_and_percentiles():
    assert parse_goodput(["ttft:200", "tpot:50.5"]) == {"ttft": 200.0, "tpot": 50.5}
    assert parse_goodput([]) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:fast"], ["e2el:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    assert parse_percentiles("90,95,99") == (90, 95, 99)
    for bad in ("", "a,b", "101"):
        with pytest.raises(ValueError, match="--percentiles"):
            parse_percentiles(bad)


def test_summary_table_reads_like_vllms():
    m = summarize(make_records(), 2.0, slos={"ttft": 250}) | {"request_rate": 4.0, "max_concurrency": None}
    text = format_summary(m)
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============" and lines[-1] == "=" * 50
    assert "Successful requests:                     3" in lines
    assert any(line.startswith("Request goodput (req/s):") and line.endswith(" 1.00") for line in lines)
    assert any(line.startswith("P99 TTFT (ms):") for line in lines)
    assert any(line.startswith("  UNAVAILABLE:") and line.split()[-1] == "2" for line in lines)
    assert "Time per Output Token (excl. 1st token)" in text and "Client-side Queue Time" in text


def test_summary_names_the_client_machine_when_the_result_has_it():
    from splitserve.engine.hardware import cpu_summary, describe_machine

    m = summarize(make_records(), 2.0) | {"request_rate": 4.0, "max_concurrency": None}
    assert not any(line.startswith("Client machine:") for line in format_summary(m).splitlines())
    machine = describe_machine(probe_torch=False)
    lines = format_summary(m | {"client_machine": machine}).splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == f"{'Client machine:':<40} {cpu_summary(machine)}"
