"""A deployment across a simulated multi-node Ray cluster (real Ray nodes on 127.0.0.1, each with its
own raylet and worker processes), joined the way operators join a real one: ``splitserve serve
--ray-address ... --config ...`` in its own process. Prefill and decode land on their own nodes by the
``splitserve_prefill`` / ``splitserve_decode`` convention, KV crosses nodes, a lost decode node makes
its streams migrate, and scaling works under load."""

from __future__ import annotations

import threading
import time

import pytest

from splitserve.client.grpc_client import Client
from splitserve.deploy.sim_cluster import ServeProcess, SimCluster
from tests.serving.conftest import wait_for
from tests.serving.streams import stream_all

PROMPTS = [list(range(1, 30)), list(range(100, 140)), list(range(300, 320)), list(range(500, 545))]
SAMPLING = dict(max_tokens=100, temperature=0.0, ignore_eos=True)


def healthy(served: ServeProcess, role: str) -> list[dict]:
    return [w for w in served.workers() if w["role"] == role and w["healthy"]]


@pytest.fixture(scope="module")
def reference(serving_model):
    from splitserve.engine import LLM, SamplingParams

    llm = LLM(serving_model, dtype="float32", num_blocks=256)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**SAMPLING))]


@pytest.fixture(scope="module")
def cluster():
    # One prefill node, two decode nodes, one unit of their role's resource each.
    with SimCluster([("prefill", 1), ("decode", 1), ("decode", 1)]) as sim:
        yield sim


@pytest.fixture(scope="module")
def served(cluster, serving_model, tmp_path_factory):
    config = {
        "model": str(serving_model),
        "dtype": "float32",
        "port": 0,
        "ray_address": cluster.address,
        "prefill": {"replicas": 1, "threads": 1},
        "decode": {"replicas": 2, "threads": 1},
        "faults": {"decode_step_delay_s": 0.02},
    }
    served = ServeProcess(config, tmp_path_factory.mktemp("mn") / "deploy.yaml")
    yield served
    assert served.stop() == 0


def test_each_role_runs_on_its_own_nodes_and_kv_crosses_nodes(cluster, served, reference):
    nodes = {w["worker_id"]: w["node_id"] for w in served.workers()}
    assert nodes["prefill-0"] == cluster.nodes["prefill-0"]
    assert {nodes["decode-0"], nodes["decode-1"]} == {cluster.nodes["decode-0"], cluster.nodes["decode-1"]}
    assert cluster.nodes["head"] not in nodes.values()
    with Client(served.address) as client:
        for prompt, want in zip(PROMPTS[:2], reference):
            result = client.generate(token_ids=prompt, **SAMPLING)
            assert result.token_ids == want
            assert nodes[result.timing["prefill_worker"]] != nodes[result.timing["decode_worker"]]
            assert result.timing["transfer_ms"] > 0


def test_decode_node_lost_mid_stream_streams_migrate_and_capacity_returns(cluster, served, reference):
    started = threading.Event()
    futures = stream_all(served.address, PROMPTS, SAMPLING, started)
    assert started.wait(60)
    decode = wait_for(lambda: [w for w in healthy(served, "decode") if w["running"]], 10, 0.05)
    victim = max(decode, key=lambda w: w["running"])
    node_name = next(name for name, node_id in cluster.nodes.items() if node_id == victim["node_id"])
    cluster.remove(node_name)  # the node's raylet and processes die: a node failure
    lost_at = time.monotonic()
    wait_for(lambda: victim["worker_id"] not in {w["worker_id"] for w in healthy(served, "decode")}, 10, 0.05)
    noticed_s = time.monotonic() - lost_at
    results = [f.result(timeout=180) for f in futures]
    assert [r[0] for r in results] == reference, "migrated streams must continue exactly"
    assert sum(r[2] for r in results) >= 1, "the lost node's streams must have migrated"
    # Ray restarts the lost worker where its resource is: on a new decode node.
    cluster.add("decode", 1)
    wait_for(lambda: len(healthy(served, "decode")) == 2, 120, 0.2)
    back = {w["worker_id"]: w["node_id"] for w in healthy(served, "decode")}
    assert back[victim["worker_id"]] != victim["node_id"]
    assert noticed_s < 5
    wait_for(lambda: all(w["kv_blocks_in_use"] == 0 for w in served.workers()), 15)


def test_scale_up_and_down_under_load(cluster, served, reference):
    cluster.add("decode", 1)  # room for a third decode worker
    started = threading.Event()
    futures = stream_all(served.address, PROMPTS, SAMPLING, started)
    assert started.wait(60)
    served.cli("scale", "--decode", "3")
    assert len(healthy(served, "decode")) == 3
    assert [f.result(timeout=180)[0] for f in futures] == reference
    started = threading.Event()
    futures = stream_all(served.address, PROMPTS, SAMPLING, started)
    assert started.wait(60)
    served.cli("scale", "--decode", "1")  # the two newest drain: their streams are handed back
    assert [f.result(timeout=180)[0] for f in futures] == reference, "no stream may fail or change"
    assert [w["worker_id"] for w in healthy(served, "decode")] == ["decode-0"]
    wait_for(lambda: all(w["kv_blocks_in_use"] == 0 for w in served.workers()), 15)
