"""Shared fixtures: random-weight checkpoints written once per test session.

`--device` selects where engine tests run (cpu by default; `scripts/gpu_check.sh` passes cuda).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.serving.netstat import listening_sockets

# Ray reads this when it is imported: every Ray the tests start binds and advertises 127.0.0.1 only.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines built by tests (and the workers they start) keep their linear-kernel timings here, not in ~/.cache.
os.environ.setdefault(
    "SPLITSERVE_KERNEL_CACHE", str(Path(tempfile.gettempdir()) / f"splitserve-test-linear-kernels-{os.getuid()}.json")
)

TEST_VOCAB = 2048
_COMMON = {
    "vocab_size": TEST_VOCAB,
    "hidden_size": 128,
    "intermediate_size": 384,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}

# One small config per supported architecture, each exercising what is special about it.
ARCH_CONFIGS: dict[str, dict] = {
    # Qwen2: qkv bias, tied embeddings, a sliding-window layer above max_window_layers.
    "qwen2": {
        **_COMMON,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "use_sliding_window": True,
        "sliding_window": 24,
        "max_window_layers": 1,
    },
    # Llama 3: llama3 rope scaling, multi-query attention, untied head.
    "llama": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    # Mistral: sliding window on every layer, explicit head_dim different from hidden / heads.
    "mistral": {
        **_COMMON,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 48,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "sliding_window": 24,
    },
}


# The same architectures at sizes where every projection and the LM head reach
# splitserve.engine.model.transformer.can_pack's 2^18-weight floor (o_proj is 512 x 512 = 2^18 exactly;
# Mistral's is 512 x 640), so the fp32 parity runs the prepacked oneDNN path that the benchmarks time, not
# only plain F.linear.
_PACKABLE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8}
PACKABLE_ARCH_CONFIGS: dict[str, dict] = {
    "qwen2": {**ARCH_CONFIGS["qwen2"], **_PACKABLE, "max_window_layers": 2},
    "llama": {**ARCH_CONFIGS["llama"], **_PACKABLE},
    "mistral": {**ARCH_CONFIGS["mistral"], **_PACKABLE, "head_dim": 80},
}
# Gentler than make_model's defaults (QK_GAIN 3, RESIDUAL_GAIN 6), whose sharp attention makes these deeper
# models chaotic: one bf16 rounding in an attention score then moves logits by ~0.5, transformers-bf16
# lands 13-17% (relative L2) from its own fp32 logits, and a bf16 comparison becomes a bitwise one. With
# these, transformers-bf16 is ~3% from fp32 and greedy outputs stay varied (55+ distinct ids in 64 tokens).
PACKABLE_INIT = {"QK_GAIN": 1.5, "RESIDUAL_GAIN": 3.0}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu", help="device for engine tests: cpu or cuda")


def pytest_configure(config: pytest.Config) -> None:
    # On CPU, Triton kernels (engine/attention/triton_paged_decode.py) run in Triton's interpreter, which must be on
    # before triton is first imported: triton.language defines its own helpers at import time.
    if not config.getoption("--device").startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # scripts/gpu_check.sh sets this: a run its deadline cuts off still shows each failure it met, as it met it.
    if report.failed and os.environ.get("SPLITSERVE_REPORT_FAILURES_AT_ONCE") == "1":
        print(f"\n--- FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n", flush=True)


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--device")


@pytest.fixture(scope="session")
def test_tokenizer():
    from splitserve.tools.make_model import train_tokenizer

    return train_tokenizer(TEST_VOCAB)


@pytest.fixture(scope="session")
def arch_model_dirs(tmp_path_factory: pytest.TempPathFactory, test_tokenizer) -> dict[str, Path]:
    """fp32 checkpoints of every supported architecture, sharing one tokenizer."""
    from splitserve.tools.make_model import write_random_checkpoint

    root = tmp_path_factory.mktemp("arch-models")
    return {
        name: write_random_checkpoint(root / name, cfg, dtype="float32", seed=7, tokenizer=test_tokenizer)
        for name, cfg in ARCH_CONFIGS.items()
    }


@pytest.fixture(scope="session")
def packable_model_dirs(tmp_path_factory: pytest.TempPathFactory, test_tokenizer) -> dict[str, Path]:
    """fp32 checkpoints of PACKABLE_ARCH_CONFIGS (init gains PACKABLE_INIT), sharing one tokenizer."""
    from splitserve.tools import random_weights
    from splitserve.tools.make_model import write_random_checkpoint

    root = tmp_path_factory.mktemp("packable-models")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in PACKABLE_INIT.items():
            patch.setattr(random_weights, name, value)
        return {
            name: write_random_checkpoint(root / name, cfg, dtype="float32", seed=7, tokenizer=test_tokenizer)
            for name, cfg in PACKABLE_ARCH_CONFIGS.items()
        }


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset, as `splitserve make-model` writes it, in fp32."""
    from splitserve.tools.make_model import make_model

    return make_model("tiny", tmp_path_factory.mktemp("tiny") / "model", dtype="float32", seed=0)


@pytest.fixture(scope="session")
def ray_session():
    """One embedded Ray for the session (loopback only, private temp folder); deployments start on it."""
    import ray

    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # set above, before Ray loads
    before = listening_sockets()
    temp_dir = tempfile.mkdtemp(prefix="ss")
    ray.init(
        address="local",
        _temp_dir=temp_dir,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        num_cpus=2,
    )
    yield {"listening_before": before}
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def serving_model(tmp_path_factory):
    """The tiny preset in fp32, with one extra EOS id: the 4th greedy token of EOS_PROMPT, so that a
    request can end on EOS deterministically."""
    from splitserve.engine import LLM, SamplingParams
    from splitserve.tools.make_model import make_model

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
