"""The decoder-only transformer shared by Llama, Qwen2 and Mistral checkpoints.

Same math, order of operations and roundings as Hugging Face transformers, with two fusions that do
not change results beyond kernel rounding: q/k/v projections are one ``Linear`` and gate/up are one
``Linear`` (fewer, larger GEMMs: decode on CPU is bound by reading weights). Tokens arrive flattened
(``[T]``), requests told apart by ``AttentionMetadata``, so one forward mixes prefill chunks and
decodes. Logits are computed only for the rows that are sampled.

Tensor parallelism (``splitserve.engine.tp.shard``): built with a ``TPGroup`` of size t, every
layer holds rank r's shard (its heads, ``intermediate/t`` of the MLP) and ``o_proj`` and ``down_proj``
are each followed by one in-place sum all-reduce; the embedding and the LM head stay whole. Without a
group the model is the unsharded one and no collective runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.attention.paged_attention import AttentionMetadata, paged_attention
from splitserve.engine.hardware import cpu_isa, isa_override, onednn_bf16_isa
from splitserve.engine.kv_cache.cache import KVCache
from splitserve.engine.model import cpu_gemv, cpu_norm
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.rope import RotaryEmbedding, apply_rotary
from splitserve.engine.tp.distributed import TPGroup
from splitserve.engine.tp.shard import TPShard


def onednn_runs(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether oneDNN runs a prepacked linear layer in this dtype here (CPU only; bf16 and fp16 need ISA support)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        # torch asks the CPU; $SPLITSERVE_CPU_ISA, when set, may take the support away (engine/hardware.py).
        override = isa_override()
        return torch.ops.mkldnn._is_mkldnn_bf16_supported() and (override is None or onednn_bf16_isa(cpu_isa()))
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return dtype == torch.float32


# The paths of a bf16 (or fp16) layer that compute in float32 and round the output back to the layer's dtype.
FP32_COMPUTE_PATHS = ("upcast", "fp32", "fp32-packed")
# A bf16 (or fp16) layer that runs "plain" up to split_rows rows and "fp32-packed" above them.
SPLIT_FP32 = "split-fp32"
# The paths that run the panel kernel (``cpu_gemv``) up to split_rows rows, and what runs above them.
GEMV_PATHS = {"gemv": "plain", "gemv-packed": "packed", "gemv-fp32": "fp32-packed"}
LINEAR_PATHS = ("plain", "packed", "split", *FP32_COMPUTE_PATHS, SPLIT_FP32, *GEMV_PATHS)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether a forced "packed" or "split" layer packs this weight: oneDNN runs its dtype, and in float32
    it has at least 2^18 weights (below that MKL's own kernel wins: oneDNN's fixed cost is ~15 us a call)."""
    if not onednn_runs(weight.dtype, weight.device):
        return False
    return weight.dtype != torch.float32 or weight.numel() >= 1 << 18


class Linear(nn.Module):
    """``y = x W^T + b`` with nn.Linear's parameter names, run by one of these kernels (``path``):

    - "plain": ``F.linear`` on the ``[out, in]`` weight (MKL or oneDNN inside torch; cuBLAS on CUDA);
    - "packed": oneDNN on W moved once into its blocked layout (an opaque tensor; the plain weight is dropped);
    - "split": both layouts kept, inputs of at most ``split_rows`` rows go plain, larger ones packed: for CPUs
      where ``F.linear`` wins at decode batches and oneDNN at prefill chunks (twice this layer's memory).

    and, for a bf16 or fp16 weight only, three that compute in float32 (``FP32_COMPUTE_PATHS``: the input
    upcast exactly, the float32 product rounded back to the input's dtype once, as a bf16 GEMM rounds its
    float32 sums), for CPUs that emulate bf16 products:

    - "upcast": the weight kept in bf16, upcast to float32 at every call (the weight's memory);
    - "fp32": the weight kept in float32 (its bf16 values exactly), ``F.linear`` (twice the bf16 memory);
    - "fp32-packed": that float32 weight in oneDNN's layout, the bf16 one dropped (twice the bf16 memory);
    - "split-fp32": inputs of at most ``split_rows`` rows "plain" on the bf16 weight, larger ones "fp32-packed"
      (both kept: three times the bf16 memory), for CPUs whose emulated bf16 product streams one row as fast
      as the memory allows but loses to float32 from a few rows on.

    and three that send inputs of at most ``split_rows`` rows (at most ``cpu_gemv.MAX_ROWS``) to the project's
    panel kernel (``splitserve.engine.model.cpu_gemv``: the weight in panels of its own dtype, float32 or bf16,
    summed in float32, the output rounded back once), where it is built, and larger ones to:

    - "gemv": ``F.linear`` ("plain"; the weight and its panels: twice its memory);
    - "gemv-packed": "packed" (the panels and oneDNN's layout, the plain weight dropped, as "split");
    - "gemv-fp32": "fp32-packed" (a bf16 weight's panels and the float32 copy: three times its memory, as
      "split-fp32").

    ``splitserve.engine.model.linear_tuner`` picks the path per weight shape by timing them at load.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, device: str | None = None) -> None:
        super().__init__()
        self.out_features = out_features
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None
        self.packed: torch.Tensor | None = None
        self.split_rows = 0  # split, split-fp32, GEMV_PATHS: inputs of at most this many rows take the first kernel
        self.fp32_path: str | None = None  # one of FP32_COMPUTE_PATHS, or None
        self.bias32: torch.Tensor | None = None  # the bias in float32, for the FP32_COMPUTE_PATHS
        self.gemv_rows = 0  # the GEMV_PATHS: inputs of at most this many rows run the panel kernel
        self.panels: torch.Tensor | None = None  # the GEMV_PATHS: the weight in the panel kernel's layout

    @classmethod
    def from_weight(cls, weight: nn.Parameter, path: str, split_rows: int = 0) -> Linear:
        """A bias-free layer over an existing weight (the tied LM head over the embedding matrix): "packed"
        packs a copy, "split" and "upcast" keep sharing ``weight``, "fp32" keeps a float32 copy."""
        layer = cls(weight.shape[1], weight.shape[0], bias=False, device="meta")
        layer.weight = weight
        layer.use(path, split_rows)
        return layer

    @property
    def path(self) -> str:
        if self.gemv_rows:
            above = "fp32-packed" if self.fp32_path is not None else "plain" if self.packed is None else "packed"
            return next(p for p, a in GEMV_PATHS.items() if a == above)
        if self.fp32_path is not None:
            return self.fp32_path
        if self.packed is None:
            return "plain"
        return "packed" if self.weight is None else "split"

    def use(self, path: str, split_rows: int = 0) -> None:
        """Switch this layer, still plain, to ``path``; oneDNN must run its dtype for "packed" and "split",
        float32 for "fp32-packed"; the ``FP32_COMPUTE_PATHS`` need a bf16 or fp16 weight."""
        assert self.path == "plain" and path in LINEAR_PATHS, (self.path, path)
        if path in GEMV_PATHS:
            assert 0 < split_rows <= cpu_gemv.MAX_ROWS and cpu_gemv.available(self.weight), (path, split_rows)
            above = {"plain": "plain", "packed": "split", "fp32-packed": SPLIT_FP32}[GEMV_PATHS[path]]
            self.panels = cpu_gemv.pack(self.weight)
            if above != "plain":
                self.use(above, split_rows)
                # Rows up to split_rows run the panels, the rest the packed weight: the plain one is not read.
                self.weight = None
            self.gemv_rows = split_rows
            self.bias32 = None if self.bias is None else self.bias.detach().float()
            return
        if path in FP32_COMPUTE_PATHS or path == SPLIT_FP32:
            weight = self.weight.detach()
            assert weight.dtype != torch.float32, f"{path}: the weight is float32 already"
            self.fp32_path = path
            self.bias32 = None if self.bias is None else self.bias.detach().float()
            if path == "fp32":
                self.weight = nn.Parameter(weight.float(), requires_grad=False)
            elif path in ("fp32-packed", SPLIT_FP32):
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.float())
                if path == SPLIT_FP32:
                    self.split_rows = split_rows
                else:
                    self.weight = None
            return
        if path != "plain":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            self.split_rows = split_rows
            if path == "packed":
                self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv_rows and x.numel() <= self.gemv_rows * x.shape[-1]:
            return cpu_gemv.gemv(x, self.panels, self.bias32, self.out_features)
        if self.fp32_path is not None:
            if self.fp32_path == SPLIT_FP32 and x.numel() <= self.split_rows * x.shape[-1]:
                return F.linear(x, self.weight, self.bias)
            x32 = x.float()
            if self.packed is not None:
                y = torch.ops.mkldnn._linear_pointwise(x32.contiguous(), self.packed, self.bias32, "none", [], "")
            else:
                y = F.linear(x32, self.weight if self.fp32_path == "fp32" else self.weight.float(), self.bias32)
            return y.to(x.dtype)
        if self.packed is not None and (self.weight is None or x.numel() > self.split_rows * x.shape[-1]):
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        self.fused: bool | None = None  # bf16 on the CPU: whether cpu_norm runs it (decided at the first call)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers: normalise in float32, round back, then scale in the model's dtype. ``F.rms_norm``
        # runs the same float32 ops (x * rsqrt(mean(x^2) + eps), then the weight) in one call: bit-equal to
        # transformers' chain in fp32 and bf16 here, with 1 or 3 dispatched operators instead of 8. A bf16 norm on
        # the CPU is one call of ``cpu_norm`` where it checked bit-equal to that here.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if self.fused is None:
            self.fused = x.dtype == torch.bfloat16 and cpu_norm.usable(self.weight, self.eps)
        if self.fused and x.dim() == 2 and x.stride(1) == 1:
            return cpu_norm.rms_norm(x, self.weight, self.eps)
        return cpu_norm.reference(x, self.weight, self.eps)


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them unsharded): ``qkv_proj`` column-parallel,
    ``o_proj`` row-parallel and summed over the ranks."""

    def __init__(self, cfg: ModelConfig, layer: int, shard: TPShard, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.layer, self.tp = layer, tp
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = shard.q_size, shard.kv_size
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.sliding_windows[layer]
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        o_bias = cfg.o_bias and shard.holds_row_parallel_bias
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias)

    def forward(self, h, cos, sin, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = h.shape[0]
        qkv = self.qkv_proj(h)
        # One rotation for queries and keys together: [T, heads + kv_heads, head_dim].
        qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(tokens, -1, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache.layer(self.layer), meta, self.scale, self.window)
        out = self.o_proj(out.reshape(tokens, self.q_size))  # SDPA's CUDA output is not contiguous
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    """SwiGLU over this rank's intermediate columns: ``gate_up_proj`` column-parallel, ``down_proj``
    row-parallel and summed over the ranks."""

    def __init__(self, cfg: ModelConfig, shard: TPShard, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        inter = shard.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias and shard.holds_row_parallel_bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        out = self.down_proj(F.silu(gate).mul_(up))  # in place: one [T, intermediate] buffer fewer
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: TPShard, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, shard, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard, tp)

    def forward(self, h, cos, sin, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        # Residual adds into the sublayers' fresh outputs (the same sum, rounded once, as transformers'
        # ``residual + hidden``), so no new [T, hidden] buffer per add.
        h = self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta).add_(h)
        return self.mlp(self.post_attention_layernorm(h)).add_(h)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        """The whole model, or with ``tp`` (a group of size > 1) rank ``tp.rank``'s shard of it. A group of
        size 1 is dropped: the unsharded model runs no collective."""
        super().__init__()
        self.config = cfg
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.shard = TPShard.for_model(cfg, tp.size, tp.rank) if self.tp is not None else TPShard.for_model(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.shard, self.tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None  # set by ``init_rotary`` once the device is known

    def init_rotary(self, device: torch.device, dtype: torch.dtype) -> None:
        self.rotary = RotaryEmbedding(self.config.rope, self.config.head_dim, device, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        max_position: int,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden]; writes every token's K/V into its cache slot.

        ``on_layer_done(n)`` runs after layer n-1, when layers [0, n) of every token are in the cache:
        the hook that lets a prefill worker ship finished layer groups while later layers compute.
        """
        self.rotary.ensure(max_position + 1)
        cos, sin = self.rotary.cos_sin(positions)
        h = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache, meta)
            if on_layer_done is not None:
                if kv_cache.device.type == "cuda":
                    torch.cuda.current_stream(kv_cache.device).synchronize()
                on_layer_done(i + 1)
        return h

    def pack_weights(self, choose: Callable[[str, torch.Tensor, bool], tuple[str, int]]) -> None:
        """Give every linear layer its kernel: ``choose(name, weight, has_bias) -> (path, split_rows)``
        (``splitserve.engine.model.linear_tuner``). A tied LM head ("lm_head", over the embedding matrix, which the
        lookup still needs in plain form) becomes a layer of its own unless its path is "plain"."""
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                module.use(*choose(name, module.weight, module.bias is not None))
        if self.lm_head is None:
            path, split_rows = choose("lm_head", self.embed_tokens.weight, False)
            if path != "plain":
                self.lm_head = Linear.from_weight(self.embed_tokens.weight, path, split_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on the selected rows only: logits [rows, vocab] in the model's dtype."""
        hidden = self.norm(hidden)
        return F.linear(hidden, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)
