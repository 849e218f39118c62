"""Seeded random weights for Llama/Qwen2/Mistral checkpoints, with HF's tensor names, written as safetensors.

Configs here are HF config dicts that carry model_type and num_key_value_heads (make_model validates them).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

# Init scales; _init_tensor says why. Checked with transformers in fp32 on tiny (hidden 128, 2 layers, vocab
# 2048) Qwen2 (tied), Llama and Mistral configs, seeds 0-2, 40 greedy tokens: from 48 corpus prompts of 2-13
# tokens each, all 432 outputs hold 8+ distinct ids and none falls into a short loop; from 16 hand-written
# prompts, 3 of 144 end repeating one token (two of them from 1-token prompts). Top-1 minus top-2 logit gap:
# median ~0.4, 1st percentile ~0.003.
EMBEDDING_STD = 2.0  # norm of an embedding / lm_head row (per element: EMBEDDING_STD / sqrt(hidden))
RESIDUAL_GAIN = 6.0  # o_proj and down_proj: what each sublayer writes into the residual stream
QK_GAIN = 3.0  # q_proj and k_proj: attention logits with std ~QK_GAIN**2
NORM_WEIGHT_STD = 0.1  # RMSNorm weights are 1 + N(0, NORM_WEIGHT_STD)
BIAS_STD = 0.02


def random_weights(hf_config: dict, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, each from its own generator seeded by (seed, name): layout-independent."""
    return {
        name: _init_tensor(name, shape, _generator(seed, name)).to(dtype).contiguous()
        for name, shape in tensor_shapes(hf_config).items()
    }


def tensor_shapes(hf_config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names -> shapes, in file order, for a validated Llama/Qwen2/Mistral config."""
    c = hf_config
    hidden, layers = c["hidden_size"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q_dim, kv_dim = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    inter = c["intermediate_size"]
    # As transformers builds them: Qwen2 always has q/k/v biases; only Llama reads attention_bias/mlp_bias.
    is_llama = c["model_type"] == "llama"
    qkv_bias = c["model_type"] == "qwen2" or (is_llama and c.get("attention_bias", False))
    o_bias = is_llama and c.get("attention_bias", False)
    mlp_bias = is_llama and c.get("mlp_bias", False)

    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        projections = {
            "self_attn.q_proj": (q_dim, hidden, qkv_bias),
            "self_attn.k_proj": (kv_dim, hidden, qkv_bias),
            "self_attn.v_proj": (kv_dim, hidden, qkv_bias),
            "self_attn.o_proj": (hidden, q_dim, o_bias),
            "mlp.gate_proj": (inter, hidden, mlp_bias),
            "mlp.up_proj": (inter, hidden, mlp_bias),
            "mlp.down_proj": (hidden, inter, mlp_bias),
        }
        for proj, (out_features, in_features, bias) in projections.items():
            shapes[f"{p}.{proj}.weight"] = (out_features, in_features)
            if bias:
                shapes[f"{p}.{proj}.bias"] = (out_features,)
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not c.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (c["vocab_size"], hidden)
    return shapes


def _init_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """One tensor of the random init; Linear weights are [out, in], scaled by gain / sqrt(in).

    HF's init (std 0.02) leaves the residual stream equal to the input embedding, so a tied head scores the
    input token highest and greedy decoding repeats it. Here every sublayer writes ~RESIDUAL_GAIN into the
    residual against an embedding row of norm EMBEDDING_STD, so the input token's own score is only ~0.3
    logit std above the rest, and the final RMSNorm makes the logit std ~EMBEDDING_STD, tied or not. Sharp
    attention (QK_GAIN) keeps the next token depending on which earlier tokens were attended: with flat
    attention the context average settles and decoding locks into a loop (of the 144 hand-prompted outputs
    above, with QK_GAIN 0.5: 85 looped, 1: 20, 2: 2, 3: 1-3, depending on the tokenizer's corpus).
    """
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + NORM_WEIGHT_STD * noise
    if name.endswith(".bias"):
        return BIAS_STD * noise
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return noise * (EMBEDDING_STD / math.sqrt(shape[1]))
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        gain = RESIDUAL_GAIN
    elif name.endswith(("q_proj.weight", "k_proj.weight")):
        gain = QK_GAIN
    else:
        gain = 1.0
    return noise * (gain / math.sqrt(shape[1]))


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def write_safetensors(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None) -> None:
    """model.safetensors, or HF-style shards plus model.safetensors.index.json when they exceed max_shard_bytes."""
    metadata = {"format": "pt"}
    shards = _pack_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
        return
    weight_map = {}
    for k, names in enumerate(shards, start=1):
        file_name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(out / file_name), metadata=metadata)
        weight_map.update(dict.fromkeys(names, file_name))
    total_size = sum(_nbytes(t) for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _pack_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int | None) -> list[list[str]]:
    """Greedy in file order, like HF: a tensor bigger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = _nbytes(tensor)
        if max_shard_bytes is not None and shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += size
    return shards


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
