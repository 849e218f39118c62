"""Losing workers while serving: requests retry or migrate, Ray restarts the lost worker, it comes
back under a new incarnation, and nobody leaks a block. Also scaling a running deployment."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from splitserve.client.grpc_client import Client
from tests.serving.conftest import start_deployment, wait_for
from tests.serving.crash import kill_worker
from tests.serving.streams import stream_all

PROMPTS = [list(range(1, 30)), list(range(100, 140)), list(range(300, 320)), list(range(500, 545))]
SAMPLING = dict(max_tokens=120, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(serving_model):
    from splitserve.engine import LLM, SamplingParams

    llm = LLM(serving_model, dtype="float32", num_blocks=256)
    return {tuple(p): o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, SamplingParams(**SAMPLING)))}


@pytest.fixture(scope="module")
def cluster(ray_session, serving_model):
    # Decode steps take >= 20 ms so that streams are reliably mid-way when a worker dies.
    deployment = start_deployment(
        serving_model,
        prefill={"replicas": 2, "threads": 1},
        decode={"replicas": 2, "threads": 1},
        faults={"decode_step_delay_s": 0.02},
    )
    yield deployment
    deployment.stop()


@pytest.fixture
def whole_cluster(cluster):
    """The module's cluster as the fixture made it (2 prefill, 2 decode workers, all registered),
    whatever a test before left: a worker still restarting, or a scale-down."""
    if len(healthy(cluster, "prefill")) != 2 or len(cluster.router.pool.decode) != 2:
        _scale(cluster.address, prefill=2, decode=2)
    wait_for(
        lambda: (
            healthy(cluster, "decode") == ["decode-0", "decode-1"]
            and healthy(cluster, "prefill") == ["prefill-0", "prefill-1"]
        ),
        60,
    )
    return cluster


def router_count(deployment, name: str) -> float:
    """A counter of the router's own metrics registry (``splitserve_request_*_total``)."""
    return deployment.router.metrics.registry.get_sample_value(f"{name}_total") or 0.0


def healthy(deployment, role: str) -> list[str]:
    return sorted(w["worker_id"] for w in deployment.workers if w["role"] == role and w["healthy"])


def incarnations(deployment) -> dict[str, str]:
    return {w.worker_id: w.incarnation for w in Client(deployment.address).status().workers}


def busiest_decode_worker(deployment) -> str:
    """The decode worker running the most streams, once the router's status shows any running."""

    def running():
        decode = [w for w in Client(deployment.address).status().workers if w.role == "decode"]
        return decode if any(w.running for w in decode) else None

    return max(wait_for(running, 10, 0.05), key=lambda w: w.running).worker_id


def assert_no_blocks_in_use(deployment) -> None:
    wait_for(lambda: all(w.kv_blocks_in_use == 0 for w in Client(deployment.address).status().workers), 15)


def test_decode_worker_lost_mid_stream_migrates_and_comes_back(whole_cluster, reference):
    cluster = whole_cluster
    before = incarnations(cluster)
    started = threading.Event()
    futures = stream_all(cluster.address, PROMPTS, SAMPLING, started)
    assert started.wait(30)
    victim = busiest_decode_worker(cluster)
    killed_at = time.monotonic()
    kill_worker(cluster, victim)  # the process dies at once; Ray restarts it
    results = [f.result(timeout=120) for f in futures]
    for prompt, (tokens, finish, _) in zip(PROMPTS, results):
        assert tokens == reference[tuple(prompt)], "a migrated stream must continue exactly"
        assert finish == 2  # FINISH_REASON_LENGTH
    assert sum(r[2] for r in results) >= 1, "some stream must have migrated"
    # The lost worker left the pool, Ray restarted it, and it registered under a new incarnation.
    wait_for(lambda: healthy(cluster, "decode") == ["decode-0", "decode-1"], 60)
    back_after = time.monotonic() - killed_at
    assert incarnations(cluster)[victim] != before[victim]
    assert back_after < 60
    assert_no_blocks_in_use(cluster)


def test_a_frozen_decode_worker_is_noticed_by_keepalive(whole_cluster, reference):
    """A stopped process (as behind a lost node) sends no reset: keepalive pings must notice it."""
    cluster = whole_cluster
    started = threading.Event()
    futures = stream_all(cluster.address, PROMPTS, SAMPLING, started)
    assert started.wait(30)
    victim = busiest_decode_worker(cluster)
    pid = cluster.worker_pid(victim)
    os.kill(pid, signal.SIGSTOP)
    try:
        frozen_at = time.monotonic()
        wait_for(lambda: victim not in healthy(cluster, "decode"), 15, 0.05)
        noticed_s = time.monotonic() - frozen_at
        results = [f.result(timeout=120) for f in futures]
        assert [r[0] for r in results] == [reference[tuple(p)] for p in PROMPTS]
        assert sum(r[2] for r in results) >= 1, "the frozen worker's streams must have migrated"
        assert noticed_s < 8, f"keepalive took {noticed_s:.1f}s"
    finally:
        os.kill(pid, signal.SIGCONT)
    # Thawed, it finds its registration gone, registers again and frees what it held.
    wait_for(lambda: healthy(cluster, "decode") == ["decode-0", "decode-1"], 30)
    assert_no_blocks_in_use(cluster)


def test_prefill_worker_lost_mid_prefill_is_retried_elsewhere(ray_session, serving_model, reference):
    """prefill-0's kill point ends its process as its first prefill step starts (first incarnation
    only); round robin sends one of the two requests there, so it is lost mid-prefill, for certain."""
    slow = start_deployment(
        serving_model,
        prefill={"replicas": 2, "threads": 1},
        router={"routing_policy": "round_robin"},
        faults={"kill": [{"target": "prefill-0", "at": "prefill", "after": 0}]},
    )
    try:
        before = incarnations(slow)["prefill-0"]
        retries_before = router_count(slow, "splitserve_request_prefill_retries")
        with Client(slow.address) as client, ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(client.generate, token_ids=p, **SAMPLING) for p in PROMPTS[:2]]
            results = [f.result(timeout=120) for f in futures]
        for prompt, result in zip(PROMPTS, results):
            assert result.token_ids == reference[tuple(prompt)]
            assert result.timing["prefill_worker"] == "prefill-1", "the lost request was retried on the other worker"
        assert router_count(slow, "splitserve_request_prefill_retries") - retries_before == 1, "one prefill retried"
        wait_for(lambda: healthy(slow, "prefill") == ["prefill-0", "prefill-1"], 60)
        assert incarnations(slow)["prefill-0"] != before, "prefill-0 died and Ray restarted it"
        assert_no_blocks_in_use(slow)
    finally:
        slow.stop()


@pytest.mark.parametrize(
    "max_migrations, reason, waits_s",
    [
        (0, "gave up after 0 migrations", 0.0),  # past the limit: at once
        (3, "no decode worker is in the pool", 2.0),  # may migrate, but none is left: after lease_timeout_s
    ],
    ids=["migration_limit", "no_decode_worker_left"],
)
def test_a_request_that_cannot_migrate_fails_clearly(ray_session, serving_model, max_migrations, reason, waits_s):
    alone = start_deployment(
        serving_model,
        decode={"replicas": 1, "threads": 1, "max_restarts": 0},
        router={"max_migrations": max_migrations, "lease_timeout_s": 2.0},
        faults={"decode_step_delay_s": 0.02},
    )
    try:
        with Client(alone.address) as client:
            stream = client.stream(token_ids=PROMPTS[0], **SAMPLING)
            assert [next(stream) for _ in range(3)]
            kill_worker(alone, "decode-0")  # max_restarts 0: no decode worker comes back
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                list(stream)
            waited = time.monotonic() - start
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and reason in e.value.details()
            assert waits_s * 0.75 <= waited < waits_s + 4, f"failed after {waited:.1f}s"
            # The prefill worker is unharmed: a one-token request needs no decode worker.
            assert len(client.generate(token_ids=[1, 2, 3], max_tokens=1).token_ids) == 1
        assert_no_blocks_in_use(alone)
    finally:
        alone.stop()


def test_scale_up_and_down_under_load(whole_cluster, reference):
    cluster = whole_cluster
    with Client(cluster.address) as client:
        futures = stream_all(cluster.address, PROMPTS, SAMPLING)
        reply = _scale(cluster.address, decode=3)
        assert reply.decode == 3 and healthy(cluster, "decode") == ["decode-0", "decode-1", "decode-2"]
        results = [f.result(timeout=120) for f in futures]
        assert [r[0] for r in results] == [reference[tuple(p)] for p in PROMPTS]
        started = threading.Event()
        futures = stream_all(cluster.address, PROMPTS, SAMPLING, started)
        assert started.wait(30)
        reply = _scale(cluster.address, prefill=1, decode=1)  # drains: decode workers hand streams back
        assert (reply.prefill, reply.decode) == (1, 1)
        results = [f.result(timeout=120) for f in futures]
        assert [r[0] for r in results] == [reference[tuple(p)] for p in PROMPTS], "no stream may fail or change"
        assert healthy(cluster, "decode") == ["decode-0"] and healthy(cluster, "prefill") == ["prefill-0"]
        assert len(client.generate(token_ids=[1, 2, 3], max_tokens=3).token_ids) == 3
    assert_no_blocks_in_use(cluster)


def _scale(address: str, **counts):
    from splitserve.rpc import workers_pb2 as wpb
    from splitserve.rpc import workers_pb2_grpc as wpb_grpc

    with grpc.insecure_channel(address) as channel:
        return wpb_grpc.AdminStub(channel).Scale(wpb.ScaleRequest(**counts), timeout=180)
