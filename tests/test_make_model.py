"""make-model checkpoints: what transformers 5 (offline) loads from them, tokenizer layout, determinism."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer

from splitserve.engine.model.config import ModelConfig
from splitserve.tools.bpe_tokenizer import corpus_texts, train_tokenizer
from splitserve.tools.make_model import DEFAULT_SHARD_BYTES, PRESETS, make_model, write_random_checkpoint
from splitserve.tools.random_weights import _pack_shards, random_weights, tensor_shapes

# Qwen/Qwen2.5-0.5B's config.json (the base model: bos = eos = <|endoftext|>), less the keys that vary.
QWEN25_05B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN25_CONFIG_KEYS = {*QWEN25_05B_CONFIG, "max_window_layers", "sliding_window", "torch_dtype", "transformers_version"}
# meta-llama/Llama-3.1-8B's config.json as published.
LLAMA31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}
PROMPTS = [
    "Hello, how are you?",
    "The capital of France is",
    "def main():",
    "Once upon a time",
    "Write a poem about the sea.",
    "x = [i for i in range(10)]",
]


def make_llama_config(**overrides) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 2048,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3_SCALING,
        "attention_bias": True,
        "tie_word_embeddings": False,
    }
    return {**config, **overrides}


def make_mistral_config(**overrides) -> dict:
    config = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 2048,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 48,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 16,
        "tie_word_embeddings": False,
    }
    return {**config, **overrides}


ARCH_CONFIGS = {"qwen2": PRESETS["tiny"], "llama": make_llama_config(), "mistral": make_mistral_config()}


@pytest.fixture(scope="module", autouse=True)
def offline_hub():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once, at import
        yield


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("tiny", tmp_path_factory.mktemp("tiny"), dtype="float32")


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("arch")
    return {
        "qwen2": tiny_dir,
        **{name: write_random_checkpoint(root / name, ARCH_CONFIGS[name]) for name in ("llama", "mistral")},
    }


def load_hf_model(path: Path) -> transformers.PreTrainedModel:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(key) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def logits_of(path: Path, num_tokens: int = 48) -> torch.Tensor:
    input_ids = torch.randint(0, 2045, (1, num_tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return load_hf_model(path)(input_ids).logits


def test_qwen25_preset_has_the_published_shapes_and_ids():
    config = PRESETS["qwen2.5-0.5b"]
    assert {k: config[k] for k in QWEN25_05B_CONFIG} == QWEN25_05B_CONFIG
    num_params = sum(math.prod(shape) for shape in tensor_shapes(config).values())
    assert num_params == 494_032_768  # Qwen2.5-0.5B: "0.49B", tied embeddings
    for name in ("tiny", "small", "qwen2.5-0.5b"):
        assert set(PRESETS[name]) == QWEN25_CONFIG_KEYS, name
    for name in ("tiny", "small"):  # special tokens at the top ids, bos = eos = <|endoftext|>
        assert PRESETS[name]["bos_token_id"] == PRESETS[name]["eos_token_id"] == PRESETS[name]["vocab_size"] - 3


def test_llama31_8b_preset_is_the_published_config():
    config = PRESETS["llama3.1-8b"]
    assert config == LLAMA31_8B_CONFIG
    num_params = sum(math.prod(shape) for shape in tensor_shapes(config).values())
    assert num_params == 8_030_261_248  # Llama-3.1-8B, untied head
    engine_config = ModelConfig.from_dict(config)
    assert (engine_config.num_layers, engine_config.num_kv_heads, engine_config.head_dim) == (32, 8, 128)
    assert engine_config.rope.rope_type == "llama3"
    # Written as 4 shards of at most 5 GB, as published (sizes from meta tensors: nothing is allocated).
    shapes = tensor_shapes(config)
    meta = {name: torch.empty(shape, dtype=torch.bfloat16, device="meta") for name, shape in shapes.items()}
    assert len(_pack_shards(meta, DEFAULT_SHARD_BYTES["llama3.1-8b"])) == 4


def test_config_only_writes_no_weights(tmp_path: Path):
    path = make_model("tiny", tmp_path, config_only=True)
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = transformers.AutoConfig.from_pretrained(path)
    assert (config.hidden_size, config.vocab_size) == (PRESETS["tiny"]["hidden_size"], PRESETS["tiny"]["vocab_size"])


def test_tiny_checkpoint_files(tiny_dir: Path):
    assert sorted(p.name for p in tiny_dir.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((tiny_dir / "config.json").read_text())
    assert set(config) == QWEN25_CONFIG_KEYS
    assert config["torch_dtype"] == "float32" and config["sliding_window"] is None
    assert json.loads((tiny_dir / "generation_config.json").read_text()) == {
        "bos_token_id": 2045,
        "do_sample": False,
        "eos_token_id": [2047, 2045],
        "pad_token_id": 2045,
        "transformers_version": "4.43.1",
    }
    with safe_open(tiny_dir / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert "lm_head.weight" not in f.keys()


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral"])
def test_transformers_loads_the_same_parameter_values(arch: str, arch_dirs: dict[str, Path]):
    model = load_hf_model(arch_dirs[arch])
    assert type(model).__name__ == ARCH_CONFIGS[arch]["architectures"][0]
    saved = load_file(arch_dirs[arch] / "model.safetensors")
    params = dict(model.named_parameters(remove_duplicate=False))
    assert set(params) == set(saved) | ({"lm_head.weight"} if arch == "qwen2" else set())
    for name, tensor in saved.items():
        assert torch.equal(params[name].detach(), tensor), name
    if arch == "qwen2":
        assert torch.equal(params["lm_head.weight"], saved["model.embed_tokens.weight"])
        assert "model.layers.0.self_attn.q_proj.bias" in saved and "model.layers.0.self_attn.o_proj.bias" not in saved
    if arch == "llama":  # attention_bias: all four projections
        assert all(f"model.layers.1.self_attn.{p}_proj.bias" in saved for p in "qkvo")
    if arch == "mistral":  # explicit head_dim 48 != 128 / 4
        assert saved["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 48, 128)
        assert model.config.sliding_window == 16


def test_random_tensors_are_contiguous_and_do_not_share_storage():
    for config in (PRESETS["tiny"], {**make_llama_config(), "model_type": "llama"}):
        tensors = random_weights(config, torch.bfloat16, seed=0)
        assert all(t.is_contiguous() and t.dtype == torch.bfloat16 for t in tensors.values())
        assert len({t.untyped_storage().data_ptr() for t in tensors.values()}) == len(tensors)


@pytest.mark.parametrize(
    "scaling",
    [
        LLAMA3_SCALING,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        {"type": "linear", "factor": 2.0},
    ],
    ids=["llama3", "yarn", "linear"],
)
def test_legacy_and_current_config_forms_give_identical_rope(scaling: dict, tmp_path: Path):
    config = make_llama_config(rope_scaling=scaling)
    legacy = write_random_checkpoint(tmp_path / "legacy", config, config_format="legacy")
    current = write_random_checkpoint(tmp_path / "current", config, config_format="current")
    unscaled = write_random_checkpoint(tmp_path / "unscaled", {**config, "rope_scaling": None})

    legacy_json = json.loads((legacy / "config.json").read_text())
    current_json = json.loads((current / "config.json").read_text())
    assert legacy_json["rope_theta"] == 500000.0 and "rope_parameters" not in legacy_json
    assert "rope_theta" not in current_json and "rope_scaling" not in current_json
    rope_type = scaling.get("rope_type") or scaling["type"]
    assert legacy_json["rope_scaling"]["rope_type"] == current_json["rope_parameters"]["rope_type"] == rope_type
    assert current_json["rope_parameters"]["rope_theta"] == 500000.0

    models = {
        name: load_hf_model(path) for name, path in [("legacy", legacy), ("current", current), ("unscaled", unscaled)]
    }
    assert models["legacy"].config.rope_parameters == models["current"].config.rope_parameters
    inv_freqs = {name: m.model.rotary_emb.inv_freq for name, m in models.items()}
    assert torch.equal(inv_freqs["legacy"], inv_freqs["current"])
    assert not torch.equal(inv_freqs["legacy"], inv_freqs["unscaled"])  # the scaling really is applied
    assert torch.equal(logits_of(legacy), logits_of(current))


def test_sharded_checkpoint_matches_unsharded(tiny_dir: Path, tmp_path: Path):
    max_shard_bytes = 1_000_000  # the fp32 embedding (1 MiB) is over it: a shard of its own
    sharded = make_model("tiny", tmp_path / "sharded", dtype="float32", max_shard_bytes=max_shard_bytes)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_files = sorted({*index["weight_map"].values()})
    assert len(shard_files) >= 3
    num_shards = len(shard_files)
    assert shard_files == [f"model-{k:05d}-of-{num_shards:05d}.safetensors" for k in range(1, num_shards + 1)]
    assert not (sharded / "model.safetensors").exists()

    unsharded = load_file(tiny_dir / "model.safetensors")
    assert set(index["weight_map"]) == set(unsharded)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in unsharded.values())
    for file_name in shard_files:
        shard = load_file(sharded / file_name)
        assert {n for n, f in index["weight_map"].items() if f == file_name} == set(shard)
        assert len(shard) == 1 or sum(t.numel() * t.element_size() for t in shard.values()) <= max_shard_bytes
        assert all(torch.equal(t, unsharded[n]) for n, t in shard.items())
    assert torch.equal(logits_of(sharded), logits_of(tiny_dir))


def test_every_id_decodes_and_specials_sit_at_the_top(tiny_dir: Path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    vocab_size = PRESETS["tiny"]["vocab_size"]
    assert len(tokenizer) == vocab_size
    assert all(tokenizer.decode([i], skip_special_tokens=False) for i in range(vocab_size))
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [2045, 2046, 2047]
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert all(tokenizer.added_tokens_decoder[i].special for i in (2045, 2046, 2047))

    ours = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    texts = [*corpus_texts()[:100], "héllo wörld 你好 🙂", "<|im_start|>user\nHi<|im_end|>\n"]
    assert [tokenizer(t).input_ids for t in texts] == [ours.encode(t).ids for t in texts]
    assert tokenizer("<|im_start|>user").input_ids[0] == 2046  # special tokens are not split


def test_chat_template_renders_chatml(tiny_dir: Path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "user", "content": "Hi there"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    text = tokenizer.apply_chat_template(with_system, tokenize=False, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"


def test_qwen_layout_keeps_real_special_ids_and_pads_above_them(tmp_path: Path):
    tokenizer = train_tokenizer(151936, first_special_id=151643)
    assert tokenizer.get_vocab_size() == 151936
    special_ids = [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert special_ids == [151643, 151644, 151645]  # Qwen2.5's
    decoded = tokenizer.decode_batch([[i] for i in range(151936)], skip_special_tokens=False)
    assert all(decoded)  # not all distinct: each lone byte 0x80-0xff decodes to U+FFFD
    assert tokenizer.encode("<|im_end|>").ids == [151645]

    # The preset's ids end up in the files (shrunk to one narrow layer: the real one is ~1 GB).
    narrow = {
        **PRESETS["qwen2.5-0.5b"],
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    path = write_random_checkpoint(tmp_path, narrow, dtype="bfloat16", tokenizer=tokenizer)
    config = json.loads((path / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (151643, 151643)
    generation_config = json.loads((path / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == [151645, 151643]


def shortest_loop(tokens: list[int], max_period: int = 4, repeats: int = 3) -> int | None:
    """The smallest period p <= max_period with which `tokens` ends in `repeats` identical blocks."""
    for period in range(1, max_period + 1):
        tail = tokens[-period * repeats :]
        if len(tail) == period * repeats and tail == tail[:period] * repeats:
            return period
    return None


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral"])
def test_greedy_generation_is_not_degenerate(arch: str, arch_dirs: dict[str, Path]):
    """Random weights must give varied, prompt-dependent output with clear argmaxes (parity tests rely on it)."""
    model = load_hf_model(arch_dirs[arch])
    tokenizer = transformers.AutoTokenizer.from_pretrained(arch_dirs[arch])
    outputs, gaps = [], []
    for prompt in PROMPTS:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            result = model.generate(
                input_ids,
                max_new_tokens=40,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        new_tokens = result.sequences[0, input_ids.shape[1] :].tolist()
        assert len(new_tokens) == 40
        assert len(set(new_tokens)) >= 8, (prompt, new_tokens)
        assert shortest_loop(new_tokens[:32]) is None, (prompt, new_tokens)
        outputs.append(tuple(new_tokens))
        gaps += [float(top[0] - top[1]) for top in (torch.topk(s[0], 2).values for s in result.scores)]
    assert len(set(outputs)) == len(PROMPTS)
    assert sorted(gaps)[len(gaps) // 2] > 0.1
    assert sum(gap < 1e-3 for gap in gaps) <= 0.02 * len(gaps)


def test_same_seed_gives_identical_files_and_another_seed_other_weights(tmp_path: Path):
    first = make_model("tiny", tmp_path / "a", seed=7)
    second = make_model("tiny", tmp_path / "b", seed=7)
    other = make_model("tiny", tmp_path / "c", seed=8)
    for path in first.iterdir():
        assert path.read_bytes() == (second / path.name).read_bytes(), path.name
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    a, c = load_file(first / "model.safetensors"), load_file(other / "model.safetensors")
    assert all(not torch.equal(a[name], c[name]) for name in a)


def test_tokenizer_training_is_deterministic_across_processes():
    """Another hash seed, no transformers imported, single-threaded: the same tokenizer.json."""
    script = (
        "import sys; from splitserve.tools.bpe_tokenizer import train_tokenizer as t;"
        " sys.stdout.write(t(2048).to_str())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "TOKENIZERS_PARALLELISM": "false"}
    other_process = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert other_process.stdout == train_tokenizer(2048).to_str()


@pytest.mark.parametrize("alias, name", [("bf16", "bfloat16"), ("half", "float16"), ("float", "float32")])
def test_dtype_aliases(alias: str, name: str, tmp_path: Path):
    path = make_model("tiny", tmp_path, dtype=alias, config_format="current")
    config = json.loads((path / "config.json").read_text())
    assert config["dtype"] == name and "torch_dtype" not in config
    assert load_file(path / "model.safetensors")["model.norm.weight"].dtype == getattr(torch, name)


def test_errors_name_the_offending_value(tmp_path: Path):
    with pytest.raises(ValueError, match="tiny, small, qwen2.5-0.5b"):
        make_model("huge", tmp_path / "x")
    with pytest.raises(ValueError, match="'int8'"):
        make_model("tiny", tmp_path / "x", dtype="int8")
    with pytest.raises(ValueError, match="architectures"):
        write_random_checkpoint(tmp_path / "x", {**make_llama_config(), "architectures": ["GPT2LMHeadModel"]})
    assert not (tmp_path / "x").exists()

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        make_model("tiny", tmp_path / "full")


def test_overwrite_replaces_a_sharded_checkpoint(tmp_path: Path):
    make_model("tiny", tmp_path, max_shard_bytes=200_000)
    (tmp_path / "notes.txt").write_text("keep me")
    make_model("tiny", tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "notes.txt",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
