from __future__ import annotations

from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
import yaml

from splitserve.common.faults import NO_FAULTS
from splitserve.deploy.config import ConfigError, DeploymentConfig
from splitserve.engine.core import EngineSettings
from splitserve.router.config import RouterConfig, RouterSettings


def test_defaults_and_overrides():
    config = DeploymentConfig()
    assert (config.host, config.port, config.prefill.replicas, config.decode.replicas) == ("127.0.0.1", 50051, 1, 1)
    changed = config.with_overrides(num_prefill=2, port=9000, model=None)
    assert changed.prefill.replicas == 2 and changed.port == 9000 and changed.model is None


def test_cpus_set_threads_and_ray_cpus_unless_given():
    config = DeploymentConfig.from_dict(
        {
            "prefill": {"cpus": [0]},
            "decode": {"cpus": "1-2", "threads": 1},
            "colocated": {"cpus": "0-1|2-3", "replicas": 1, "num_cpus": 0.5},
        }
    )
    p, d, c = config.prefill, config.decode, config.colocated
    assert (p.cpu_set(0), p.worker_threads(0), p.worker_num_cpus(0)) == ((0,), 1, 1.0)
    assert (d.cpu_set(3), d.worker_threads(3), d.worker_num_cpus(3)) == ((1, 2), 1, 2.0)  # one set: all share it
    assert (c.cpu_set(1), c.worker_threads(1), c.worker_num_cpus(1), c.max_pinned_replicas) == ((2, 3), 2, 0.5, 2)
    unpinned = DeploymentConfig().prefill
    assert (unpinned.cpu_set(0), unpinned.worker_threads(0), unpinned.worker_num_cpus(0)) == (None, None, 0.0)
    assert DeploymentConfig().with_overrides(decode_cpus="0-1|2-3", num_decode=2).decode.cpus == ((0, 1), (2, 3))
    with pytest.raises(ConfigError, match=r"decode\.cpus: 2 sets for 3 replicas"):
        DeploymentConfig().with_overrides(decode_cpus="0|1", num_decode=3)


def test_omp_wait_policy_sets_the_workers_environment_only_when_asked():
    config = DeploymentConfig.from_dict(
        {"prefill": {"cpus": [0], "omp_wait_policy": "passive"}, "decode": {"omp_wait_policy": "active"}}
    )
    assert config.prefill.worker_env(0) == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    assert config.decode.worker_env(0, owns_cores=True) == {"OMP_WAIT_POLICY": "ACTIVE"}
    default = DeploymentConfig.from_dict({"decode": {"omp_wait_policy": "default"}}).decode
    assert default.worker_env(0) == {}  # libgomp's own wait: no variable set
    with pytest.raises(ConfigError, match=r"decode\.omp_wait_policy: must be one of auto, default, passive, active"):
        DeploymentConfig.from_dict({"decode": {"omp_wait_policy": "spin"}})


def test_omp_spin_count_bounds_the_workers_spin():
    config = DeploymentConfig.from_dict({"decode": {"omp_wait_policy": "active", "omp_spin_count": 1000000}})
    assert config.decode.worker_env(0) == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "1000000"}
    assert "GOMP_SPINCOUNT" not in config.prefill.worker_env(0)  # another role's setting
    # with auto it goes with whichever policy auto resolves to
    spin = DeploymentConfig.from_dict({"decode": {"omp_spin_count": 0}}).decode
    assert spin.worker_env(0, owns_cores=True) == {"GOMP_SPINCOUNT": "0"}
    assert spin.worker_env(0) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
    with pytest.raises(ConfigError, match=r"prefill\.omp_spin_count: must be >= 0, got -5"):
        DeploymentConfig.from_dict({"prefill": {"omp_spin_count": -5}})
    with pytest.raises(ConfigError, match=r"colocated\.omp_spin_count: expected int \| None, got 'many'"):
        DeploymentConfig.from_dict({"colocated": {"omp_spin_count": "many"}})


@pytest.mark.parametrize(
    ("fields", "owners"),
    [
        ({}, set()),  # 1P+1D unpinned: both share the cores
        ({"mode": "colocated"}, {("colocated", 0)}),  # the only worker
        ({"mode": "colocated", "colocated": {"replicas": 2}}, set()),
        ({"mode": "colocated", "colocated": {"tensor_parallel_size": 2}}, set()),
        ({"prefill": {"cpus": [0]}, "decode": {"cpus": [1]}}, {("prefill", 0), ("decode", 0)}),
        ({"prefill": {"cpus": [0]}, "decode": {"cpus": "0-1"}}, set()),  # decode's set holds prefill's core
        ({"prefill": {"cpus": [0]}}, set()),  # decode unpinned: it may run anywhere
        (
            {"prefill": {"cpus": [0]}, "decode": {"cpus": "1|2", "replicas": 2}},
            {("prefill", 0), ("decode", 0), ("decode", 1)},
        ),
        ({"prefill": {"cpus": [0]}, "decode": {"cpus": [1], "replicas": 2}}, {("prefill", 0)}),  # one set, shared
    ],
)
def test_auto_wait_policy_is_libgomps_own_only_for_a_worker_alone_on_its_cores(fields, owners):
    config = DeploymentConfig.from_dict(fields)
    for role in config.roles:
        for slot in range(getattr(config, role).replicas):
            owns = config.owns_cores(role, slot)
            assert owns == ((role, slot) in owners), (role, slot)
            env = getattr(config, role).worker_env(slot, owns)
            assert env.get("OMP_WAIT_POLICY") == (None if owns else "PASSIVE")
            assert "GOMP_SPINCOUNT" not in env  # only a role's omp_spin_count sets it


def test_kill_points_go_to_their_worker_only():
    config = DeploymentConfig.from_dict(
        {
            "faults": {
                "kill": [
                    {"target": "decode-1", "at": "transfer", "after": 2},
                    {"target": "prefill-0", "at": "prefill", "after": 3},
                    {"target": "router", "at": "decode", "after": 50},
                ]
            }
        }
    )
    prefill = config.faults.for_worker("prefill-0")
    assert (prefill.die_at, prefill.die_after, prefill.transfer) == ("prefill", 3, ())
    decode = config.faults.for_worker("decode-1")
    assert decode.die_at == "" and [(f.role, f.action, f.after_messages) for f in decode.transfer] == [
        ("receiver", "die", 2)
    ]
    assert config.faults.for_worker("decode-0").arm("decode worker decode-0") is NO_FAULTS
    assert config.router_config("m").faults.die_after_tokens == 50
    assert DeploymentConfig().router_config("m").faults.arm("router") is NO_FAULTS


def test_each_worker_config_carries_its_own_faults():
    from splitserve.deploy.deployment import Deployment

    faults = {
        "prefill_delay_s": 0.5,
        "decode_step_delay_s": 0.25,
        "transfer": [{"role": "sender", "action": "pause", "after_messages": 1, "seconds": 2}],
        "kill": [{"target": "decode-0", "at": "decode", "after": 4}],
    }
    deployment = Deployment(DeploymentConfig.from_dict({"model": "m", "faults": faults}))
    prefill, decode = (deployment.fleet.worker_config(role, f"{role}-0").faults for role in ("prefill", "decode"))
    assert (prefill.prefill_delay_s, prefill.decode_step_delay_s, prefill.die_at) == (0.5, 0.0, "")
    assert (decode.prefill_delay_s, decode.decode_step_delay_s, decode.die_at, decode.die_after) == (
        0.0,
        0.25,
        "decode",
        4,
    )
    assert prefill.transfer == decode.transfer and prefill.transfer[0].seconds == 2
    assert decode.restarted().die_at == "" and decode.restarted().decode_step_delay_s == 0.25


def test_engine_and_router_settings_are_the_runtime_configs_own():
    from splitserve.deploy.deployment import Deployment

    config = DeploymentConfig.from_dict(
        {
            "model": "m",
            "engine": {"block_size": 32, "max_num_seqs": 8},
            "router": {"max_queue": 7},
            "decode": {"num_blocks": 99},
        }
    )
    router = config.router_config("m")
    assert isinstance(router, RouterSettings) and (router.max_queue, router.block_size) == (7, 32)
    engine = Deployment(config).fleet.worker_config("decode", "decode-0").engine
    assert isinstance(engine, EngineSettings)
    assert (engine.block_size, engine.max_num_seqs, engine.num_blocks, engine.enable_prefix_caching) == (
        32,
        8,
        99,
        False,
    )
    assert DeploymentConfig().port == RouterConfig(model_dir="m").port  # the default is the router's own


def test_from_file(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text(
        "model: /m\nprefill: {replicas: 2, threads: 1}\ntransfer: {op_timeout_s: 2.5}\n"
        "faults: {transfer: [{role: sender, action: pause, after_messages: 1, seconds: 1}]}\n"
    )
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
        ({"engine": {"linear_kernel": "fast"}}, "engine.linear_kernel: must be one of auto"),
        ({"engine": {"linear_split_allowed": "yes"}}, "engine.linear_split_allowed"),
        ({"decode": {"num_gpus": -1}}, "decode.num_gpus"),
        ({"device": "cuda", "decode": {"num_gpus": 0}}, "decode.num_gpus: 0 with device 'cuda'"),
        ({"device": "cuda", "mode": "colocated", "colocated": {"num_gpus": 0.0}}, "colocated.num_gpus"),
        ({"decode": {"resources": {"splitserve_decode": "one"}}}, "decode.resources"),
        ({"prefill": {"label_selector": {"splitserve-role": 1}}}, "prefill.label_selector"),
        ({"decode": {"max_restarts": -2}}, "decode.max_restarts"),
        ({"router": {"max_migrations": -1}}, "router.max_migrations"),
        ({"faults": {"kill": [{"target": "decoder-0", "at": "decode"}]}}, "faults.kill: target"),
        ({"faults": {"kill": [{"target": "prefill-0", "at": "decode"}]}}, "faults.kill: at"),
        ({"faults": {"kill": [{"target": "router", "at": "prefill"}]}}, "faults.kill: at"),
        ({"faults": {"kill": [{"target": "decode-1", "at": "decode", "after": -1}]}}, "faults.kill: after"),
        ({"faults": {"kill": ["decode-1"]}}, "faults.kill"),
        ({"security": {"tls_cert": "server.pem"}}, "security.tls_cert"),
        ({"security": {"tls_client_ca": "ca.pem"}}, "security.tls_client_ca"),
        ({"security": {"api_keys": "key"}}, "security.api_keys"),
        ({"security": {"api_keys": ["a key"]}}, "security.api_keys"),
        ({"security": {"internal_tls_ca": "ca.pem"}}, "security.internal_tls_cert"),
        ({"security": {"cluster_token": "a", "cluster_token_file": "b"}}, "security.cluster_token"),
        ({"security": {"cluster_token": ""}}, "security.cluster_token"),
        ({"metrics_port": 70000}, "router.metrics_port"),
        ({"metrics_port": "9400"}, "metrics_port"),
        ({"log_format": "yaml"}, "log_format"),
        ({"prefill": {"cpus": []}}, "prefill.cpus: must be a non-empty list"),
        ({"decode": {"cpus": [1, 1]}}, "decode.cpus: cpu 1 is listed twice"),
        ({"decode": {"cpus": [0, "x"]}}, "decode.cpus: cpu numbers must be ints"),
        ({"colocated": {"cpus": "0-"}}, "colocated.cpus: '0-' is not a cpu list"),
        ({"prefill": {"cpus": "0|1", "replicas": 3}}, "prefill.cpus: 2 sets for 3 replicas"),
        ({"prefill": {"cpus": "0-1|1-2"}}, "prefill.cpus: the sets of replicas 0 and 1 share cpu 1"),
        ({"decode": {"cpus": [0], "threads": 2}}, "decode.threads: 2 threads on 1 pinned cpus"),
        ({"decode": {"num_cpus": -1}}, "decode.num_cpus"),
        ({"engine": {"decode_path": "fast"}}, "engine.decode_path"),
        ({"engine": {"cuda_graphs": "yes"}}, "engine.cuda_graphs"),
        ({"engine": {"block_size": 0}}, "engine.block_size: must be >= 1, got 0"),
        ({"router": {"routing_policy": 3}}, "router.routing_policy: expected Policy"),
        ({"faults": {"decode_step_delay_s": -1}}, "faults.decode_step_delay_s: must be >= 0"),
        ({"prefill": {"tensor_parallel_size": 0}}, "prefill.tensor_parallel_size: must be >= 1, got 0"),
        ({"decode": {"tensor_parallel_size": 2, "cpus": "0-2"}}, "decode.cpus: a set of 3 cpus does not split evenly"),
        ({"decode": {"tensor_parallel_size": 2, "cpus": "0-1", "threads": 2}}, "decode.threads: 2 threads on 1"),
        ({"engine": {"tensor_parallel_timeout_s": 0}}, "engine.tensor_parallel_timeout_s: must be > 0"),
        ({"faults": {"kill": [{"target": "router", "at": "decode", "rank": 1}]}}, "faults.kill: rank: the router"),
        ({"engine": {"backend": "tgi"}}, "engine.backend: must be one of"),
        ({"colocated": {"backend": "tgi"}}, "colocated.backend: must be one of"),
        ({"engine": {"vllm_args": ["enforce_eager"]}}, "engine.vllm_args: expected dict"),
        ({"engine": {"vllm_args": {1: True}}}, "engine.vllm_args: must map"),
        ({"decode": {"backend": "vllm"}}, "decode.backend: prefill runs 'splitserve' and decode 'vllm'"),
        ({"engine": {"backend": "vllm"}, "prefill": {"backend": "splitserve"}}, "prefill.backend: prefill runs"),
    ],
)
def test_errors_name_the_field(raw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        DeploymentConfig.from_dict(raw)


def test_the_vllm_backend_takes_any_tensor_parallel_sizes():
    config = DeploymentConfig.from_dict(
        {"engine": {"backend": "vllm"}, "prefill": {"tensor_parallel_size": 2}, "decode": {"tensor_parallel_size": 1}}
    )
    assert config.engine_config("m", "prefill").tensor_parallel_size == 2
    assert config.engine_config("m", "prefill").backend == "vllm"
    colocated = DeploymentConfig.from_dict(
        {"mode": "colocated", "colocated": {"backend": "vllm", "tensor_parallel_size": 2}}
    )
    assert colocated.engine_config("m", "colocated").tensor_parallel_size == 2


CONFIGS = Path(__file__).resolve().parent.parent / "cluster_configs"


def test_local_yaml_is_the_embedded_default_and_names_every_setting():
    assert DeploymentConfig.from_file(CONFIGS / "local.yaml") == DeploymentConfig()
    raw = yaml.safe_load((CONFIGS / "local.yaml").read_text())

    def names(cls, prefix=""):
        for f in fields(cls):
            default = getattr(cls(), f.name)
            yield from names(type(default), f"{prefix}{f.name}.") if is_dataclass(default) else [f"{prefix}{f.name}"]

    def present(path):
        node = raw
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    missing = [name for name in names(DeploymentConfig) if not present(name)]
    assert not missing, f"local.yaml must document every setting; missing {missing}"


@pytest.mark.parametrize("name", ["gpu-cluster.yaml", "gpu-cluster-70b.yaml", "onprem-cpu.yaml"])
def test_cluster_deployment_examples_load(name):
    config = DeploymentConfig.from_file(CONFIGS / name)
    assert config.ray_address == "auto" and config.host == "0.0.0.0"
    assert config.prefill.replicas >= 1 and config.decode.replicas >= 1
    if config.device == "cuda":
        assert config.prefill.num_gpus == config.decode.num_gpus == 1


def test_metrics_and_log_settings_reach_the_router_and_every_worker():
    from splitserve.deploy.deployment import Deployment

    off = Deployment(DeploymentConfig(model="m"))
    assert off.config.router_config("m").metrics_port is None
    assert off.fleet.worker_config("decode", "decode-0").metrics_port is None
    on = Deployment(
        DeploymentConfig.from_dict(
            {"model": "m", "metrics_port": 9400, "metrics_host": "10.0.0.5", "log_format": "json"}
        )
    )
    router = on.config.router_config("m")
    assert (router.metrics_port, router.metrics_host) == (9400, "10.0.0.5")
    for role in ("prefill", "decode"):
        worker = on.fleet.worker_config(role, f"{role}-0")
        assert (worker.metrics_port, worker.log_format) == (0, "json")  # workers: a free port each


def test_the_engine_backend_is_the_roles_own_else_the_engine_sections():
    config = DeploymentConfig.from_dict({"mode": "colocated", "colocated": {"backend": "vllm"}})
    assert config.engine_config("m", "colocated").backend == "vllm"
    assert DeploymentConfig.from_dict({"mode": "colocated"}).engine_config("m", "colocated").backend == "splitserve"
    both = DeploymentConfig.from_dict({"mode": "colocated", "engine": {"backend": "vllm"}})
    assert both.engine_config("m", "colocated").backend == "vllm"
    # --backend sets every role's, over a role's own.
    flag = DeploymentConfig.from_dict({"mode": "colocated", "colocated": {"backend": "vllm"}})
    assert flag.with_overrides(backend="splitserve").engine_config("m", "colocated").backend == "splitserve"
    disaggregated = DeploymentConfig.from_dict({"engine": {"backend": "vllm"}})
    assert {disaggregated.engine_config("m", r).backend for r in ("prefill", "decode")} == {"vllm"}


def test_linear_kernel_settings_reach_every_worker():
    from splitserve.deploy.deployment import Deployment

    engine = {"linear_kernel": "split", "linear_split_allowed": False}
    deployment = Deployment(DeploymentConfig.from_dict({"model": "m", "engine": engine}))
    for role in ("prefill", "decode"):
        config = deployment.fleet.worker_config(role, f"{role}-0").engine
        assert (config.linear_kernel, config.linear_split_allowed) == ("split", False)


def test_max_model_len_and_the_prefix_cache_reach_every_worker_and_decode_never_caches():
    from splitserve.deploy.deployment import Deployment

    def engines(engine: dict) -> dict:
        deployment = Deployment(DeploymentConfig.from_dict({"model": "m", "engine": engine}))
        return {role: deployment.fleet.worker_config(role, f"{role}-0").engine for role in ("prefill", "decode")}

    default = engines({})
    assert [(c.max_model_len, c.enable_prefix_caching) for c in default.values()] == [(None, True), (None, False)]
    off = engines({"max_model_len": 2048, "enable_prefix_caching": False})
    assert [(c.max_model_len, c.enable_prefix_caching) for c in off.values()] == [(2048, False), (2048, False)]
    with pytest.raises(ConfigError, match="engine.max_model_len"):
        DeploymentConfig.from_dict({"model": "m", "engine": {"max_model_len": 0}})


def test_scale_past_the_cpu_sets_is_refused_naming_the_field():
    import asyncio

    from splitserve.deploy.deployment import Deployment

    deployment = Deployment(DeploymentConfig.from_dict({"model": "/m", "decode": {"cpus": "0|1", "replicas": 2}}))
    with pytest.raises(ValueError, match=r"decode\.cpus: 2 cpu sets bind at most 2 decode workers, not 3"):
        asyncio.run(deployment.scale({"decode": 3}))


def test_dtype_takes_vllms_names_and_keeps_the_canonical_one():
    assert DeploymentConfig.from_dict({"dtype": "bf16"}).dtype == "bfloat16"
    assert DeploymentConfig.from_dict({"dtype": "half"}).dtype == "float16"
    assert DeploymentConfig().with_overrides(dtype="fp32").dtype == "float32"
    assert DeploymentConfig().dtype == "auto"
    with pytest.raises(ConfigError, match="dtype: 'int8'"):
        DeploymentConfig.from_dict({"dtype": "int8"})


def test_a_section_keeps_its_own_defaults_for_the_keys_it_leaves_out():
    config = DeploymentConfig.from_dict({"decode": {"replicas": 2}, "colocated": {"threads": 1}})
    assert (config.decode.replicas, config.decode.max_inflight) == (2, DeploymentConfig().decode.max_inflight)
    assert config.decode.max_inflight != config.prefill.max_inflight  # each role's own default, not RoleConfig's
    assert config.colocated.max_inflight == DeploymentConfig().colocated.max_inflight


def test_a_tensor_parallel_worker_splits_its_cpus_and_gives_each_rank_its_faults():
    from splitserve.deploy.deployment import Deployment

    config = DeploymentConfig.from_dict(
        {
            "model": "m",
            "prefill": {"tensor_parallel_size": 2, "cpus": "0-3|4-7", "replicas": 2},
            "decode": {"tensor_parallel_size": 4},
            "faults": {"kill": [{"target": "prefill-1", "at": "prefill", "after": 2, "rank": 1}]},
        }
    )
    p = config.prefill
    assert [p.cpu_set(1, rank) for rank in (0, 1)] == [(4, 5), (6, 7)]
    assert (p.worker_threads(1), p.worker_num_cpus(1)) == (2, 2.0), "threads and Ray CPUs are per rank"
    worker = Deployment(config).fleet.worker_config("prefill", "prefill-1", slot=1)
    engine = worker.engine
    assert (engine.tensor_parallel_size, engine.tensor_parallel_rank, engine.tensor_parallel_step) == (2, 0, "plan")
    assert worker.cpus == (4, 5) and worker.faults.die_at == ""
    (rank1,) = worker.follower_ranks
    assert rank1.cpus == (6, 7) and (rank1.faults.die_at, rank1.faults.die_after) == ("prefill", 2)
    follower = worker.for_rank(1)
    assert (follower.engine.tensor_parallel_rank, follower.cpus, follower.faults.die_at) == (1, (6, 7), "prefill")
    assert worker.restarted().for_rank(1).faults.die_at == "", "a restarted worker's ranks run clean"
    with pytest.raises(ValueError, match="^rank: must be 1 to 1"):
        worker.for_rank(2)
    decode = Deployment(config).fleet.worker_config("decode", "decode-0")
    assert len(decode.follower_ranks) == 3 and decode.engine.tensor_parallel_step == "plan"
    plain = Deployment(config).fleet.worker_config("decode", "decode-0")
    assert DeploymentConfig().engine_config("m", "decode").tensor_parallel_step == "lockstep"
    assert plain.engine.tensor_parallel_timeout_s == 10.0


def test_tensor_parallel_sizes_are_checked_against_the_model_by_name(tiny_model_dir):
    """The tiny preset has 4 attention heads, 2 KV heads and an MLP of 128 columns."""
    DeploymentConfig.from_dict({"prefill": {"tensor_parallel_size": 4}}).check_model(str(tiny_model_dir))
    with pytest.raises(ConfigError, match=r"^decode\.tensor_parallel_size: 3 does not divide the model's 4 attention"):
        DeploymentConfig.from_dict({"decode": {"tensor_parallel_size": 3}}).check_model(str(tiny_model_dir))
    with pytest.raises(ConfigError, match=r"^colocated\.tensor_parallel_size: 8 does not divide"):
        DeploymentConfig.from_dict({"mode": "colocated", "colocated": {"tensor_parallel_size": 8}}).check_model(
            str(tiny_model_dir)
        )


def test_serve_device_cuda_with_a_role_at_zero_gpus_is_refused_by_name(tmp_path, capsys):
    """``splitserve serve --device cuda`` on a config whose decode reserves 0 GPUs stops before Ray starts,
    naming the field."""
    from splitserve.cli import main

    config = tmp_path / "deployment.yaml"
    config.write_text("decode:\n  num_gpus: 0\n")
    assert main(["serve", "--config", str(config), "--device", "cuda"]) == 2
    assert "decode.num_gpus: 0 with device 'cuda'" in capsys.readouterr().err
