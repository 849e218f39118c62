"""The Ray cluster launcher configs (cluster_configs/ray) and the KubeRay manifest (cluster_configs/kuberay):
each passes the validation Ray itself applies, and each follows splitserve's placement convention (prefill
nodes carry ``splitserve_prefill``, decode nodes ``splitserve_decode``, the head neither).

Offline and fast: Ray's config preparation and schema check run in process, no Ray is started, and any
attempt to open a non-loopback connection fails the test.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jsonschema  # Ray's validate_config needs it (a ray[default] dependency); a real import, not a skip
import pytest
import yaml
from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
from ray.autoscaler._private.util import prepare_config, validate_config, with_head_node_ip

from splitserve.deploy import ray_adapter

ROOT = Path(__file__).resolve().parent.parent
RAY_CONFIGS = sorted((ROOT / "cluster_configs" / "ray").glob("*.yaml"))
AWS = ROOT / "cluster_configs" / "ray" / "aws-gpu.yaml"
ONPREM = ROOT / "cluster_configs" / "ray" / "onprem.yaml"
KUBERAY = ROOT / "cluster_configs" / "kuberay" / "raycluster.yaml"
ROLES = {"prefill": "splitserve_prefill", "decode": "splitserve_decode"}


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Validation must stay offline: connecting anywhere but loopback or a Unix socket fails."""
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def check(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            host = address[0]
            try:
                loopback = ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = host == "localhost"
            if not loopback:
                raise AssertionError(f"network access to {address!r} during a config test")

    monkeypatch.setattr(socket.socket, "connect", lambda s, a: (check(s, a), real_connect(s, a))[1])
    monkeypatch.setattr(socket.socket, "connect_ex", lambda s, a: (check(s, a), real_connect_ex(s, a))[1])


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def ray_validate(config: dict) -> dict:
    """What `ray up` does before touching any provider: fill in the provider's defaults (and for
    the local provider, its single node type), then check the result against ray-schema.json and
    Ray's cross-field rules. Returns the prepared config."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_configs_exist():
    assert AWS in RAY_CONFIGS and ONPREM in RAY_CONFIGS
    assert KUBERAY.is_file()


# ---- Ray's own validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", RAY_CONFIGS, ids=lambda p: p.name)
def test_ray_launcher_config_is_valid(path):
    prepared = ray_validate(load(path))
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("path", RAY_CONFIGS, ids=lambda p: p.name)
def test_validator_rejects_a_misspelled_key(path):
    config = load(path)
    config["head_start_ray_command"] = config.pop("head_start_ray_commands")
    with pytest.raises(jsonschema.ValidationError, match="head_start_ray_command"):
        ray_validate(config)


def test_validator_rejects_misspelled_node_types():
    config = load(AWS)
    config["available_node_type"] = config.pop("available_node_types")
    with pytest.raises(jsonschema.ValidationError, match="available_node_type"):
        ray_validate(config)


@pytest.mark.parametrize("amount", ["8", 0.5, -1], ids=["string", "fraction", "negative"])
def test_validator_rejects_a_bad_resource_amount(amount):
    # Node type resources are whole, non-negative numbers: Ray's schema refuses anything else.
    config = load(AWS)
    config["available_node_types"]["prefill_gpu"]["resources"]["splitserve_prefill"] = amount
    with pytest.raises(jsonschema.ValidationError):
        ray_validate(config)


def test_validator_rejects_a_mistyped_field():
    config = load(ONPREM)
    config["worker_start_ray_commands"] = "ray start --address=$RAY_HEAD_IP:6379"  # a string, not a list
    with pytest.raises(jsonschema.ValidationError):
        ray_validate(config)


# ---- placement convention ---------------------------------------------------------------------------


def test_aws_node_types_follow_the_placement_convention():
    config = ray_validate(load(AWS))
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert not set(ROLES.values()) & set(head["resources"]), "no worker may be placed on the head"
    assert head["resources"].get("CPU") == 0
    assert head["max_workers"] == 0
    for role, node_type in (("prefill", "prefill_gpu"), ("decode", "decode_gpu")):
        resources, other = types[node_type]["resources"], ROLES["decode" if role == "prefill" else "prefill"]
        assert other not in resources
        # One worker per GPU: as many role units as GPUs.
        assert resources[ROLES[role]] == resources["GPU"] > 0
        assert types[node_type]["labels"] == {"splitserve-role": role}
        ray_adapter.validate_node_labels(types[node_type]["labels"])
        # splitserve asks for the role resource only when the cluster has it at `serve` time.
        assert types[node_type]["min_workers"] >= 1
    assert sum(t["min_workers"] for t in types.values()) <= config["max_workers"]


def test_aws_config_does_not_let_defaults_leak_in():
    # prepare_config merges the provider's defaults.yaml under the file: every list the defaults set
    # (e.g. a nightly Ray wheel in setup_commands) must be the file's own.
    raw = load(AWS)
    for key in (
        "setup_commands",
        "head_setup_commands",
        "worker_setup_commands",
        "head_start_ray_commands",
        "worker_start_ray_commands",
        "file_mounts",
        "initialization_commands",
    ):
        assert key in raw, key
    assert raw["file_mounts"] == {"~/splitserve": "."}
    assert any("pip install -e ~/splitserve" in c for c in raw["setup_commands"])


def test_onprem_roles_are_given_at_ray_start():
    raw = load(ONPREM)
    assert raw["provider"]["type"] == "local"
    assert "available_node_types" not in raw  # the local provider refuses it
    worker_start = "\n".join(raw["worker_start_ray_commands"])
    for resource in ROLES.values():
        assert resource in worker_start
        assert resource not in "\n".join(raw["head_start_ray_commands"])
    assert "splitserve-role=prefill" in worker_start and "splitserve-role=decode" in worker_start
    prepared = ray_validate(raw)
    assert prepared["provider"]["worker_ips"] == raw["provider"]["worker_ips"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize(
    ("addresses", "gpus", "resources", "labels"),
    [
        ("10.0.1.11 172.17.0.1", 8, {"splitserve_prefill": 8}, "splitserve-role=prefill"),
        ("172.17.0.1 10.0.1.12", 0, {"splitserve_prefill": 1}, "splitserve-role=prefill"),
        ("10.0.1.22", 4, {"splitserve_decode": 4}, "splitserve-role=decode"),
        ("10.0.1.99", 8, {}, None),
    ],
    ids=["prefill-8gpu", "prefill-cpu", "decode-4gpu", "unlisted"],
)
def test_onprem_worker_start_picks_the_role_from_the_host_address(tmp_path, addresses, gpus, resources, labels):
    """Run the worker start commands as Ray's updater would (RAY_HEAD_IP exported, each entry in its
    own shell) with `hostname`, `nvidia-smi` and `ray` replaced by stubs that record their arguments."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    calls = tmp_path / "ray-calls"
    scripts = {
        "hostname": f'[ "$1" = -I ] && echo "{addresses}"',
        "nvidia-smi": "\n".join([f"[ {gpus} -gt 0 ] || exit 127"] + [f'echo "GPU {i}: stub"' for i in range(gpus)]),
        "ray": f'"{sys.executable}" -c \'import json, sys; print(json.dumps(sys.argv[1:]))\' "$@" >> "{calls}"',
    }
    for name, body in scripts.items():
        (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / name).chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(tmp_path)}
    for command in with_head_node_ip(load(ONPREM)["worker_start_ray_commands"], "10.0.1.10"):
        subprocess.run(["bash", "-c", f"({command})"], env=env, check=True, timeout=10, capture_output=True)
    stop, start = [json.loads(line) for line in calls.read_text().splitlines()]
    assert stop == ["stop"]
    assert start[:2] == ["start", "--address=10.0.1.10:6379"]
    flags = dict(arg.split("=", 1) for arg in start[2:])
    assert json.loads(flags["--resources"]) == resources
    assert flags.get("--labels") == labels


# ---- KubeRay ----------------------------------------------------------------------------------------


def load_raycluster() -> dict:
    docs = [d for d in yaml.safe_load_all(KUBERAY.read_text()) if d]
    assert len(docs) == 1
    return docs[0]


def kuberay_resources(value: str) -> dict:
    """A rayStartParams `resources` value in KubeRay's form ('"{\\"name\\": 1}"'), read the way the Ray
    autoscaler reads it: drop the outer quotes and the backslashes, then JSON."""
    assert value.startswith('"') and value.endswith('"'), value
    return json.loads(value[1:-1].replace("\\", ""))


def test_raycluster_manifest_shape():
    cr = load_raycluster()
    assert cr["apiVersion"] == "ray.io/v1" and cr["kind"] == "RayCluster"
    spec = cr["spec"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == set(ROLES)
    for role, group in groups.items():
        params = group["rayStartParams"]
        # KubeRay's CRD types rayStartParams as map[string]string.
        assert all(isinstance(v, str) for v in params.values()), params
        resources = kuberay_resources(params["resources"])
        assert resources == {ROLES[role]: resources[ROLES[role]]}
        # KubeRay renders `--resources=<value>` into the container's shell command; the shell must
        # hand `ray start` the plain JSON.
        (flag,) = shlex.split(f"--resources={params['resources']}")
        assert json.loads(flag.split("=", 1)[1]) == resources
        (container,) = [c for c in group["template"]["spec"]["containers"] if c["name"] == "ray-worker"]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert resources[ROLES[role]] == gpus > 0  # one worker per GPU
        assert group["minReplicas"] >= 1
    head = spec["headGroupSpec"]
    assert head["rayStartParams"].get("num-cpus") == "0"
    assert "resources" not in head["rayStartParams"]
    head_container = head["template"]["spec"]["containers"][0]
    assert 50051 in {p["containerPort"] for p in head_container["ports"]}  # the router, on the head Service


def test_raycluster_passes_the_kuberay_autoscaler():
    # The KubeRay autoscaler turns the RayCluster into an autoscaling config (and runs Ray's
    # validate_config on it); each group's node type must carry exactly its role's resource.
    cr = load_raycluster()
    cr["metadata"].setdefault("namespace", "default")
    config = _derive_autoscaling_config_from_ray_cr(cr)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"]["CPU"] == 0
    assert not set(ROLES.values()) & set(head["resources"])
    for role, resource in ROLES.items():
        resources = types[role]["resources"]
        assert resources[resource] == resources["GPU"] == 8
        assert set(ROLES.values()) & set(resources) == {resource}


# ---- the 70B example: tensor parallelism per phase on 8-GPU nodes ---------------------------------------

LLAMA_70B = {  # Llama-3.1-70B's config.json, as published (the shape only: no weights are needed here)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
GPU_BYTES = {"p5.48xlarge": 80e9, "p5en.48xlarge": 141e9}  # H100 80 GB, H200 141 GB


def rank_weight_bytes(cfg: dict, tp: int) -> float:
    """bf16 weights one rank holds: the embedding and the LM head whole (replicated), 1/tp of the rest."""
    h, i, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    per_layer = h * h * 2 + h * kv * 2 + h * i * 3  # q, o; k, v; gate, up, down
    return 2 * (2 * v * h + layers * (per_layer / tp + 2 * h) + h)


def test_the_70b_example_splits_each_phase_and_fits_its_nodes(tmp_path):
    import torch

    from splitserve.deploy.config import DeploymentConfig
    from splitserve.engine.kv_cache.cache import KVCacheSpec
    from splitserve.engine.model.config import ModelConfig

    config = DeploymentConfig.from_file(ROOT / "cluster_configs" / "gpu-cluster-70b.yaml")
    assert (config.prefill.tensor_parallel_size, config.decode.tensor_parallel_size) == (4, 2)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    config.check_model(str(tmp_path))  # both sizes split the model into whole heads and MLP columns
    model = ModelConfig.from_model_dir(tmp_path)
    weights = 2 * (2 * LLAMA_70B["vocab_size"] * 8192 + 80 * (8192 * 8192 * 2 + 8192 * 1024 * 2 + 8192 * 28672 * 3))
    assert 140e9 < weights < 142e9, "the shape above is Llama-3.1-70B's"

    nodes = load(AWS)["available_node_types"]
    for role, node_type in (("prefill", "prefill_gpu"), ("decode", "decode_gpu")):
        role_config, node = getattr(config, role), nodes[node_type]
        tp = role_config.tensor_parallel_size
        gpus_per_node = node["resources"]["GPU"]
        assert role_config.num_gpus == 1 and gpus_per_node % tp == 0, f"{role}: whole workers per node"
        assert role_config.replicas * tp <= gpus_per_node * node["max_workers"], f"{role}: enough GPUs"
        block = KVCacheSpec.for_model(model, 1, config.engine.block_size, torch.bfloat16, tp, 0).bytes_per_block
        blocks = role_config.num_blocks or config.engine.kv_cache_bytes // block
        used = rank_weight_bytes(LLAMA_70B, tp) + blocks * block
        memory = GPU_BYTES[node["node_config"]["InstanceType"]]
        assert used < 0.95 * memory, f"{role}: {used / 1e9:.1f} GB of weights and KV on a {memory / 1e9:.0f} GB GPU"
        assert blocks * config.engine.block_size >= 128 * 1024, f"{role}: room for one 128k-token context"
