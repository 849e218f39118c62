"""Deployments on an embedded Ray for the serving tests: real worker processes (Ray actors), a real
gRPC router, real KV transfers. One Ray for the whole session (``ray_session`` and the checkpoint
``serving_model`` are in tests/conftest.py, shared with the bench and multi-node tests);
deployments per module."""

from __future__ import annotations

import time


def start_deployment(model_dir, **overrides):
    from splitserve.deploy.config import DeploymentConfig
    from splitserve.deploy.deployment import Deployment

    raw = {
        "model": str(model_dir),
        "dtype": "float32",
        "port": 0,
        "prefill": {"threads": 1},
        "decode": {"threads": 1},
        **overrides,
    }
    deployment = Deployment(DeploymentConfig.from_dict(raw))
    deployment.start()
    return deployment


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s (last value {value!r})")
        time.sleep(interval_s)
