"""Deployments on an embedded Ray for the serving tests: real worker processes (Ray actors), a real
gRPC router, real KV transfers. One Ray for the whole session; deployments per module."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import pytest

from tests.serving.netstat import listening_sockets


@pytest.fixture(scope="session")
def ray_session():
    import ray

    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # set in tests/conftest.py, before Ray loads
    before = listening_sockets()
    temp_dir = tempfile.mkdtemp(prefix="ss")
    ray.init(address="local", _temp_dir=temp_dir, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", num_cpus=2)  # fmt: skip
    yield {"listening_before": before}
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def serving_model(tmp_path_factory):
    """The tiny preset in fp32, with one extra EOS id: the 4th greedy token of EOS_PROMPT, so that a
    request can end on EOS deterministically."""
    from engine import LLM, SamplingParams
    from splitserve.make_model import make_model

    path = make_model("tiny", tmp_path_factory.mktemp("serving") / "tiny", dtype="float32", seed=0)
    llm = LLM(path, dtype="float32", num_blocks=64)
    tokens = llm.generate([EOS_PROMPT], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0].token_ids
    assert tokens[3] not in tokens[:3]
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [*gen["eos_token_id"], tokens[3]]
    gen_path.write_text(json.dumps(gen))
    return path


EOS_PROMPT = [11, 22, 33, 44, 55]


def start_deployment(model_dir, **overrides):
    from splitserve.deploy_config import DeploymentConfig
    from splitserve.launch import Deployment

    raw = {"model": str(model_dir), "dtype": "float32", "port": 0, "prefill": {"threads": 1},
           "decode": {"threads": 1}, **overrides}  # fmt: skip
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
