"""The CPU prefill attention: a C++ kernel that attends a prefill chunk to its whole context, read from the cache.

torch's SDPA takes a prompt's q/k/v as the engine holds them (views of the fused projection, grouped-query heads
broadcast) at about half the speed this kernel does; a later chunk (a cached prefix, or chunked prefill) went
through a gather of its context and a masked SDPA. This kernel (``paged_prefill`` in ``cpu_paged_decode.cpp``,
built with the decode kernel) packs the context once per call out of its blocks, then attends each KV head's
query group in GEMM-shaped register tiles with an online softmax in float32 (the file's comment has the layout).
It serves float32 on a CPU whose build has the AVX-512 path; every other case (bfloat16, a CPU without
AVX-512, a head_dim that is not a multiple of 16, the kernel not built) keeps SDPA, the reason logged once.
"""

from __future__ import annotations

import logging

import torch

from splitserve.engine.attention import cpu_paged_decode
from splitserve.engine.attention.paged_attention import PagedPrefillFn

log = logging.getLogger(__name__)

DTYPES = (torch.float32,)
__all__ = ["DTYPES", "PagedPrefillFn", "paged_prefill_cpu", "unavailable_reason"]


def unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the kernel cannot attend this engine's prefills (None when it can)."""
    if torch.device(device).type != "cpu":
        return f"not on the CPU ({torch.device(device).type})"
    if dtype not in DTYPES:
        return f"{dtype} (float32 only)"
    if head_dim % 16:
        return f"head_dim {head_dim} is not a multiple of 16"
    if cpu_paged_decode.load() is None:
        return f"the CPU attention kernels are not built ({cpu_paged_decode.failure()})"
    if not cpu_paged_decode.tiled():
        return "this CPU's build has no AVX-512 path"
    return None


def paged_prefill_cpu(
    q: torch.Tensor,
    cache_layer: torch.Tensor,
    table: torch.Tensor,
    context_len: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q [Tq, heads, d] of the chunk at positions [context_len - Tq, context_len) -> [Tq, heads, d], attending causally
    (and within ``window``) to the request's keys and values in ``cache_layer`` through ``table`` (its block ids)."""
    module = cpu_paged_decode.load()
    assert module is not None, "cpu paged prefill: the extension is unavailable (check unavailable_reason first)"
    op = getattr(torch.ops, module.__name__).paged_prefill
    return op(q, cache_layer, table, int(context_len), float(scale), window or 0)
