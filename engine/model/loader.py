"""Load a Hugging Face safetensors checkpoint (single file or sharded) into ``CausalLM``.

Checkpoint tensors are copied, with dtype conversion, into slices of our fused parameters
(q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``). Every parameter element must be written
exactly once; a missing, unexpected or misshapen tensor is an error naming it.

A tensor-parallel rank (``CausalLM.shard``) reads only what it keeps, through safetensors slices: rows
of the column-parallel tensors (its query heads, its KV heads, replicated ones included, and its MLP
rows), columns of the row-parallel weights, and the whole of everything replicated.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.linear_tuner import KernelPolicy, apply_kernels, auto_dtype_comparison
from splitserve.engine.model.transformer import CausalLM
from splitserve.engine.tp.distributed import TPGroup

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
logger = logging.getLogger(__name__)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
# safetensors' dtype names -> torch's, for the checksum of tensors a sharded rank does not materialise.
_STORED_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_HASH_CHUNK = 16 << 20  # bytes read at a time when hashing a stored tensor from the file


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


@dataclass(frozen=True)
class _Target:
    """Where a checkpoint tensor goes: rows ``[start, start + kept rows)`` of ``param``."""

    param: torch.Tensor
    start: int
    shape: tuple[int, ...]  # the checkpoint tensor's whole shape, as config.json implies it
    rows: range | None = None  # the checkpoint rows this rank keeps (column-parallel); None: all
    cols: range | None = None  # the checkpoint columns this rank keeps (row-parallel weights); None: all

    @property
    def num_rows(self) -> int:
        return self.shape[0] if self.rows is None else len(self.rows)


def _target(model: CausalLM, cfg: ModelConfig, name: str) -> _Target | None:
    """Where the checkpoint tensor ``name`` goes in this rank's model, or None to skip it."""
    if name == "model.embed_tokens.weight":
        return _Target(model.embed_tokens.weight, 0, tuple(model.embed_tokens.weight.shape))
    if name == "model.norm.weight":
        return _Target(model.norm.weight, 0, (cfg.hidden_size,))
    if name == "lm_head.weight":
        return None if model.lm_head is None else _Target(model.lm_head.weight, 0, (cfg.vocab_size, cfg.hidden_size))
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) >= cfg.num_layers:
        raise CheckpointError(f"unexpected tensor {name!r} in checkpoint")
    layer = model.layers[int(m.group(1))]
    rest = m.group(2)
    if rest == "input_layernorm.weight":
        return _Target(layer.input_layernorm.weight, 0, (cfg.hidden_size,))
    if rest == "post_attention_layernorm.weight":
        return _Target(layer.post_attention_layernorm.weight, 0, (cfg.hidden_size,))
    shard = model.shard
    attn, mlp = layer.self_attn, layer.mlp
    # Column-parallel: (module, first row in the fused parameter, checkpoint rows, rows this rank keeps).
    column = {
        "self_attn.q_proj": (attn.qkv_proj, 0, cfg.q_size, shard.q_rows()),
        "self_attn.k_proj": (attn.qkv_proj, shard.q_size, cfg.kv_size, shard.kv_rows()),
        "self_attn.v_proj": (attn.qkv_proj, shard.q_size + shard.kv_size, cfg.kv_size, shard.kv_rows()),
        "mlp.gate_proj": (mlp.gate_up_proj, 0, cfg.intermediate_size, shard.intermediate),
        "mlp.up_proj": (mlp.gate_up_proj, shard.intermediate_size, cfg.intermediate_size, shard.intermediate),
    }
    # Row-parallel: (module, checkpoint columns, columns this rank keeps, whether config.json declares a bias).
    row = {
        "self_attn.o_proj": (attn.o_proj, cfg.q_size, shard.q_rows(), cfg.o_bias),
        "mlp.down_proj": (mlp.down_proj, cfg.intermediate_size, shard.intermediate, cfg.mlp_bias),
    }
    module_name, _, kind = rest.rpartition(".")
    if kind not in ("weight", "bias") or (module_name not in column and module_name not in row):
        raise CheckpointError(f"unexpected tensor {name!r} in checkpoint")
    sharded = shard.is_sharded
    if module_name in column:
        module, start, rows, kept = column[module_name]
        param = getattr(module, kind)
        if param is None:
            raise CheckpointError(f"{name}: checkpoint has a bias that config.json does not declare")
        return _Target(param, start, (rows, *param.shape[1:]), rows=kept if sharded else None)
    module, cols, kept, declares_bias = row[module_name]
    param = getattr(module, kind)
    if kind == "bias":
        if param is None and declares_bias:
            return None  # a row-parallel bias lives on rank 0 only: the all-reduce adds it once
        if param is None:
            raise CheckpointError(f"{name}: checkpoint has a bias that config.json does not declare")
        return _Target(param, 0, (cfg.hidden_size,))
    return _Target(param, 0, (cfg.hidden_size, cols), cols=kept if sharded else None)


def _digest(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> hashlib.blake2b:
    return hashlib.blake2b(f"{name}:{shape}:{dtype}".encode(), digest_size=16)


def _stored_digests(path: Path) -> dict[str, bytes]:
    """Each stored tensor's digest, as ``load_weights`` computes it from the tensor, computed here from the
    file's bytes in chunks: a sharded rank hashes what it does not keep without materialising it."""
    digests: dict[str, bytes] = {}
    with open(path, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(header_len))
        base = 8 + header_len
        for name in sorted(header):
            if name == "__metadata__" or _IGNORED.search(name):
                continue
            info = header[name]
            dtype = _STORED_DTYPES.get(info["dtype"])
            if dtype is None:
                raise CheckpointError(f"{name}: stored dtype {info['dtype']} is not supported")
            digest = _digest(name, tuple(info["shape"]), dtype)
            begin, end = info["data_offsets"]
            fh.seek(base + begin)
            remaining = end - begin
            while remaining:
                chunk = fh.read(min(remaining, _HASH_CHUNK))
                if not chunk:
                    raise CheckpointError(f"{path}: truncated inside tensor {name}")
                digest.update(chunk)
                remaining -= len(chunk)
            digests[name] = digest.digest()
    return digests


def _read(f, name: str, target: _Target) -> torch.Tensor:
    """The part of checkpoint tensor ``name`` that ``target`` keeps, shape-checked."""
    if target.rows is None and target.cols is None:
        tensor = f.get_tensor(name)
        _check_shape(name, tuple(tensor.shape), target)
        return tensor
    view = f.get_slice(name)
    _check_shape(name, tuple(view.get_shape()), target)
    if target.rows is not None:
        return view[target.rows.start : target.rows.stop]
    return view[:, target.cols.start : target.cols.stop]


def _check_shape(name: str, shape: tuple[int, ...], target: _Target) -> None:
    if shape != target.shape:
        raise CheckpointError(f"{name}: shape {shape} != expected {target.shape}")


@torch.no_grad()
def load_weights(model: CausalLM, model_dir: str | Path) -> str:
    """Fill every parameter of ``model`` (a rank's shard of it, when sharded) from the checkpoint; returns a
    weights checksum (hex).

    The checksum hashes every stored tensor's name, shape, dtype and bytes as stored on disk, in name
    order (whatever the checkpoint's sharding), so two workers agree on it exactly when they serve the same
    weights, whatever their tensor-parallel sizes: the unsharded model hashes the tensors it reads, a
    sharded rank hashes the same bytes read from the file in chunks (every rank computes it).
    """
    cfg = model.config
    sharded = model.shard.is_sharded
    written = {id(p): torch.zeros(p.shape[0], dtype=torch.int32) for p in model.parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    tensor_digests: list[tuple[str, bytes]] = []
    for path in checkpoint_files(model_dir):
        if sharded:
            tensor_digests.extend(_stored_digests(path).items())
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in sorted(f.keys()):
                if _IGNORED.search(name):
                    continue
                target = _target(model, cfg, name)
                if sharded:
                    tensor = None if target is None else _read(f, name, target)
                else:  # the whole tensor is read anyway: hash it as it is
                    tensor = f.get_tensor(name)
                    digest = _digest(name, tuple(tensor.shape), tensor.dtype)
                    digest.update(memoryview(tensor.contiguous().view(torch.uint8).numpy()))
                    tensor_digests.append((name, digest.digest()))
                    if target is not None:
                        _check_shape(name, tuple(tensor.shape), target)
                if target is None:
                    continue
                rows = target.num_rows
                target.param[target.start : target.start + rows].copy_(tensor)
                written[id(target.param)][target.start : target.start + rows] += 1
    for p in model.parameters():
        count = written[id(p)]
        if not torch.all(count == 1):
            what = "missing from" if torch.any(count == 0) else "written twice in"
            raise CheckpointError(f"weights for {names[id(p)]} are {what} the checkpoint")
    total = hashlib.blake2b(digest_size=16)
    for _, d in sorted(tensor_digests):
        total.update(d)
    return total.hexdigest()


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


FP32_MEMORY_FRACTION = 0.5  # --dtype auto's float32 must fit in this share of the memory available at load


def auto_fp32(model: CausalLM, policy: KernelPolicy, available: int | None = None, timer=None) -> tuple[bool, str]:
    """``--dtype auto`` on a bf16 checkpoint and a CPU without native bf16: whether the model computes in
    float32 instead, and why (one line, logged and shown by ``splitserve status``).

    float32 when (1) its weights (twice the bf16 ones) fit in ``FP32_MEMORY_FRACTION`` of the memory
    available now, else a warning naming the sizes, and (2) timing the model's linear shapes both ways
    (``linear_tuner.compare_fp32``) finds the float32 weights faster than the fastest bf16-storage path; the
    comparison is kept in the kernel cache and reused (``linear_tuner.auto_dtype_comparison``), so every
    engine of this machine and model decides alike."""
    params = sum(p.numel() for p in model.parameters())
    bf16_bytes, fp32_bytes = 2 * params, 4 * params
    available = available_memory_bytes() if available is None else available
    if available is not None and fp32_bytes > FP32_MEMORY_FRACTION * available:
        note = (
            f"bfloat16: float32 weights would take {_gib(fp32_bytes)} (bf16 {_gib(bf16_bytes)}), more than "
            f"{FP32_MEMORY_FRACTION:.0%} of the {_gib(available)} available; bf16 products are emulated on this CPU"
        )
        logger.warning("dtype auto: %s (--dtype float32 forces float32)", note)
        return False, note
    compared = auto_dtype_comparison(model, policy) if timer is None else auto_dtype_comparison(model, policy, timer)
    if compared.shapes == 0:
        return False, "bfloat16: no linear shape large enough to time (auto, no native bf16)"
    verdict = "float32" if compared.fp32_faster else "bfloat16"
    note = (
        f"{verdict}: no native bf16; linear layers {compared.fp32_ms:.3g} ms on float32 weights vs "
        f"{compared.bf16_ms:.3g} ms on bf16 ones (weighted, {compared.shapes} shapes, {compared.source})"
    )
    if compared.fp32_faster:
        note += f"; weights {_gib(fp32_bytes)} instead of {_gib(bf16_bytes)}"
    logger.info("dtype auto: %s", note)
    return compared.fp32_faster, note


def build_model(
    cfg: ModelConfig,
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    kernels: KernelPolicy | None = None,
    tp: TPGroup | None = None,
    auto_float32: bool = False,
    timer=None,
) -> tuple[CausalLM, str]:
    """Construct without random init (meta device), allocate on ``device``, load; returns (model, checksum).

    ``kernels`` says which kernel each linear layer runs (``splitserve.engine.model.linear_tuner``: timed per shape at
    ``auto``, the default); the checksum is of the weights as loaded, before any repacking. With ``tp`` (size
    > 1) the model is rank ``tp.rank``'s shard and the checksum still that of the whole checkpoint.

    ``auto_float32`` (``--dtype auto``, a bf16 ``dtype`` on a CPU without native bf16): the model may be
    converted to float32 after loading (``auto_fp32``: measured, and only where it fits); its dtype then
    is the model's, ``model.embed_tokens.weight.dtype``, and ``model.dtype_note`` says why (else "").
    ``timer`` replaces the tuner's clock (tests).
    """
    with torch.device("meta"):
        model = CausalLM(cfg, tp)
    model = model.to(dtype).to_empty(device=device)
    checksum = load_weights(model, model_dir)
    policy = kernels or KernelPolicy()
    model.dtype_note = ""
    if auto_float32 and dtype == torch.bfloat16 and device.type == "cpu":
        with torch.no_grad():
            to_fp32, model.dtype_note = auto_fp32(model, policy, timer=timer)
        if to_fp32:
            model = model.to(torch.float32)
            dtype = torch.float32
    model.init_rotary(device, dtype)
    model.kernel_choices = apply_kernels(model, policy) if timer is None else apply_kernels(model, policy, timer)
    model.eval()
    model.requires_grad_(False)
    return model, checksum
