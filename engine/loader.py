"""Load a Hugging Face safetensors checkpoint (single file or sharded) into ``CausalLM``.

Checkpoint tensors are copied, with dtype conversion, into slices of our fused parameters
(q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``). Every parameter element must be written
exactly once; a missing, unexpected or misshapen tensor is an error naming it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from splitserve.engine.linear_tuner import KernelPolicy, apply_kernels
from splitserve.engine.model import CausalLM
from splitserve.engine.model_config import ModelConfig

# The names --dtype accepts (vLLM's) -> the canonical name kept in configs, status and logs.
DTYPE_NAMES = {
    "auto": "auto",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """The checkpoint folder is incomplete or does not match config.json (the message names what)."""


def canonical_dtype(name: str) -> str:
    """Any name in DTYPE_NAMES (case-insensitive) -> its canonical name: "bf16" -> "bfloat16", "auto" -> "auto"."""
    canonical = DTYPE_NAMES.get(name.strip().lower()) if isinstance(name, str) else None
    if canonical is None:
        raise ValueError(f"dtype: {name!r} is not supported (use {', '.join(DTYPE_NAMES)})")
    return canonical


def parse_dtype(name: str | torch.dtype, checkpoint_dtype: str | None = None) -> torch.dtype:
    """Any name in DTYPE_NAMES; 'auto' takes the checkpoint's own dtype (float32 when it names none)."""
    if isinstance(name, torch.dtype):
        return name
    canonical = canonical_dtype(name)
    if canonical == "auto":
        return _DTYPES.get(DTYPE_NAMES.get(str(checkpoint_dtype).lower(), ""), torch.float32)
    return _DTYPES[canonical]


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    elif single.is_file():
        files = [single]
    else:
        raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: shard named in the index is missing")
    return files


def _target(model: CausalLM, cfg: ModelConfig, name: str) -> tuple[torch.Tensor, int, int] | None:
    """(parameter, first row, row count) that the checkpoint tensor ``name`` fills, or None to skip."""
    if name == "model.embed_tokens.weight":
        return model.embed_tokens.weight, 0, cfg.vocab_size
    if name == "model.norm.weight":
        return model.norm.weight, 0, cfg.hidden_size
    if name == "lm_head.weight":
        return None if model.lm_head is None else (model.lm_head.weight, 0, cfg.vocab_size)
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) >= cfg.num_layers:
        raise CheckpointError(f"unexpected tensor {name!r} in checkpoint")
    layer = model.layers[int(m.group(1))]
    rest = m.group(2)
    attn, mlp = layer.self_attn, layer.mlp
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    table = {
        "self_attn.q_proj": (attn.qkv_proj, 0, q),
        "self_attn.k_proj": (attn.qkv_proj, q, kv),
        "self_attn.v_proj": (attn.qkv_proj, q + kv, kv),
        "self_attn.o_proj": (attn.o_proj, 0, cfg.hidden_size),
        "mlp.gate_proj": (mlp.gate_up_proj, 0, inter),
        "mlp.up_proj": (mlp.gate_up_proj, inter, inter),
        "mlp.down_proj": (mlp.down_proj, 0, cfg.hidden_size),
    }
    module_name, _, kind = rest.rpartition(".")
    if rest == "input_layernorm.weight":
        return layer.input_layernorm.weight, 0, cfg.hidden_size
    if rest == "post_attention_layernorm.weight":
        return layer.post_attention_layernorm.weight, 0, cfg.hidden_size
    if module_name in table and kind in ("weight", "bias"):
        module, start, rows = table[module_name]
        param = getattr(module, kind)
        if param is None:
            raise CheckpointError(f"{name}: checkpoint has a bias that config.json does not declare")
        return param, start, rows
    raise CheckpointError(f"unexpected tensor {name!r} in checkpoint")


@torch.no_grad()
def load_weights(model: CausalLM, model_dir: str | Path) -> str:
    """Fill every parameter of ``model`` from the checkpoint; returns a weights checksum (hex).

    The checksum hashes every tensor's name, shape, dtype and bytes as stored on disk, in name order
    (whatever the sharding), so two workers agree on it exactly when they serve the same weights.
    """
    cfg = model.config
    written = {id(p): torch.zeros(p.shape[0], dtype=torch.int32) for p in model.parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    tensor_digests: list[tuple[str, bytes]] = []
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in sorted(f.keys()):
                if _IGNORED.search(name):
                    continue
                tensor = f.get_tensor(name)
                digest = hashlib.blake2b(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode(), digest_size=16)
                digest.update(memoryview(tensor.contiguous().view(torch.uint8).numpy()))
                tensor_digests.append((name, digest.digest()))
                target = _target(model, cfg, name)
                if target is None:
                    continue
                param, start, rows = target
                expected = (rows, *param.shape[1:])
                if tuple(tensor.shape) != expected:
                    raise CheckpointError(f"{name}: shape {tuple(tensor.shape)} != expected {expected}")
                param[start : start + rows].copy_(tensor)
                written[id(param)][start : start + rows] += 1
    for p in model.parameters():
        count = written[id(p)]
        if not torch.all(count == 1):
            what = "missing from" if torch.any(count == 0) else "written twice in"
            raise CheckpointError(f"weights for {names[id(p)]} are {what} the checkpoint")
    total = hashlib.blake2b(digest_size=16)
    for _, d in sorted(tensor_digests):
        total.update(d)
    return total.hexdigest()


def build_model(
    cfg: ModelConfig,
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    kernels: KernelPolicy | None = None,
) -> tuple[CausalLM, str]:
    """Construct without random init (meta device), allocate on ``device``, load; returns (model, checksum).

    ``kernels`` says which kernel each linear layer runs (``splitserve.engine.linear_tuner``: timed per shape at
    ``auto``, the default); the checksum is of the weights as loaded, before any repacking.
    """
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)
    checksum = load_weights(model, model_dir)
    model.init_rotary(device, dtype)
    apply_kernels(model, kernels or KernelPolicy())
    model.eval()
    model.requires_grad_(False)
    return model, checksum
