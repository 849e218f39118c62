"""Where Ray puts each worker: the splitserve_<role> convention, the config's overrides, and the
router address workers dial."""

from __future__ import annotations

import pytest

from splitserve.deploy.config import DeploymentConfig
from splitserve.deploy.deployment import Deployment


def test_actor_options_follow_the_convention_unless_the_config_says_otherwise(ray_session):
    deployment = Deployment(
        DeploymentConfig.from_dict(
            {
                "decode": {
                    "resources": {"big_hbm": 2},
                    "label_selector": {"splitserve-role": "decode"},
                    "num_gpus": 1,
                    "num_cpus": 2,
                    "max_restarts": -1,
                },
            }
        )
    )
    # The embedded Ray has no splitserve_prefill resource: nothing is required.
    assert deployment.actor_options("prefill") == dict(
        num_cpus=0.0, num_gpus=0.0, resources={}, max_restarts=3, max_task_retries=0
    )
    assert deployment.actor_options("decode") == dict(
        num_cpus=2,
        num_gpus=1,
        resources={"big_hbm": 2},
        max_restarts=-1,
        max_task_retries=0,
        label_selector={"splitserve-role": "decode"},
    )


def test_cuda_gives_each_rank_a_gpu_unless_the_config_says_otherwise(ray_session):
    """device cuda: a role without num_gpus reserves one GPU per rank (its actor, and each bundle of a
    tensor-parallel worker's placement group); a share the config names is kept; cpu reserves none."""
    import ray

    config = DeploymentConfig.from_dict(
        {"device": "cuda", "prefill": {"tensor_parallel_size": 2}, "decode": {"num_gpus": 0.5}}
    )
    deployment = Deployment(config)
    assert deployment.actor_options("prefill")["num_gpus"] == 1.0
    assert deployment.actor_options("decode")["num_gpus"] == 0.5
    options, rank_options = deployment.placement.place_ranks(
        "prefill-0", "prefill", 0, deployment.actor_options("prefill"), {}
    )
    try:
        assert [bundle.get("GPU") for bundle in deployment.placement_groups["prefill-0"].bundle_specs] == [1.0, 1.0]
        assert [r["num_gpus"] for r in rank_options] == [1.0]
    finally:
        ray.util.remove_placement_group(deployment.placement_groups.pop("prefill-0"))
    # The same config on cpu (a command line's --device cpu) reserves no GPU.
    cpu = Deployment(config.with_overrides(device="cpu"))
    assert cpu.actor_options("prefill")["num_gpus"] == 0.0 and cpu.actor_options("decode")["num_gpus"] == 0.5


def test_router_address_workers_dial(ray_session, monkeypatch):
    import ray

    deployment = Deployment(DeploymentConfig())
    assert deployment.ray.advertised("0.0.0.0:7000") == "127.0.0.1:7000"  # a wildcard bind: this node's address
    assert deployment.ray.advertised("127.0.0.1:7000") == "127.0.0.1:7000"  # every node is on loopback here
    nodes = ray.nodes()
    monkeypatch.setattr(ray, "nodes", lambda: [*nodes, {"NodeManagerAddress": "10.1.2.3", "Alive": True}])
    with pytest.raises(RuntimeError, match="host: .*10.1.2.3"):
        deployment.ray.advertised("127.0.0.1:7000")


def two_usable_cpus() -> tuple[int, int]:
    import os

    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip(f"needs 2 usable cores to give prefill and decode one each; this process has {usable}")
    return usable[0], usable[1]


def test_prefill_and_decode_on_cores_of_their_own(ray_session, serving_model):
    """prefill cpus [a] and decode cpus [b]: each worker's process (every thread of it) runs on its
    core only, with one torch thread, Ray reserves one CPU for each, and status reports both."""
    import os

    from splitserve.client.grpc_client import Client
    from splitserve.client.status_view import format_status, status_json
    from tests.serving.conftest import start_deployment, wait_for

    a, b = two_usable_cpus()
    deployment = start_deployment(serving_model, prefill={"cpus": [a]}, decode={"cpus": str(b)})
    try:
        assert deployment.actor_options("prefill")["num_cpus"] == 1.0  # num_cpus follows len(cpus)
        pids = {w: deployment.worker_pid(w) for w in ("prefill-0", "decode-0")}
        for worker_id, cpu in (("prefill-0", a), ("decode-0", b)):
            threads = os.listdir(f"/proc/{pids[worker_id]}/task")
            assert len(threads) > 1  # Ray's, gRPC's and torch's threads, not only the main one
            assert {tid: os.sched_getaffinity(int(tid)) for tid in threads} == {tid: {cpu} for tid in threads}
            status_text = open(f"/proc/{pids[worker_id]}/status").read()
            assert f"Cpus_allowed_list:\t{cpu}\n" in status_text
        with Client(deployment.address) as client:
            client.generate(token_ids=[1, 2, 3], max_tokens=4, temperature=0.0)  # the pinned pair serves
            status = wait_for(lambda: (s := client.status()) and all(w.threads for w in s.workers) and s)
        workers = {w["worker_id"]: w for w in status_json(status)["workers"]}
        assert {w: (v["cpus"], v["threads"]) for w, v in workers.items()} == {
            "prefill-0": (str(a), 1),
            "decode-0": (str(b), 1),
        }
        table = format_status(status, deployment.address).splitlines()
        cpus_column = table[1].index("CPUS")
        rows = table[2 : 2 + len(status.workers)]  # the worker rows; each worker's linear kernels follow
        assert sorted(line[cpus_column:].split()[0] for line in rows) == sorted([str(a), str(b)])
    finally:
        deployment.stop()


def test_a_cpu_the_node_does_not_have_fails_the_start_naming_the_field(ray_session, serving_model):
    import os
    import time

    missing = max(os.sched_getaffinity(0)) + 1
    deployment = Deployment(
        DeploymentConfig.from_dict(
            {
                "model": str(serving_model),
                "dtype": "float32",
                "port": 0,
                "ready_timeout_s": 60,
                "prefill": {"cpus": [missing], "num_cpus": 0},
                "decode": {"threads": 1},
            }
        )
    )
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=rf"worker prefill-0 did not start: .*cpus: {missing} not usable"):
            deployment.start()
        assert time.monotonic() - start < 30  # at once, not at ready_timeout_s
    finally:
        deployment.stop()
