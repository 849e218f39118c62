"""Random-weight Hugging Face checkpoints (`splitserve make-model`) that our engine and transformers both load.

A checkpoint folder holds config.json, generation_config.json, model.safetensors (or model-0000k-of-0000n
shards plus model.safetensors.index.json), tokenizer.json and tokenizer_config.json. Architectures: Llama,
Qwen2 and Mistral, with HF's tensor names.

Weights come from splitserve.tools.random_weights (an init under which greedy decoding is not degenerate), the
tokenizer from splitserve.tools.bpe_tokenizer (a byte-level BPE trained offline, padded to vocab_size).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer

from splitserve.engine.model.loader import canonical_dtype, parse_dtype
from splitserve.tools.bpe_tokenizer import DEFAULT_SPECIAL_TOKENS, tokenizer_config, train_tokenizer
from splitserve.tools.random_weights import random_weights, write_safetensors

__all__ = ["PRESETS", "make_model", "train_tokenizer", "write_random_checkpoint"]

ConfigFormat = Literal["legacy", "current"]

MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")
# Files a checkpoint may consist of; overwrite=True removes exactly these (plus stale shards).
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _qwen2_preset(
    vocab_size: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    max_positions: int,
    first_special_id: int,
) -> dict:
    """The key set of a published Qwen2.5 config.json; bos = eos = "<|endoftext|>" as in the base models."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": first_special_id,
        "eos_token_id": first_special_id,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_positions,
        "max_window_layers": layers,
        "model_type": "qwen2",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def _llama31_8b_preset() -> dict:
    """meta-llama/Llama-3.1-8B's config.json, every key as published (random weights: about 16 GB in bf16).

    The tokenizer is ours, padded to the same vocab_size with its specials from 128000 (Llama's first
    special id), so bos and eos are both 128000 where Llama's eos is 128001.
    """
    return {
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
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
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


PRESETS: dict[str, dict] = {
    "tiny": _qwen2_preset(2048, 128, 384, 2, 4, 2, 4096, first_special_id=2045),
    "small": _qwen2_preset(32000, 512, 1536, 8, 8, 2, 8192, first_special_id=31997),
    # Qwen2.5-0.5B's shapes and special ids; the tokenizer pads the embedding rows past 151645 with fillers.
    "qwen2.5-0.5b": _qwen2_preset(151936, 896, 4864, 24, 14, 2, 32768, first_special_id=151643),
    # Llama-3.1-8B's shapes, for the GPU benchmarks (scripts/gpu_bench.py).
    "llama3.1-8b": _llama31_8b_preset(),
}
# Presets written as shards by default, at most this many bytes each (as published: Llama-3.1-8B has 4 shards).
DEFAULT_SHARD_BYTES: dict[str, int] = {"llama3.1-8b": 5 * 10**9}


def make_model(
    preset: str,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    seed: int = 0,
    max_shard_bytes: int | None = None,
    config_format: ConfigFormat = "legacy",
    overwrite: bool = False,
    config_only: bool = False,
) -> Path:
    """Writes the named preset with random weights and a freshly trained tokenizer; returns the folder.

    max_shard_bytes defaults to DEFAULT_SHARD_BYTES for the large presets (else one file); config_only
    writes everything but the weights (config, generation config, tokenizer)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    hf_config = PRESETS[preset]
    if max_shard_bytes is None:
        max_shard_bytes = DEFAULT_SHARD_BYTES.get(preset)
    tokenizer = train_tokenizer(hf_config["vocab_size"], first_special_id=hf_config["bos_token_id"])
    return write_random_checkpoint(
        out_dir,
        hf_config,
        dtype=dtype,
        seed=seed,
        max_shard_bytes=max_shard_bytes,
        config_format=config_format,
        tokenizer=tokenizer,
        overwrite=overwrite,
        config_only=config_only,
    )


def write_random_checkpoint(
    out_dir: str | Path,
    hf_config: dict,
    dtype: str = "float32",
    seed: int = 0,
    max_shard_bytes: int | None = None,
    config_format: ConfigFormat = "legacy",
    tokenizer: Tokenizer | None = None,
    overwrite: bool = False,
    config_only: bool = False,
) -> Path:
    """Writes a checkpoint for any Llama/Qwen2/Mistral config dict (rope in either form); returns the folder.

    hf_config is not modified; config_only leaves the weights out. The written config's bos/eos ids are the
    tokenizer's "<|endoftext|>" id; the
    tokenizer (trained here when None) must have vocab_size ids and the three ChatML special tokens.
    """
    torch_dtype = _parse_dtype(dtype)
    if config_format not in ("legacy", "current"):
        raise ValueError(f"config_format must be 'legacy' or 'current', got {config_format!r}")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    config, rope = _validated_config(hf_config), _rope_settings(hf_config)
    if tokenizer is None:
        tokenizer = train_tokenizer(config["vocab_size"])
    special_ids = _special_ids(tokenizer, config["vocab_size"])
    out = _prepare_out_dir(Path(out_dir), overwrite)

    config["bos_token_id"] = config["eos_token_id"] = special_ids["<|endoftext|>"]
    _write_json(out / "config.json", _formatted_config(config, rope, config_format, _dtype_name(torch_dtype)))
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": special_ids["<|endoftext|>"],
            "do_sample": False,
            "eos_token_id": [special_ids["<|im_end|>"], special_ids["<|endoftext|>"]],
            "pad_token_id": special_ids["<|endoftext|>"],
            "transformers_version": config.get("transformers_version", "4.43.1"),
        },
    )
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(tokenizer, config["max_position_embeddings"]))
    if not config_only:
        write_safetensors(out, random_weights(config, torch_dtype, seed), max_shard_bytes)
    return out


def _validated_config(hf_config: dict) -> dict:
    """A copy with model_type and num_key_value_heads filled in and the rope keys (either form) removed."""
    config = dict(hf_config)
    architectures = config.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in MODEL_TYPES:
        raise ValueError(f"architectures must be one of {sorted(MODEL_TYPES)}, got {architectures!r}")
    model_type = MODEL_TYPES[architectures[0]]
    if config.setdefault("model_type", model_type) != model_type:
        raise ValueError(f"model_type {config['model_type']!r} does not match architectures {architectures!r}")
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
    ):
        if not isinstance(config.get(key), int) or config[key] <= 0:
            raise ValueError(f"config field {key!r} must be a positive int, got {config.get(key)!r}")
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ValueError(
            f"num_attention_heads={config['num_attention_heads']} is not a multiple of "
            f"num_key_value_heads={config['num_key_value_heads']}"
        )
    if not config.get("head_dim") and config["hidden_size"] % config["num_attention_heads"]:
        raise ValueError(
            f"hidden_size={config['hidden_size']} is not a multiple of num_attention_heads="
            f"{config['num_attention_heads']}; set head_dim"
        )
    for key in ROPE_KEYS:
        config.pop(key, None)
    return config


def _rope_settings(config: dict) -> dict:
    """Either form (top-level rope_theta/rope_scaling, or rope_parameters) -> {"rope_type", "rope_theta", ...}."""
    scaling = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    theta = scaling.pop("rope_theta", None) or config.get("rope_theta") or 10000.0
    return {"rope_type": rope_type, "rope_theta": float(theta), **scaling}


def _formatted_config(config: dict, rope: dict, config_format: ConfigFormat, dtype_name: str) -> dict:
    config = dict(config)
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    if config_format == "current":
        # As transformers 5 saves: every rope setting in rope_parameters, "dtype" instead of "torch_dtype".
        config["rope_parameters"] = rope
        config["dtype"] = dtype_name
    else:  # as most published checkpoints: transformers 4.x's keys
        config["rope_theta"] = rope["rope_theta"]
        if rope["rope_type"] != "default":
            config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        config["torch_dtype"] = dtype_name
    return dict(sorted(config.items()))


def _special_ids(tokenizer: Tokenizer, vocab_size: int) -> dict[str, int]:
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} ids but vocab_size is {vocab_size}")
    ids = {token: tokenizer.token_to_id(token) for token in DEFAULT_SPECIAL_TOKENS}
    missing = [token for token, token_id in ids.items() if token_id is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens {missing}")
    return ids


def _parse_dtype(dtype: str) -> torch.dtype:
    """Any of vLLM's names but "auto" (bf16, half, float, ...), as --dtype takes them everywhere."""
    if canonical_dtype(dtype) == "auto":
        raise ValueError("unsupported dtype 'auto': a checkpoint is written in bfloat16, float16 or float32")
    return parse_dtype(dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _prepare_out_dir(out: Path, overwrite: bool) -> Path:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} is not empty; pass overwrite=True to replace the checkpoint in it")
        # Only checkpoint files go: a stale shard or index next to a new model.safetensors would confuse loaders.
        for path in [*(out / name for name in CHECKPOINT_FILES), *out.glob("model-*-of-*.safetensors")]:
            path.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
