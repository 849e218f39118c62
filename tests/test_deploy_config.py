from __future__ import annotations

import pytest

from splitserve.deploy_config import ConfigError, DeploymentConfig


def test_defaults_and_overrides():
    config = DeploymentConfig()
    assert (config.host, config.port, config.prefill.replicas, config.decode.replicas) == ("127.0.0.1", 50051, 1, 1)
    changed = config.with_overrides(num_prefill=2, port=9000, model=None)
    assert changed.prefill.replicas == 2 and changed.port == 9000 and changed.model is None


def test_from_file(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text("model: /m\nprefill: {replicas: 2, threads: 1}\ntransfer: {op_timeout_s: 2.5}\n"
                    "faults: {transfer: [{role: sender, action: pause, after_messages: 1, seconds: 1}]}\n")  # fmt: skip
    config = DeploymentConfig.from_file(path)
    assert config.model == "/m" and config.prefill.replicas == 2 and config.transfer.op_timeout_s == 2.5
    assert config.faults.transfer[0].action == "pause"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"modle": "x"}, "modle"),
        ({"port": "high"}, "port"),
        ({"prefill": {"replicas": 0}}, "replicas"),
        ({"prefill": {"replicaz": 1}}, "prefill.replicaz"),
        ({"decode": []}, "decode"),
        ({"transfer": {"op_timeout_s": 0}}, "op_timeout_s"),
        ({"router": {"routing_policy": "random"}}, "routing_policy"),
        ({"faults": {"transfer": [{"role": "x", "action": "pause", "after_messages": 1}]}}, "faults.transfer"),
        ({"engine": {"block_size": None}}, "engine.block_size"),
    ],
)
def test_errors_name_the_field(raw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        DeploymentConfig.from_dict(raw)
