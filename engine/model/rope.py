"""Rotary position embeddings, numerically as Hugging Face transformers computes them.

The inverse frequencies are computed in float32 exactly as transformers does (for the default,
linear, llama3 and yarn types), so fp32 logits match it bit for bit up to kernel differences.
"""

from __future__ import annotations

import math

import torch

from splitserve.engine.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention scaling applied to cos and sin)."""
    base, dim = rope.theta, head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim)
    raise ValueError(f"rope_type {rope.rope_type!r} is not supported")


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by the factor, short ones kept, the band between interpolated.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base = rope.theta
    original = rope.original_max_position_embeddings
    factor = rope.factor
    if factor is None:
        raise ValueError("rope_scaling.factor: required for rope_type 'yarn'")

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """cos/sin tables indexed by absolute position, grown on demand, in the model's dtype."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
        self.inv_freq, self.scaling = inverse_frequencies(rope, head_dim)
        self.half = head_dim // 2
        self.device, self.dtype = device, dtype
        self._cos = self._sin = torch.empty(0, self.half, device=device, dtype=dtype)

    def ensure(self, num_positions: int) -> None:
        """Make the tables cover positions [0, num_positions)."""
        if num_positions <= self._cos.shape[0]:
            return
        size = max(num_positions, 2 * self._cos.shape[0], 256)
        freqs = torch.arange(size, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        # Both halves of transformers' cat((freqs, freqs)) are equal, so keep one half.
        self._cos = (freqs.cos() * self.scaling).to(device=self.device, dtype=self.dtype)
        self._sin = (freqs.sin() * self.scaling).to(device=self.device, dtype=self.dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim // 2] tables for ``apply``; call ``ensure`` first."""
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] (rotate-half convention); same roundings as transformers."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
