"""Where Ray puts each worker: the splitserve_<role> convention, the config's overrides, and the
router address workers dial."""

from __future__ import annotations

import pytest

from splitserve.deploy_config import DeploymentConfig
from splitserve.launch import Deployment


def test_actor_options_follow_the_convention_unless_the_config_says_otherwise(ray_session):
    deployment = Deployment(DeploymentConfig.from_dict({
        "decode": {"resources": {"big_hbm": 2}, "label_selector": {"splitserve-role": "decode"}, "num_gpus": 1,
                   "num_cpus": 2, "max_restarts": -1},
    }))  # fmt: skip
    # The embedded Ray has no splitserve_prefill resource: nothing is required.
    assert deployment.actor_options("prefill") == dict(num_cpus=0.0, num_gpus=0.0, resources={}, max_restarts=3,
                                                       max_task_retries=0)  # fmt: skip
    assert deployment.actor_options("decode") == dict(num_cpus=2, num_gpus=1, resources={"big_hbm": 2},
                                                      max_restarts=-1, max_task_retries=0,
                                                      label_selector={"splitserve-role": "decode"})  # fmt: skip


def test_router_address_workers_dial(ray_session, monkeypatch):
    import ray

    deployment = Deployment(DeploymentConfig())
    assert deployment._advertised("0.0.0.0:7000") == "127.0.0.1:7000"  # a wildcard bind: this node's address
    assert deployment._advertised("127.0.0.1:7000") == "127.0.0.1:7000"  # every node is on loopback here
    nodes = ray.nodes()
    monkeypatch.setattr(ray, "nodes", lambda: [*nodes, {"NodeManagerAddress": "10.1.2.3", "Alive": True}])
    with pytest.raises(RuntimeError, match="host: .*10.1.2.3"):
        deployment._advertised("127.0.0.1:7000")
