"""Metrics, the request timeline, JSON logs and `splitserve status` against one served deployment
(`metrics_port: 0`, `log_format: json`): the router's and every worker's /metrics scraped over HTTP
agree with the timings and usage the clients received, and with each other."""

from __future__ import annotations

import json
import math
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from splitserve import cli
from splitserve.client.grpc_client import Client
from splitserve.worker_common.loop_clock import PHASES
from tests.observability.capture import json_log_lines
from tests.observability.scrape import Scrape, loop_phases, timed_worker_scrapes
from tests.serving.conftest import start_deployment, wait_for


@pytest.fixture(scope="module")
def served(ray_session, serving_model):
    deployment = start_deployment(serving_model, metrics_port=0, log_format="json")
    yield deployment
    deployment.stop()


@pytest.fixture()
def router_json_lines():
    """The router's log lines, as its JSON handler writes them (this process runs the router)."""
    with json_log_lines("splitserve") as lines:
        yield lines


def router_metrics(deployment) -> Scrape:
    return Scrape.http(deployment.router.metrics_address)


def worker_metrics(deployment) -> dict[str, Scrape]:
    with Client(deployment.address) as client:
        return {w.worker_id: Scrape.http(w.metrics_address) for w in client.status().workers}


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


def test_metrics_match_the_timings_clients_received(served, router_json_lines):
    router_before, workers_before = router_metrics(served), worker_metrics(served)
    shared = list(range(100, 140))  # two full blocks of 16: the second request reuses them
    with Client(served.address) as client:
        results = [client.generate(token_ids=shared, max_tokens=6, temperature=0.0, ignore_eos=True)]
        with ThreadPoolExecutor(6) as pool:
            jobs = [([7 * i + j for j in range(3 + 5 * i)], 1 if i < 2 else 8) for i in range(6)]
            results += list(
                pool.map(
                    lambda job: client.generate(token_ids=job[0], max_tokens=job[1], ignore_eos=True, seed=1), jobs
                )
            )
        results.append(client.generate(token_ids=shared + [5], max_tokens=4, temperature=0.0, ignore_eos=True))
    n = len(results)
    assert results[-1].cached_tokens >= 32 and all(r.finish_reason == "length" for r in results)

    def delta(name: str, **labels) -> float:
        return router_metrics(served).value(name, **labels) - router_before.value(name, **labels)

    wait_for(lambda: delta("splitserve_requests_total", outcome="finished", status="OK", finish_reason="length") == n)
    timings = [r.timing for r in results]
    for metric, field in [
        ("request_queue", "queue_ms"),
        ("time_to_first_token", "first_token_ms"),
        ("request_prefill", "prefill_ms"),
        ("e2e_request_latency", "total_ms"),
        ("request_decode", "decode_ms"),
    ]:
        assert delta(f"splitserve_{metric}_seconds_count") == n, metric
        assert close(delta(f"splitserve_{metric}_seconds_sum"), sum(t[field] for t in timings) / 1e3), metric
    moved = [t for r, t in zip(results, timings) if r.completion_tokens > 1]  # one-token requests move no KV
    assert delta("splitserve_kv_transfer_seconds_count") == len(moved)
    assert close(delta("splitserve_kv_transfer_seconds_sum"), sum(t["transfer_ms"] for t in moved) / 1e3)
    assert delta("splitserve_inter_token_latency_seconds_count") == sum(len(r.itl_ms) for r in results)
    assert delta("splitserve_generation_tokens_total") == sum(r.completion_tokens for r in results)
    assert delta("splitserve_prompt_tokens_total") == sum(r.prompt_tokens for r in results)
    assert delta("splitserve_prefix_cache_hit_tokens_total") == sum(r.cached_tokens for r in results)
    assert delta("splitserve_request_generation_tokens_sum") == sum(r.completion_tokens for r in results)
    kv_bytes = delta("splitserve_kv_transfer_bytes_sum")
    assert kv_bytes > 0 and delta("splitserve_kv_transfer_bytes_count") == len(moved)

    # The workers' own figures agree with the router's.
    after = worker_metrics(served)

    def worker_delta(worker_id: str, name: str, **labels) -> float:
        return after[worker_id].value(name, **labels) - workers_before[worker_id].value(name, **labels)

    assert worker_delta("prefill-0", "splitserve_engine_kv_transfers_total", direction="sent", result="done") == len(
        moved
    )
    assert worker_delta("decode-0", "splitserve_engine_kv_transfers_total", direction="received", result="done") == len(
        moved
    )
    assert worker_delta("prefill-0", "splitserve_engine_kv_transfer_bytes_total", direction="sent") == kv_bytes
    assert worker_delta("decode-0", "splitserve_engine_kv_transfer_bytes_total", direction="received") == kv_bytes
    assert worker_delta("prefill-0", "splitserve_engine_prefix_cache_hits_total") == sum(
        r.cached_tokens for r in results
    )
    assert worker_delta("prefill-0", "splitserve_engine_prefix_cache_queries_total") == sum(
        r.prompt_tokens for r in results
    )
    assert worker_delta("prefill-0", "splitserve_engine_steps_total", kind="prefill") >= 1
    assert worker_delta("decode-0", "splitserve_engine_steps_total", kind="decode") >= 1
    assert worker_delta("decode-0", "splitserve_engine_batch_requests_count") == worker_delta(
        "decode-0", "splitserve_engine_steps_total"
    )
    for worker_id, scrape in after.items():
        assert scrape.label_sets("splitserve_engine_kv_blocks_capacity") == [
            {"worker_id": worker_id, "role": worker_id.split("-")[0]}
        ]
        assert scrape.value("splitserve_engine_kv_blocks_capacity") > 0

    # One log line per request, with the figures its client received.
    lines = [line for line in router_json_lines() if line["logger"] == "splitserve.requests"]
    by_id = {line["request_id"]: line for line in lines}
    for r in results:
        line = by_id[r.request_id]
        assert line["outcome"] == "finished" and line["status"] == "OK" and line["finish_reason"] == "length"
        assert (line["prompt_tokens"], line["completion_tokens"], line["cached_tokens"]) == (
            r.prompt_tokens,
            r.completion_tokens,
            r.cached_tokens,
        )
        for field in ("queue_ms", "prefill_ms", "transfer_ms", "first_token_ms", "decode_ms", "total_ms"):
            assert line[field] == round(r.timing[field], 3), field
        assert r.request_id in line["message"] and "total_ms=" in line["message"]


def test_errors_and_cancels_are_counted_by_status(served, router_json_lines):
    before = router_metrics(served)
    with Client(served.address) as client:
        with pytest.raises(grpc.RpcError) as bad:
            client.generate(token_ids=[999_999], max_tokens=4)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stream = client.stream(token_ids=[1, 2, 3], max_tokens=3000, ignore_eos=True, request_id="cancel-me")
        next(stream)  # the first token arrived: the request is on the workers
        stream.close()  # cancels the call
        with pytest.raises(grpc.RpcError) as late:
            client.generate(token_ids=[4, 5, 6], max_tokens=3000, ignore_eos=True, request_id="too-slow", timeout_s=1.0)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    def delta(**labels) -> float:
        return router_metrics(served).value("splitserve_requests_total", **labels) - before.value(
            "splitserve_requests_total", **labels
        )

    wait_for(lambda: delta(outcome="cancelled", status="DEADLINE_EXCEEDED") == 1)
    assert delta(outcome="error", status="INVALID_ARGUMENT", finish_reason="") == 1
    assert delta(outcome="cancelled", status="CANCELLED") == 1
    lines = {line.get("request_id"): line for line in router_json_lines() if line["logger"] == "splitserve.requests"}
    assert lines["cancel-me"]["outcome"] == "cancelled" and lines["cancel-me"]["completion_tokens"] >= 1
    assert lines["too-slow"]["status"] == "DEADLINE_EXCEEDED" and lines["too-slow"]["first_token_ms"] > 0
    wait_for(lambda: all(w.kv_blocks_in_use == 0 for w in Client(served.address).status().workers))


def test_gauges_show_queue_running_and_kv_per_worker(served):
    scrape = router_metrics(served)
    assert scrape.value("splitserve_requests_waiting") == 0
    assert scrape.value("splitserve_requests_running") == 0
    for role, worker_id in [("prefill", "prefill-0"), ("decode", "decode-0")]:
        labels = {"worker_id": worker_id, "role": role}
        assert scrape.value("splitserve_worker_up", **labels) == 1
        assert scrape.value("splitserve_worker_kv_blocks_capacity", **labels) > 0
        assert scrape.value("splitserve_worker_kv_blocks_in_use", **labels) == 0
    assert scrape.value("splitserve_worker_kv_blocks_cached", role="prefill") > 0  # the prompts above
    assert scrape.value("splitserve_worker_kv_blocks_cached", role="decode") == 0  # no prefix cache there


def test_worker_loop_phases_add_up_to_its_wall_clock(served):
    """Every second of each worker's loop thread is in one phase: over a run of a few requests, the phases'
    seconds add up to the time between two scrapes, the model ran and the loop also idled."""
    first = timed_worker_scrapes(served.address)
    with Client(served.address) as client, ThreadPoolExecutor(3) as pool:
        prompts = [[11 * i + j for j in range(20 + 7 * i)] for i in range(3)]
        results = list(pool.map(lambda p: client.generate(token_ids=p, max_tokens=8, ignore_eos=True), prompts))
    assert [r.completion_tokens for r in results] == [8, 8, 8]
    time.sleep(0.5)  # idle, so that the window is long against a scrape's own time
    last = timed_worker_scrapes(served.address)
    assert set(last) == {"prefill-0", "decode-0"}
    for worker_id in last:
        wall, phases = loop_phases(first[worker_id], last[worker_id])
        assert set(phases) == set(PHASES)
        assert sum(phases.values()) == pytest.approx(wall, rel=0.05), (worker_id, wall, phases)
        assert phases["run"] > 0 and phases["idle"] > 0, (worker_id, phases)
        assert phases["schedule"] > 0 and phases["apply"] > 0 and phases["stream"] > 0, (worker_id, phases)
        assert min(phases.values()) >= 0, (worker_id, phases)


def test_router_relay_cost_counts_every_token(served):
    before = router_metrics(served)
    with Client(served.address) as client:
        result = client.generate(token_ids=list(range(30, 45)), max_tokens=12, ignore_eos=True)
    after = router_metrics(served)

    def delta(name: str) -> float:
        return after.value(name) - before.value(name)

    assert result.completion_tokens == 12
    assert delta("splitserve_router_relayed_tokens_total") == 12
    assert delta("splitserve_generation_tokens_total") == 12
    assert 0 < delta("splitserve_router_relay_seconds_total") < result.timing["total_ms"] / 1e3


def test_status_table_and_json(served, capsys):
    assert cli.main(["status", "--addr", served.address]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith(f"router {served.address}  model ") and "workers 2/2 healthy" in table[0]
    assert f"metrics {served.router.metrics_address}" in table[0]
    assert table[1].split() == [
        "WORKER",
        "ROLE",
        "NODE",
        "HEALTH",
        "RUN",
        "WAIT",
        "KV",
        "USED",
        "CACHED",
        "CPUS",
        "THREADS",
        "TP",
        "ADDRESS",
        "METRICS",
    ]
    rows = {line.split()[0]: line.split() for line in table[2:4]}  # the two worker rows; kernel lines follow
    assert {line.split(" linear kernels: ")[0] for line in table[4:]} <= set(rows)  # one per worker that reports
    assert set(rows) == {"prefill-0", "decode-0"}
    assert cli.main(["status", "--addr", served.address, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["metrics_address"] == served.router.metrics_address
    for w in status["workers"]:
        row = rows[w["worker_id"]]
        assert row[1] == w["role"] and row[3] == "ok" and row[-2] == w["address"] and row[-1] == w["metrics_address"]
        assert row[6] == f"{w['kv_blocks_in_use']}/{w['kv_blocks_total']}"
        assert (row[9], row[10], row[11]) == (w["cpus"], str(w["threads"]), "1") and w["threads"] >= 1
        assert w["tensor_parallel_size"] == 1
        assert w["metrics_address"].startswith("127.0.0.1:") and w["node_id"] and w["healthy"]


def test_worker_logs_are_json_with_their_id(served):
    """The workers' lines (in Ray's log files for their processes) are JSON objects naming the worker."""
    from splitserve.deploy import ray_adapter

    logs_dir = ray_adapter.logs_dir()
    for worker_id in ("prefill-0", "decode-0"):
        pid = served.worker_pid(worker_id)
        files = list(Path(logs_dir).glob(f"*-{pid}.err"))
        assert files, f"no log file for {worker_id} (pid {pid}) in {logs_dir}"
        lines = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.startswith("{")]
        serving = [line for line in lines if "serving on" in line["message"]]
        assert serving and all(line["worker_id"] == worker_id and line["level"] == "INFO" for line in serving)


def test_metrics_listen_on_loopback_and_close_on_stop(served):
    endpoints = [served.router.metrics_address, *(w.metrics_address for w in Client(served.address).status().workers)]
    assert len(endpoints) == 3 and all(e.startswith("127.0.0.1:") for e in endpoints)
    served.stop()
    deadline = time.monotonic() + 10
    for endpoint in endpoints:
        host, port = endpoint.rsplit(":", 1)
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
            except OSError:
                break
            assert time.monotonic() < deadline, f"{endpoint} still accepts connections after stop"
            time.sleep(0.2)
