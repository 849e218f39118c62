"""The dynamic path's gather decode (``paged_attention``'s decodes without a ``paged_decode`` backend:
``dynamic_decode_attention: gather``, and any dtype where the kernel is unavailable): each KV head's query group
folded into SDPA's query axis.

Against a naive per-request float64 attention (``test_paged_decode.naive_decode``) in float32, on equal and mixed
lengths, sliding windows and scattered block tables; in bf16 against SDPA with the KV heads broadcast
(``enable_gqa``, what transformers runs where it passes no mask): the two forms sum in different GEMM shapes,
so an element may differ, by at most one bf16 step, and almost all are equal. Greedy output through this
path is held to transformers' by tests/engine/test_parity_paths.py (bf16) within the tie rule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.attention.paged_attention import AttentionMetadata, paged_attention
from splitserve.engine.kv_cache.cache import context_rows
from tests.engine.test_paged_decode import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, make_case, naive_decode


def gather_decode(q, cache, tables: list[list[int]], lens: list[int], window: int | None) -> torch.Tensor:
    """The decodes of one step through ``paged_attention`` as the model runner plans them: the tables padded to
    the longest with their own last block (never read past a row's length), the new K/V written in place."""
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [t[-1]] * (width - len(t)) for t in tables])
    last = [n - 1 for n in lens]
    slot_blocks = torch.tensor([t[p // BLOCK_SIZE] for t, p in zip(tables, last)])
    slot_offsets = torch.tensor([p % BLOCK_SIZE for p in last])
    # The newest K/V as the cache holds them, so the write changes nothing and the references see the same cache.
    k = cache[slot_blocks, 0, :, slot_offsets].clone()
    v = cache[slot_blocks, 1, :, slot_offsets].clone()
    meta = AttentionMetadata(
        slot_blocks=slot_blocks,
        slot_offsets=slot_offsets,
        num_decodes=len(lens),
        decode_rows=context_rows(table.reshape(-1), KV_HEADS),
        decode_context_lens=list(lens),
    )
    return paged_attention(q, k, v, cache, meta, HEAD_DIM**-0.5, window)


@pytest.mark.parametrize("window", [None, 5, 9])
@pytest.mark.parametrize("lens", [[13], [24, 24, 24], [1, 3, 4, 5, 13, 24]])
def test_float32_matches_naive_per_request_attention(lens, window):
    q, cache, tables = make_case(3, lens)
    out = gather_decode(q, cache, tables, lens, window)
    assert out.shape == q.shape and out.dtype == torch.float32
    expected = naive_decode(q, cache, tables, lens, HEAD_DIM**-0.5, window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_bf16_within_one_step_of_sdpa_with_the_kv_heads_broadcast():
    """Equal lengths (no mask, where transformers broadcasts the KV heads): the folded form's bf16 outputs
    against ``enable_gqa`` on the same keys, over many cases; each element equal or one bf16 step apart."""
    total = unequal = 0
    for seed in range(40):
        length = 1 + (seed * 7) % 24
        lens = [length] * (1 + seed % 3)
        q, cache, tables = make_case(100 + seed, lens, torch.bfloat16)
        out = gather_decode(q, cache, tables, lens, None)
        keys = torch.stack([cache[t, 0].transpose(0, 1).reshape(KV_HEADS, -1, HEAD_DIM)[:, :length] for t in tables])
        values = torch.stack([cache[t, 1].transpose(0, 1).reshape(KV_HEADS, -1, HEAD_DIM)[:, :length] for t in tables])
        broadcast = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, scale=HEAD_DIM**-0.5, enable_gqa=True)
        broadcast = broadcast.reshape(len(lens), HEADS, HEAD_DIM)
        assert out.dtype == torch.bfloat16
        a, b = out.float(), broadcast.float()
        # One bf16 step at each element's magnitude (8 bits of mantissa), and a floor for values near zero.
        step = torch.maximum(a.abs(), b.abs()).clamp(min=2**-60) * 2**-7
        assert bool(((a - b).abs() <= step).all()), f"seed {seed}: more than one bf16 step apart"
        total += a.numel()
        unequal += int((a != b).sum())
    assert unequal <= total // 100, f"{unequal} of {total} elements differ"
