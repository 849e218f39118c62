"""Profiles from published figures, not measurements (``splitserve profile --roofline DEVICE``).

A device's datasheet peak (HBM bandwidth, dense BF16 FLOP/s, memory, NVLink and network bandwidth) and a
model's shapes give the roofline of each step (docs/planning.md; the formulas of the scaling-book and
Mooncake). Fractions of those peaks that serving engines are commonly reported to reach turn it into the
profile's five coefficients:

- ``const``: every weight read once per step (``P s_w / BW``), plus a fixed host cost per step, plus the
  latency of a step's all-reduces (2 per layer) on a TP group;
- ``prefill_tokens``: ``2 P_blk`` FLOPs per prompt token, plus its share of the all-reduces' bytes;
- ``prefill_attention``: ``4 L n_q h`` FLOPs per causal token pair (FlashAttention's count, halved);
- ``decodes``: ``2 (P_blk + P_head)`` FLOPs per decoding sequence, plus its all-reduce bytes;
- ``decode_context``: the KV bytes of one token of context (``2 L n_kv h s_kv``), read once per step.

The linear model adds the compute and the memory terms where a roofline takes their maximum, so near
the ridge point it is pessimistic. Every figure here is written "published" or "assumed" in the profile
(``source``, ``parts`` and ``notes``): none of it is measured, and a profile written by ``splitserve profile`` on
the device replaces it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from splitserve.deploy.profile import ModelShape, Profile, TransferCost


@dataclass(frozen=True)
class Device:
    name: str
    hbm_bytes_per_s: float
    dense_bf16_flops: float
    memory_bytes: float
    link_bytes_per_s: float  # NVLink, each way, per GPU
    network_bytes_per_s: float  # between nodes, per GPU (its NIC): what a KV hand-off between nodes gets
    source: str


DEVICES = {
    "h200": Device(
        "NVIDIA H200 SXM (datasheet figures)",
        hbm_bytes_per_s=4.8e12,
        dense_bf16_flops=989e12,
        memory_bytes=141e9,
        link_bytes_per_s=450e9,
        network_bytes_per_s=50e9,
        source=(
            "NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 989 TFLOP/s dense BF16, 141 GB, NVLink 900 GB/s "
            "(450 GB/s each way); one 400 Gb/s NIC per GPU (a common HGX H200 build)"
        ),
    ),
    "h100": Device(
        "NVIDIA H100 SXM (datasheet figures)",
        hbm_bytes_per_s=3.35e12,
        dense_bf16_flops=989e12,
        memory_bytes=80e9,
        link_bytes_per_s=450e9,
        network_bytes_per_s=50e9,
        source=(
            "NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16, 80 GB, NVLink 900 GB/s; "
            "one 400 Gb/s NIC per GPU"
        ),
    ),
}

# Published model shapes (their Hugging Face config.json): planning needs no weights.
SHAPES = {
    "llama3.1-70b": ModelShape("Llama-3.1-70B", "LlamaForCausalLM", 80, 8192, 64, 8, 128, 28672, 128256, 131072),
    "llama3.1-8b": ModelShape("Llama-3.1-8B", "LlamaForCausalLM", 32, 4096, 32, 8, 128, 14336, 128256, 131072),
    "qwen2.5-72b": ModelShape("Qwen2.5-72B", "Qwen2ForCausalLM", 80, 8192, 64, 8, 128, 29568, 152064, 32768),
}

# Fractions of the peaks that serving engines commonly reach (assumed, not measured here).
ASSUMED = {
    "mfu": 0.6,  # of dense FLOP/s, in prefill and in the compute of decode
    "mbu": 0.7,  # of HBM bandwidth, reading weights and KV
    "link_efficiency": 0.7,  # of NVLink bandwidth, in an all-reduce
    "allreduce_latency_s": 20e-6,  # one small all-reduce on NVLink
    "host_step_s": 1e-3,  # the engine's own work per step (scheduling, sampling, launches)
    "ttft_overhead_s": 5e-3,  # router and gRPC before a first token
    "transfer_latency_s": 1e-3,  # one KV hand-off's fixed cost
    "memory_for_kv": 0.9,  # of device memory, less the weights, left to the KV cache
}


def parameters(shape: ModelShape) -> tuple[float, float]:
    """(P_blk, P_head): parameters in the transformer blocks, and in the LM head (norms left out)."""
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * shape.intermediate_size
    return float(shape.num_layers * per_layer), float(shape.vocab_size * h)


def roofline_profile(
    shape: ModelShape, device: Device, tensor_parallel_size: int, dtype_bytes: int = 2, **assumed: float
) -> Profile:
    """The profile of ``shape`` on a TP group of ``tensor_parallel_size`` ``device``s, from the peaks and
    the ``ASSUMED`` fractions (any of which ``assumed`` overrides). Refuses a group whose memory cannot hold
    the weights and some KV."""
    a = {**ASSUMED, **assumed}
    t = tensor_parallel_size
    p_blk, p_head = parameters(shape)
    weight_bytes = (p_blk + 2 * p_head) * dtype_bytes  # the embedding and the LM head: both in memory
    kv_bytes = a["memory_for_kv"] * device.memory_bytes - weight_bytes / t
    if kv_bytes <= 0.05 * device.memory_bytes:
        raise ValueError(
            f"tensor_parallel_size: {shape.name} ({weight_bytes / 1e9:.0f} GB of weights) does not fit on "
            f"{t} x {device.name} with room for its KV cache"
        )
    flops = device.dense_bf16_flops * t * a["mfu"]
    bandwidth = device.hbm_bytes_per_s * t * a["mbu"]
    allreduce_per_token = 0.0
    allreduce_latency = 0.0
    if t > 1:  # two all-reduces per layer, a ring moving 2 (t - 1) / t of the activation each
        ring = 2 * (t - 1) / t * shape.hidden_size * dtype_bytes
        allreduce_per_token = 2 * shape.num_layers * ring / (device.link_bytes_per_s * a["link_efficiency"])
        allreduce_latency = 2 * shape.num_layers * a["allreduce_latency_s"]
    coefficients = {
        "const": (p_blk + p_head) * dtype_bytes / bandwidth + a["host_step_s"] + allreduce_latency,
        "prefill_tokens": 2 * p_blk / flops + allreduce_per_token,
        "prefill_attention": 1e3 * 4 * shape.num_layers * shape.num_heads * shape.head_dim / flops,
        "decodes": 2 * (p_blk + p_head) / flops + allreduce_per_token,
        "decode_context": 1e3 * shape.kv_elements_per_token * dtype_bytes / bandwidth,
    }
    return Profile(
        model=shape,
        dtype="bfloat16" if dtype_bytes == 2 else f"{dtype_bytes}-byte",
        dtype_bytes=dtype_bytes,
        device="cuda",
        device_name=device.name,
        threads=1,
        tensor_parallel_size=t,
        step_coefficients=coefficients,
        transfer=TransferCost(a["transfer_latency_s"], device.network_bytes_per_s),
        source=f"roofline of published figures, not measured: {device.source}",
        parts={
            "steps": "roofline of published figures at assumed efficiencies, not measured",
            "transfer": "the published NIC bandwidth and an assumed latency, not measured",
            "serving": "an assumed overhead before a first token, not measured",
        },
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        notes={
            "assumed": a,
            "ttft_overhead_s": a["ttft_overhead_s"],
            "kv_cache_bytes": kv_bytes,
            "parameters": {"blocks": p_blk, "lm_head": p_head},
        },
    )
