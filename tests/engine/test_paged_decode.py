"""``splitserve.engine.attention.paged_decode``: the torch reference against a naive per-request attention, and the
backend registry.

The naive reference reads each request's keys straight from its block table in a Python loop, cuts them
to its window and runs a float64 softmax; the static-shape reference must agree with it on scattered
block tables, mixed lengths, GQA, sliding windows, and padding rows (length 0, a dummy block), which
must neither turn into NaN nor change any other row.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.common.arith import ceil_div
from splitserve.engine.attention import cpu_paged_decode, paged_decode
from splitserve.engine.attention.paged_decode import REGISTRY, BackendRegistry, paged_decode_torch, select_backend

KV_HEADS, HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 2, 6, 16, 4, 40, 6


def naive_decode(q, cache_layer, tables: list[list[int]], lens: list[int], scale: float, window: int | None):
    out = torch.zeros_like(q, dtype=torch.float64)
    group = HEADS // KV_HEADS
    for b, (table, n) in enumerate(zip(tables, lens)):
        start = 0 if window is None else max(0, n - window)
        positions = range(start, n)
        keys = torch.stack([cache_layer[table[p // BLOCK_SIZE], 0, :, p % BLOCK_SIZE] for p in positions], 1)
        values = torch.stack([cache_layer[table[p // BLOCK_SIZE], 1, :, p % BLOCK_SIZE] for p in positions], 1)
        for h in range(HEADS):
            scores = keys[h // group].double() @ q[b, h].double() * scale  # [L]
            out[b, h] = torch.softmax(scores, 0) @ values[h // group].double()
    return out


def make_case(seed: int, lens: list[int], dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(NUM_BLOCKS, 2, KV_HEADS, BLOCK_SIZE, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
    blocks = torch.randperm(NUM_BLOCKS - 1, generator=gen).tolist()  # block NUM_BLOCKS - 1 is the dummy
    tables = []
    for n in lens:
        used = ceil_div(n, BLOCK_SIZE)
        tables.append(blocks[:used])
        blocks = blocks[used:]
    return q, cache, tables


def padded(tables: list[list[int]], dtype=torch.int32) -> torch.Tensor:
    dummy = NUM_BLOCKS - 1
    return torch.tensor([t + [dummy] * (MAX_BLOCKS - len(t)) for t in tables], dtype=dtype)


@pytest.mark.parametrize("window", [None, 5, 9])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_matches_naive_per_request_attention(window, table_dtype):
    lens = [1, 3, 4, 5, 13, 24]  # block edges, a full table (24 = MAX_BLOCKS * BLOCK_SIZE), one token
    q, cache, tables = make_case(0, lens)
    out = paged_decode_torch(q, cache, padded(tables, table_dtype), torch.tensor(lens), HEAD_DIM**-0.5, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = naive_decode(q, cache, tables, lens, HEAD_DIM**-0.5, window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_padding_rows_are_finite_and_leave_other_rows_alone():
    lens = [7, 19, 2]
    q, cache, tables = make_case(1, lens)
    alone = paged_decode_torch(q, cache, padded(tables), torch.tensor(lens), 0.25, 6)
    # Two padding rows (length 0, only the dummy block) between and after the live ones; the dummy
    # block holds garbage that must not matter.
    cache[NUM_BLOCKS - 1] = 1e4
    q_padded = torch.cat([q[:1], torch.randn(1, HEADS, HEAD_DIM), q[1:], torch.randn(1, HEADS, HEAD_DIM)])
    tables_padded = [tables[0], [], tables[1], tables[2], []]
    lens_padded = torch.tensor([7, 0, 19, 2, 0])
    out = paged_decode_torch(q_padded, cache, padded(tables_padded), lens_padded, 0.25, 6)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[[0, 2, 3]], alone, atol=0, rtol=0)


def test_bf16_follows_the_fp32_result():
    lens = [6, 17]
    q, cache, tables = make_case(2, lens)
    ref = paged_decode_torch(q, cache, padded(tables), torch.tensor(lens), 0.25, None)
    out = paged_decode_torch(q.bfloat16(), cache.bfloat16(), padded(tables), torch.tensor(lens), 0.25, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_registry_selects_the_preferred_available_backend(monkeypatch):
    # Only the backends registered here: none of the optional modules' (the CPU kernel would win float32).
    monkeypatch.setattr(paged_decode, "OPTIONAL_BACKEND_MODULES", ())
    registry = BackendRegistry()
    registry.register("torch", paged_decode_torch, lambda device, dtype: True, priority=0)
    registry.register("fast", paged_decode_torch, lambda device, dtype: dtype == torch.bfloat16, priority=10)
    registry.register("never", paged_decode_torch, lambda device, dtype: False, priority=20)
    assert registry.select("cpu", torch.bfloat16).name == "fast"
    assert registry.select("cpu", torch.float32).name == "torch"
    assert registry.select("cpu", torch.bfloat16, name="torch").name == "torch"
    with pytest.raises(ValueError, match="'never' is not available"):
        registry.select("cpu", torch.float32, name="never")
    with pytest.raises(ValueError, match="unknown 'nope'"):
        registry.select("cpu", torch.float32, name="nope")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("fast", paged_decode_torch, lambda device, dtype: True)


def test_process_registry_always_has_torch():
    assert "torch" in REGISTRY.names()
    assert select_backend("cpu", torch.float32, name="torch").fn is paged_decode_torch
    # The default on the CPU: the in-place kernel for float32 and bfloat16 where it builds; the reference for float16.
    assert select_backend("cpu", torch.float16).fn is paged_decode_torch
    expected = "cpu" if cpu_paged_decode.load() is not None else "torch"
    assert select_backend("cpu", torch.float32).name == expected
    assert select_backend("cpu", torch.bfloat16).name == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_selected_cuda_backend_matches_the_reference(dtype):
    lens = [1, 5, 24, 13]
    q, cache, tables = make_case(3, lens, dtype)
    backend = select_backend("cuda", dtype)
    args = (padded(tables).cuda(), torch.tensor(lens, dtype=torch.int32).cuda(), HEAD_DIM**-0.5)
    for window in (None, 7):
        out = backend.fn(q.cuda(), cache.cuda(), *args, window)
        ref = paged_decode_torch(q.cuda().float(), cache.cuda().float(), *args, window)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_the_gpu_kernels_register_behind_the_same_interface():
    """engine/attention/triton_paged_decode.py's BACKENDS join the registry on first selection: on the CPU the
    reference is chosen (for float32 and bfloat16 the CPU kernel, where it builds: no GPU kernel), and the Triton
    kernel (preferred where it runs) refuses a CPU device by name."""
    pytest.importorskip("triton", reason="triton is not installed: the kernels cannot register")
    from splitserve.engine.attention.paged_decode import REGISTRY, select_backend

    assert select_backend("cpu", torch.float16).name == "torch"
    on_cpu = "cpu" if cpu_paged_decode.load() is not None else "torch"
    assert select_backend("cpu", torch.float32).name == on_cpu
    assert select_backend("cpu", torch.bfloat16).name == on_cpu
    assert {"torch", "triton", "flashinfer", "flash_attn"} <= set(REGISTRY.names())
    triton_backend = REGISTRY._backends["triton"]
    assert triton_backend.priority > REGISTRY._backends["torch"].priority > REGISTRY._backends["flashinfer"].priority
    with pytest.raises(ValueError, match="'triton' is not available on cpu"):
        select_backend("cpu", torch.bfloat16, name="triton")
