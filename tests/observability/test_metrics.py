"""The metrics modules without a deployment: names and types follow Prometheus' conventions, what is
observed lands where docs/metrics.md says, gauges follow the state they read, and the endpoint stops
cleanly."""

from __future__ import annotations

import socket
import urllib.request
from types import SimpleNamespace

import pytest

from splitserve.kv_transfer.handles import TransferHandle
from splitserve.observability.exporter import MetricsServer
from splitserve.router.metrics import RequestSummary, RouterMetrics
from splitserve.v1 import splitserve_pb2 as pb
from splitserve.worker_common.metrics import WorkerMetrics
from tests.observability.scrape import Scrape, exposable_names


def make_worker(running=1, waiting=2, total=64, in_use=5, cached=3, pairs=1, preemptions=4):
    status = pb.WorkerStatus(
        running=running, waiting=waiting, kv_blocks_total=total, kv_blocks_in_use=in_use, kv_blocks_cached=cached
    )
    return SimpleNamespace(
        status_message=lambda: status, kv_pairs=lambda: pairs, engine=SimpleNamespace(num_preemptions=preemptions)
    )


def make_router(waiting=1, inflight=3, workers=()):
    return SimpleNamespace(
        dispatcher=SimpleNamespace(waiting=[object()] * waiting),
        inflight={f"r{i}" for i in range(inflight)},
        pool=SimpleNamespace(workers=list(workers)),
    )


def make_handle(worker_id, role, healthy=True, **status):
    return SimpleNamespace(
        worker_id=worker_id,
        spec=SimpleNamespace(role=role),
        healthy=healthy,
        status=pb.WorkerStatus(worker_id=worker_id, role=role, **status),
    )


def make_summary(outcome="finished", status="OK", finish_reason="length", **timing) -> RequestSummary:
    t = pb.Timing(
        queue_ms=1.0, prefill_ms=20.0, transfer_ms=3.0, first_token_ms=21.0, decode_ms=100.0, total_ms=121.0, **timing
    )
    return RequestSummary("req-1", outcome, status, "", finish_reason, 10, 5, 4, t)


def families(registry) -> dict[str, str]:
    return {f.name: f.type for f in registry.collect()}


def all_registries():
    router = RouterMetrics()
    router.watch(make_router(workers=[make_handle("decode-0", "decode")]))
    worker = WorkerMetrics("prefill-0", "prefill")
    worker.watch(make_worker())
    return router.registry, worker.registry


def test_names_follow_prometheus_conventions():
    for registry in all_registries():
        for name, kind in families(registry).items():
            assert name.startswith("splitserve_") and name == name.lower(), name
            if kind == "histogram":
                unit = name.rsplit("_", 1)[-1]
                assert unit in ("seconds", "bytes", "tokens", "requests"), name
            assert not (kind == "gauge" and name.endswith("_total")), name
            if "latency" in name or "time" in name:
                assert name.endswith("_seconds"), name
    exposed = exposable_names(*all_registries())
    assert {
        "splitserve_requests_total",
        "splitserve_time_to_first_token_seconds_bucket",
        "splitserve_engine_kv_blocks_in_use",
    } <= exposed


def test_router_observes_requests_by_outcome_and_timing():
    metrics = RouterMetrics()
    metrics.queue.observe(0.001)
    metrics.first_token(0.021, 0.020, 10, 4)
    metrics.relayed(1, None)
    metrics.relayed(3, 0.05)
    metrics.kv_transfer(0.003, 4096)
    metrics.ended(make_summary())
    metrics.ended(make_summary("error", "UNAVAILABLE", ""))
    metrics.ended(make_summary("cancelled", "CANCELLED", ""))
    s = Scrape.registry(metrics.registry)
    assert s.value("splitserve_requests_total", outcome="finished", status="OK", finish_reason="length") == 1
    assert s.value("splitserve_requests_total", outcome="error", status="UNAVAILABLE") == 1
    assert s.value("splitserve_requests_total", outcome="cancelled") == 1
    assert s.value("splitserve_time_to_first_token_seconds_sum") == pytest.approx(0.021)
    assert s.value("splitserve_time_to_first_token_seconds_bucket", le="0.04") == 1
    assert s.value("splitserve_time_to_first_token_seconds_bucket", le="0.02") == 0
    assert s.value("splitserve_inter_token_latency_seconds_count") == 1  # the first message has no gap
    assert s.value("splitserve_generation_tokens_total") == 4
    assert (s.value("splitserve_prompt_tokens_total"), s.value("splitserve_prefix_cache_hit_tokens_total")) == (10, 4)
    assert s.value("splitserve_kv_transfer_bytes_sum") == 4096
    # e2e and decode: finished requests only, from their Timing
    assert s.value("splitserve_e2e_request_latency_seconds_count") == 1
    assert s.value("splitserve_e2e_request_latency_seconds_sum") == pytest.approx(0.121)
    assert s.value("splitserve_request_decode_seconds_sum") == pytest.approx(0.1)
    assert s.value("splitserve_request_generation_tokens_sum") == 5


def test_router_gauges_follow_the_pool():
    metrics = RouterMetrics()
    router = make_router(
        waiting=2,
        inflight=5,
        workers=[
            make_handle(
                "prefill-0",
                "prefill",
                running=1,
                waiting=3,
                kv_blocks_total=100,
                kv_blocks_in_use=7,
                kv_blocks_cached=9,
            ),
            make_handle("decode-0", "decode", healthy=False, running=4, kv_blocks_total=200, kv_blocks_in_use=50),
        ],
    )
    metrics.watch(router)
    s = Scrape.registry(metrics.registry)
    assert (s.value("splitserve_requests_waiting"), s.value("splitserve_requests_running")) == (2, 3)
    assert s.value("splitserve_worker_up", worker_id="prefill-0", role="prefill") == 1
    assert s.value("splitserve_worker_up", worker_id="decode-0", role="decode") == 0
    assert s.value("splitserve_worker_requests_waiting", worker_id="prefill-0") == 3
    assert s.value("splitserve_worker_kv_blocks_in_use", worker_id="decode-0") == 50
    assert s.value("splitserve_worker_kv_blocks_cached", worker_id="prefill-0") == 9
    router.pool.workers.pop()  # a worker that leaves the pool leaves the metrics
    s = Scrape.registry(metrics.registry)
    assert [labels["worker_id"] for labels in s.label_sets("splitserve_worker_kv_blocks_capacity")] == ["prefill-0"]


def test_worker_metrics_carry_its_id_and_read_its_state():
    metrics = WorkerMetrics("decode-3", "decode")
    metrics.watch(make_worker(running=2, in_use=5, preemptions=4))
    metrics.step("decode", 0.01, 2, 2)
    metrics.prefix_cache(30, 16)
    done = TransferHandle("t1", (1, 2), 5.0)
    done.start()
    done.nbytes = 8192
    done.complete()
    failed = TransferHandle("t2", (3,), 5.0)
    failed.fail("pair broke")
    metrics.transfer_ended("received", done)
    metrics.transfer_ended("received", failed)
    s = Scrape.registry(metrics.registry)
    ids = {"worker_id": "decode-3", "role": "decode"}
    assert all(ids.items() <= labels.items() for sample in s.samples for labels in [sample.labels])
    assert s.value("splitserve_engine_steps_total", kind="decode") == 1
    assert s.value("splitserve_engine_batch_requests_sum") == 2
    assert (
        s.value("splitserve_engine_prefix_cache_queries_total"),
        s.value("splitserve_engine_prefix_cache_hits_total"),
    ) == (30, 16)
    assert s.value("splitserve_engine_kv_transfers_total", direction="received", result="done") == 1
    assert s.value("splitserve_engine_kv_transfers_total", result="failed") == 1
    assert s.value("splitserve_engine_kv_transfer_bytes_total") == 8192
    assert s.value("splitserve_engine_kv_transfer_seconds_count") == 1  # done transfers only
    assert (s.value("splitserve_engine_requests_running"), s.value("splitserve_engine_kv_blocks_in_use")) == (2, 5)
    assert s.value("splitserve_engine_preemptions_total") == 4


def test_endpoint_serves_the_registry_and_closes_on_stop():
    metrics = RouterMetrics()
    metrics.generation_tokens.inc(7)
    server = MetricsServer(metrics.registry)
    address = server.start("127.0.0.1", 0)
    host, port = address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert Scrape.http(address).value("splitserve_generation_tokens_total") == 7
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:  # scraped twice: same registry
        assert b"splitserve_generation_tokens_total 7.0" in response.read()
    server.stop()
    server.stop()  # idempotent
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1)


def test_endpoint_refuses_a_taken_port_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            MetricsServer(RouterMetrics().registry).start("127.0.0.1", port)
