"""The model's shape, read from a Hugging Face ``config.json``; torch-free.

Reads both forms of ``config.json`` in circulation: the older one most published checkpoints carry
(top-level ``rope_theta`` plus an optional ``rope_scaling`` dict with ``type`` or ``rope_type``) and
the newer one current transformers writes (a ``rope_parameters`` dict holding ``rope_type``,
``rope_theta`` and the scaling keys). Anything we cannot run faithfully is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: HF architecture name -> our model family.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_DEFAULT_ROPE_THETA = 10000.0


class ModelConfigError(ValueError):
    """config.json names something we cannot run, or lacks a field we need (named in the message)."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings, normalised from either config form."""

    rope_type: str = "default"
    theta: float = _DEFAULT_ROPE_THETA
    factor: float | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    attention_factor: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json in the model folder")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(f"architectures: {archs!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
        family = ARCHITECTURES[arch]
        hidden = _req(raw, "hidden_size", int)
        heads = _req(raw, "num_attention_heads", int)
        kv_heads = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or hidden // heads
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"hidden_act: {act!r} is not supported (only 'silu')")
        if heads % kv_heads:
            raise ModelConfigError(f"num_key_value_heads: {kv_heads} does not divide num_attention_heads {heads}")
        num_layers = _req(raw, "num_hidden_layers", int)
        max_pos = int(raw.get("max_position_embeddings", 4096))
        attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            family=family,
            vocab_size=_req(raw, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=_req(raw, "intermediate_size", int),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=attention_bias if family == "llama" else False,
            mlp_bias=bool(raw.get("mlp_bias", False)) if family == "llama" else False,
            rope=_parse_rope(raw, max_pos),
            sliding_windows=_parse_sliding_windows(raw, family, num_layers),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )


def _req(raw: dict[str, Any], key: str, kind: type) -> Any:
    if key not in raw or raw[key] is None:
        raise ModelConfigError(f"{key}: missing from config.json")
    try:
        return kind(raw[key])
    except (TypeError, ValueError):
        raise ModelConfigError(f"{key}: expected {kind.__name__}, got {raw[key]!r}") from None


def _parse_rope(raw: dict[str, Any], max_pos: int) -> RopeConfig:
    if isinstance(raw.get("rope_parameters"), dict):  # current form
        params = dict(raw["rope_parameters"])
        if any(isinstance(v, dict) for v in params.values()):
            raise ModelConfigError("rope_parameters: per-layer-type rope parameters are not supported")
    else:  # older form
        params = dict(raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(f"rope_type: {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelConfigError(f"partial_rotary_factor: {partial} is not supported (only 1.0)")

    def num(key: str) -> float | None:
        v = params.get(key)
        return None if v is None else float(v)

    original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if rope_type in ("llama3", "yarn") and original is None:
        original = max_pos
    rope = RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=num("factor"),
        low_freq_factor=num("low_freq_factor"),
        high_freq_factor=num("high_freq_factor"),
        original_max_position_embeddings=None if original is None else int(original),
        beta_fast=num("beta_fast"),
        beta_slow=num("beta_slow"),
        attention_factor=num("attention_factor"),
        mscale=num("mscale"),
        mscale_all_dim=num("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
    for key in needed.get(rope_type, ()):
        if getattr(rope, key) is None:
            raise ModelConfigError(f"rope_scaling.{key}: required for rope_type {rope_type!r}")
    return rope


def _parse_sliding_windows(raw: dict[str, Any], family: str, num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if family == "qwen2" and not raw.get("use_sliding_window", False):
        window = None
    if family == "llama":
        window = None
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ModelConfigError(f"layer_types: {len(layer_types)} entries for {num_layers} layers")
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ModelConfigError(f"layer_types: {sorted(unknown)} not supported")
        if window is None:
            return (None,) * num_layers
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if window is None:
        return (None,) * num_layers
    if family == "qwen2":
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    return (int(window),) * num_layers
