"""Decode attention straight from the paged KV cache: a Triton kernel, and adapters for FlashInfer and FlashAttention.

Every backend has one signature::

    fn(q [B, H, d], cache_layer [num_blocks, 2, kv_heads, block_size, d], block_tables [B, max_blocks] int32,
       context_lens [B] int32, scale: float, window: int | None) -> [B, H, d]

Request ``b`` attends to its keys ``0 .. context_lens[b] - 1`` (only the last ``window`` of them when a
window is given), stored at ``cache_layer[block_tables[b, t // block_size], :, :, t % block_size]``.
Entries of a block table past a request's last block are never read. A row with context length 0
gives zeros. ``BACKENDS`` lists ``(name, fn, is_available)`` for ``splitserve.engine.attention.paged_decode`` to
register.

The Triton kernel (``paged_decode_triton``) is graph-capturable: its grid and every buffer follow from
shapes alone, it reads lengths and block ids on the device, and nothing returns to the host. One
program serves one request, one KV head and every query head of that head's group (GQA), so each
K/V block is loaded once for the whole group; scores and the running softmax are float32 (online
softmax, as FlashAttention). For long block tables and few (request, KV head) pairs, split-K spreads
a request's blocks over several programs and a second kernel merges their partial softmaxes.

The FlashInfer and FlashAttention adapters follow those libraries' documented APIs; neither library
is installed in CI, so they have not run there (see docs/engine.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the kernel is simply unavailable
    triton = tl = None

__all__ = ["BACKENDS", "is_available", "paged_decode_triton", "paged_decode_flashinfer", "paged_decode_flash_attn"]

DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, "int | None"], torch.Tensor]

# Split-K: aim for this many blocks per split, and split only while the (request, KV head) programs
# would leave most of the device's SMs idle.
BLOCKS_PER_SPLIT = 16
MAX_SPLITS = 32
# Keys per loop iteration (whole blocks, at least one): more loads in flight per program. Without tl.dot
# the scores are a [group, keys, head_dim] product held in registers, so fewer keys.
TILE_KEYS_DOT = 64
TILE_ELEMS_NO_DOT = 2048


def is_available(device: torch.device | str) -> bool:
    return triton is not None and torch.device(device).type == "cuda"


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _num_splits(batch: int, kv_heads: int, max_blocks: int, device: torch.device) -> int:
    """From shapes and the device's SM count only (no look at the lengths, so capture-safe)."""
    if device.type != "cuda" or max_blocks <= BLOCKS_PER_SPLIT:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = batch * kv_heads
    if programs >= sms:
        return 1
    return max(1, min(MAX_SPLITS, triton.cdiv(max_blocks, BLOCKS_PER_SPLIT), triton.cdiv(2 * sms, programs)))


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,
        cache_ptr,
        tables_ptr,
        lens_ptr,
        out_ptr,
        part_m_ptr,
        part_l_ptr,
        scale,
        window,
        blocks_per_split,
        stride_qb,
        stride_qh,
        stride_qd,
        stride_cn,
        stride_ckv,
        stride_ch,
        stride_ct,
        stride_cd,
        stride_tb,
        stride_tn,
        stride_ob,
        stride_oh,
        stride_os,
        stride_od,
        GROUP: tl.constexpr,
        GROUP_P: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_P: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_P: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        SPLIT: tl.constexpr,
        TILE_BLOCKS: tl.constexpr,
        USE_DOT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, HEAD_DIM_P)
        g_ok, d_ok = g < GROUP, d < HEAD_DIM
        heads = kv_head * GROUP + g

        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [G, D]

        length = tl.load(lens_ptr + b)
        first_key = 0
        if HAS_WINDOW:
            first_key = tl.maximum(length - window, 0)
        # This program's blocks: the request's [first_key // BLOCK, cdiv(length, BLOCK)) cut to its split.
        lo = tl.maximum(first_key // BLOCK, split * blocks_per_split)
        hi = tl.minimum((length + BLOCK - 1) // BLOCK, (split + 1) * blocks_per_split)

        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
        # One iteration reads TILE_BLOCKS blocks: key j of the tile is slot j % BLOCK_P of block j // BLOCK_P.
        j = tl.arange(0, TILE_BLOCKS * BLOCK_P)
        slot, tile_block = j % BLOCK_P, j // BLOCK_P
        for n0 in range(lo, hi, TILE_BLOCKS):
            n = n0 + tile_block
            pos = n * BLOCK + slot
            valid = (slot < BLOCK) & (n < hi) & (pos < length) & (pos >= first_key)
            block = tl.load(tables_ptr + b * stride_tb + n * stride_tn, mask=n < hi, other=0).to(tl.int64)
            ptrs = (
                cache_ptr
                + block[:, None] * stride_cn
                + kv_head * stride_ch
                + slot[:, None] * stride_ct
                + d[None, :] * stride_cd
            )
            kv_mask = valid[:, None] & d_ok[None, :]
            k = tl.load(ptrs, mask=kv_mask, other=0.0)  # [keys, D]
            v = tl.load(ptrs + stride_ckv, mask=kv_mask, other=0.0)
            if USE_DOT:  # tensor cores; products of bf16/fp16 are exact in the float32 accumulator
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [G, keys]
            else:
                s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a group row with no key yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if USE_DOT:  # p rounded to the cache's dtype for the product, as FlashAttention does
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            else:
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            m_i = m_new

        out_offs = b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :] * stride_od
        out_mask = g_ok[:, None] & d_ok[None, :]
        if SPLIT:  # unnormalised partial sums and their softmax state, merged by _merge_splits_kernel
            tl.store(out_ptr + out_offs, acc, mask=out_mask)
            state = (b * tl.num_programs(1) * GROUP + heads) * tl.num_programs(2) + split
            tl.store(part_m_ptr + state, m_i, mask=g_ok)
            tl.store(part_l_ptr + state, l_i, mask=g_ok)
        else:
            out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
            tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _merge_splits_kernel(
        part_ptr,
        part_m_ptr,
        part_l_ptr,
        out_ptr,
        num_splits,
        stride_ob,
        stride_oh,
        stride_od,
        HEADS: tl.constexpr,
        SPLITS_P: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_P: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, SPLITS_P)
        d = tl.arange(0, HEAD_DIM_P)
        s_ok, d_ok = s < num_splits, d < HEAD_DIM
        state = (b * HEADS + h) * num_splits + s
        m = tl.load(part_m_ptr + state, mask=s_ok, other=float("-inf"))
        denom = tl.load(part_l_ptr + state, mask=s_ok, other=0.0)
        acc = tl.load(part_ptr + state[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # 0 for splits without keys
        total = tl.sum(w * denom, axis=0)
        out = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
        out = tl.where(total > 0, out, 0.0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d * stride_od, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_decode_triton(
    q: torch.Tensor,
    cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
    *,
    num_splits: int | None = None,
    use_dot: bool | None = None,
) -> torch.Tensor:
    """The Triton kernel (see the module docstring).

    ``num_splits`` overrides the split-K choice; ``use_dot`` (default: on CUDA) computes the group's scores
    and weighted values with ``tl.dot`` (the group padded to 16 query rows) instead of broadcast sums.
    """
    if triton is None:
        raise RuntimeError("paged_decode_triton needs Triton (pip install triton) and a CUDA device")
    batch, heads, head_dim = q.shape
    num_blocks, two, kv_heads, block_size, cache_dim = cache_layer.shape
    if two != 2 or cache_dim != head_dim or heads % kv_heads or q.dtype != cache_layer.dtype:
        raise ValueError(
            f"q {tuple(q.shape)} {q.dtype} does not fit cache_layer {tuple(cache_layer.shape)} {cache_layer.dtype}"
        )
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} / context_lens {tuple(context_lens.shape)} "
            f"do not match the batch of {batch}"
        )
    out = torch.empty((batch, heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    max_blocks = block_tables.shape[1]
    if num_splits is None:
        num_splits = _num_splits(batch, kv_heads, max_blocks, q.device)
    num_splits = max(1, min(num_splits, max_blocks))
    blocks_per_split = triton.cdiv(max_blocks, num_splits)
    group, block_p, head_dim_p = heads // kv_heads, _next_pow2(block_size), max(16, _next_pow2(head_dim))
    if use_dot is None:
        use_dot = q.device.type == "cuda"
    group_p = max(16, _next_pow2(group)) if use_dot else _next_pow2(group)  # tl.dot: every side >= 16
    tile_keys = TILE_KEYS_DOT if use_dot else TILE_ELEMS_NO_DOT // (group_p * head_dim_p)
    tile_blocks = _next_pow2(max(1, tile_keys // block_p, 16 // block_p if use_dot else 1))
    consts = dict(
        GROUP=group,
        GROUP_P=group_p,
        BLOCK=block_size,
        BLOCK_P=block_p,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        HAS_WINDOW=window is not None,
        TILE_BLOCKS=tile_blocks,
        USE_DOT=use_dot,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
    )
    grid = (batch, kv_heads, num_splits)
    cache_strides = cache_layer.stride()
    args = (scale, window or 0, blocks_per_split, *q.stride(), *cache_strides, *block_tables.stride())
    if num_splits == 1:
        _paged_decode_kernel[grid](
            q,
            cache_layer,
            block_tables,
            context_lens,
            out,
            out,
            out,
            *args,
            out.stride(0),
            out.stride(1),
            0,
            out.stride(2),
            SPLIT=False,
            **consts,
        )
        return out
    part = torch.empty((batch, heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_m = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    _paged_decode_kernel[grid](
        q, cache_layer, block_tables, context_lens, part, part_m, part_l, *args, *part.stride(), SPLIT=True, **consts
    )
    _merge_splits_kernel[(batch, heads)](
        part,
        part_m,
        part_l,
        out,
        num_splits,
        *out.stride(),
        HEADS=heads,
        SPLITS_P=_next_pow2(num_splits),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
    )
    return out


# ---- FlashInfer -------------------------------------------------------------------------------------


def _cuda_with(module: str, device: torch.device | str) -> bool:
    """The device is CUDA and ``module`` imports."""
    if torch.device(device).type != "cuda":
        return False
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _flashinfer_available(device: torch.device | str) -> bool:
    return _cuda_with("flashinfer", device)


_FLASHINFER_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def flashinfer_page_list(
    block_tables: torch.Tensor, context_lens: torch.Tensor, window: int | None, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page list (indptr [B + 1], indices, last_page_len [B], all int32) for our block tables.

    Each request lists its pages from the first one holding an attended key (FlashInfer's window_left cuts
    within them). An empty request lists one key of block 0, since FlashInfer's length, (pages - 1) *
    page_size + last_page_len, must not go negative; the caller zeroes its output.
    """
    lens = context_lens.to(torch.int32)
    empty = lens == 0
    first = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0)
    first_page = first // page_size
    pages = torch.where(empty, 1, (lens + page_size - 1) // page_size)
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)
    tables = torch.where(empty[:, None] & (cols == 0)[None, :], 0, block_tables)
    used = (cols[None, :] >= first_page[:, None]) & (cols[None, :] < pages[:, None])
    indices = tables[used].to(torch.int32)  # row-major, so request by request
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=block_tables.device)
    indptr[1:] = torch.cumsum(pages - first_page, 0)
    last_page_len = torch.where(empty, 1, (lens - 1) % page_size + 1).to(torch.int32)
    return indptr, indices, last_page_len


def paged_decode_flashinfer(
    q: torch.Tensor,
    cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` over our cache, which is its "HND" layout with K and
    V in one tensor (``[pages, 2, kv_heads, page_size, d]``).

    Not graph-capturable as written: ``plan`` takes a CSR page list (indptr, indices, last-page lengths)
    whose size depends on the lengths, so building it reads them on the host. It also plans on every
    call, i.e. once per layer where once per step would do. A captured step would plan once, outside the
    graph, into fixed buffers (``use_cuda_graph=True``); not done here.
    """
    import flashinfer

    batch, heads, head_dim = q.shape
    _, _, kv_heads, page_size, _ = cache_layer.shape
    indptr, indices, last_page_len = flashinfer_page_list(block_tables, context_lens, window, page_size)
    workspace = _FLASHINFER_WORKSPACES.get(q.device)
    if workspace is None:
        workspace = _FLASHINFER_WORKSPACES[q.device] = torch.zeros(128 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="HND")
    wrapper.plan(
        indptr,
        indices,
        last_page_len,
        heads,
        kv_heads,
        head_dim,
        page_size,
        window_left=-1 if window is None else window - 1,
        q_data_type=q.dtype,
        kv_data_type=cache_layer.dtype,
        sm_scale=scale,
    )
    out = wrapper.run(q.contiguous(), cache_layer)
    empty = (context_lens == 0)[:, None, None]
    return torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out)


# ---- FlashAttention ---------------------------------------------------------------------------------


def _flash_attn_available(device: torch.device | str) -> bool:
    return _cuda_with("flash_attn", device)


def paged_decode_flash_attn(
    q: torch.Tensor,
    cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """FlashAttention's ``flash_attn_with_kvcache`` with ``block_table``: graph-capturable (lengths stay on the
    device). Its paged path wants K/V as ``[num_blocks, page_size, kv_heads, d]``; ours transposed to that is
    a strided view with a contiguous last dimension, which it accepts. FlashAttention 2 documents that the
    page size must be a multiple of 256, so it raises for smaller cache blocks."""
    from flash_attn import flash_attn_with_kvcache

    block_size = cache_layer.shape[3]
    if block_size % 256:
        raise ValueError(f"flash_attn_with_kvcache needs a block size that is a multiple of 256, got {block_size}")
    k_cache = cache_layer[:, 0].transpose(1, 2)  # [num_blocks, block_size, kv_heads, d]
    v_cache = cache_layer[:, 1].transpose(1, 2)
    lens = context_lens.to(torch.int32)
    out = flash_attn_with_kvcache(
        q.unsqueeze(1),
        k_cache,
        v_cache,
        cache_seqlens=lens,
        block_table=block_tables.to(torch.int32),
        softmax_scale=scale,
        causal=True,
        window_size=(-1, -1) if window is None else (window - 1, 0),
    )  # [B, 1, H, d]
    out = out.squeeze(1)
    return torch.where((lens > 0)[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


BACKENDS: list[tuple[str, DecodeFn, Callable[[torch.device | str], bool]]] = [
    ("triton", paged_decode_triton, is_available),
    ("flashinfer", paged_decode_flashinfer, _flashinfer_available),
    ("flash_attn", paged_decode_flash_attn, _flash_attn_available),
]
