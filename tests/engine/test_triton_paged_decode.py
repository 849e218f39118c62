"""engine/attention/triton_paged_decode.py against a naive per-request reference, on small shapes.

On CPU the Triton kernel runs in Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets
before anything imports triton); with ``--device cuda`` it is compiled for the GPU. Without Triton the
kernel tests skip and say so. The FlashInfer and FlashAttention adapters need their libraries and CUDA
and skip otherwise; the page list the FlashInfer adapter builds is checked here in plain torch.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from splitserve.common.arith import ceil_div
from splitserve.engine.attention import triton_paged_decode

BLOCK = 4
HEAD_DIM = 16
KV_HEADS = 2
POISON = 1e3  # written into every slot no request may attend to: reading one shows in the output


@pytest.fixture(scope="module")
def kernel(device: str):
    """The module, for tests that launch the kernel; on CPU it runs in Triton's interpreter (tests/conftest.py
    turns that on)."""
    triton = pytest.importorskip(
        "triton", reason="the paged decode kernel needs Triton (CUDA, or its CPU interpreter); triton is not installed"
    )
    module = importlib.import_module("splitserve.engine.attention.triton_paged_decode")
    if not device.startswith("cuda") and not triton.knobs.runtime.interpret:
        pytest.skip("on CPU the Triton kernel runs only in Triton's interpreter, and TRITON_INTERPRET=0 is set")
    return module


def make_batch(
    lens: list[int],
    heads: int,
    dtype: torch.dtype,
    device: str,
    head_dim: int = HEAD_DIM,
    seed: int = 0,
    block: int = BLOCK,
):
    """q, a cache whose blocks are scattered, block tables padded with a poisoned block, and lengths."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [ceil_div(n, block) for n in lens]
    max_blocks = max(blocks_per_req) + 1  # at least one padding column
    num_blocks = sum(blocks_per_req) + 2
    cache = torch.randn(num_blocks, 2, KV_HEADS, block, head_dim, generator=gen)
    poison = num_blocks - 1
    cache[poison] = POISON
    order = torch.randperm(num_blocks - 1, generator=gen).tolist()
    tables = torch.full((len(lens), max_blocks), poison, dtype=torch.int32)
    for b, (n, count) in enumerate(zip(lens, blocks_per_req)):
        ids = [order.pop() for _ in range(count)]
        tables[b, :count] = torch.tensor(ids, dtype=torch.int32)
        if n % block:
            cache[ids[-1], :, :, n % block :] = POISON  # the tail of the last block holds no key of this request
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    to = dict(dtype=dtype, device=device)
    return q.to(**to), cache.to(**to), tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def reference(q, cache, tables, lens, scale: float, window: int | None) -> torch.Tensor:
    """One request at a time, in float64, from the block table."""
    batch, heads, head_dim = q.shape
    group, block = heads // cache.shape[2], cache.shape[3]
    out = torch.zeros(batch, heads, head_dim, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        first = 0 if window is None else max(0, n - window)
        pos = torch.arange(first, n)
        if not len(pos):
            continue
        rows = cache.double().cpu()[tables[b].long().cpu()[pos // block], :, :, pos % block]  # [n, 2, kv_heads, d]
        k = rows[:, 0].repeat_interleave(group, dim=1)  # [n, heads, d]
        v = rows[:, 1].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].double().cpu(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


def tolerance(dtype: torch.dtype) -> dict:  # bf16/fp16: inputs exact, outputs rounded (and p, with tl.dot)
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


# Lengths: empty, one key, exactly one block, exactly two blocks, between block edges, and long enough
# for several loop iterations: with tl.dot (64 keys each), and without for groups 2 and 4 (2048 / (group *
# head_dim) keys each).
LENS = [0, 1, BLOCK, 7, 2 * BLOCK, 13, 150]
CASES = [
    (group, window, dtype, False)
    for group in (1, 2, 4)
    for window in (None, 3, BLOCK + 2)
    for dtype in (torch.float32, torch.bfloat16)
]
CASES += [
    (group, window, dtype, True)
    for group in (1, 4)
    for window in (None, BLOCK + 2)
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
]


@pytest.mark.parametrize(
    "group, window, dtype, use_dot",
    CASES,
    ids=[f"g{g}-w{w}-{str(t)[6:]}-{'dot' if u else 'sum'}" for g, w, t, u in CASES],
)
def test_matches_reference(kernel, device, group, window, dtype, use_dot):
    if use_dot and dtype == torch.bfloat16 and not device.startswith("cuda"):
        pytest.skip(
            "Triton 3.9's CPU interpreter computes bf16 tl.dot wrongly (a 16x16 product is off by ~1e10; "
            "fp16 and fp32 are right); this case runs on CUDA"
        )
    q, cache, tables, lens = make_batch(LENS, KV_HEADS * group, dtype, device)
    scale = 1.0  # sharp attention (scores of std 4): a wrong rescale across loop iterations shows
    out = kernel.paged_decode_triton(q, cache, tables, lens, scale, window, use_dot=use_dot)
    assert out.shape == q.shape and out.dtype == dtype
    expected = reference(q, cache, tables, lens, scale, window)
    torch.testing.assert_close(out.double().cpu(), expected, **tolerance(dtype))
    assert not out[0].any(), "a request with no context must give zeros"
    assert out[1:].abs().max() < 10, "a poisoned (unattended) slot was read"


@pytest.mark.parametrize("use_dot", [False, True], ids=["sum", "dot"])
@pytest.mark.parametrize("window", [None, 5])
def test_split_k_merges_partial_softmaxes(kernel, device, window, use_dot):
    # Long enough for several splits; with a window, whole splits hold no key of some requests.
    lens = [0, 3, 5 * BLOCK, 22]
    q, cache, tables, lens_t = make_batch(lens, KV_HEADS * 4, torch.float32, device, seed=1)
    expected = reference(q, cache, tables, lens_t, 0.3, window)
    for splits in (3, tables.shape[1]):  # uneven splits, and one block each
        out = kernel.paged_decode_triton(q, cache, tables, lens_t, 0.3, window, num_splits=splits, use_dot=use_dot)
        torch.testing.assert_close(out.double().cpu(), expected, atol=1e-5, rtol=1e-5)


def test_head_dim_not_a_power_of_two_and_strided_query(kernel, device):
    q, cache, tables, lens = make_batch([5, 12, 1], KV_HEADS * 2, torch.float32, device, head_dim=24, seed=2)
    wide = torch.cat([q, torch.ones_like(q)], dim=-1)[..., :24]  # a view with a row stride of 48
    assert not wide.is_contiguous()
    out = kernel.paged_decode_triton(wide, cache, tables, lens, 0.2, None)
    torch.testing.assert_close(out.double().cpu(), reference(q, cache, tables, lens, 0.2, None), atol=1e-5, rtol=1e-5)


def test_availability_and_registry():
    assert triton_paged_decode.is_available("cpu") is False
    assert [name for name, _, _ in triton_paged_decode.BACKENDS] == ["triton", "flashinfer", "flash_attn"]
    for _, fn, available in triton_paged_decode.BACKENDS:
        assert callable(fn) and available("cpu") is False


@pytest.mark.parametrize("window", [None, 3, BLOCK + 2])
def test_flashinfer_page_list_holds_the_attended_keys(window):
    """The page list the FlashInfer adapter plans with, read back as FlashInfer defines it (pure torch)."""
    lens = [0, 1, BLOCK, 7, 13]
    tables = torch.tensor([[9, 9, 9, 9], [5, 9, 9, 9], [2, 9, 9, 9], [7, 1, 9, 9], [3, 8, 4, 6]], dtype=torch.int32)
    indptr, indices, last = triton_paged_decode.flashinfer_page_list(tables, torch.tensor(lens), window, BLOCK)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    for b, n in enumerate(lens):
        pages = indices[indptr[b] : indptr[b + 1]].tolist()
        kv_len = (len(pages) - 1) * BLOCK + int(last[b])
        slots = [(page, t) for page in pages for t in range(BLOCK)][:kv_len]
        if window is not None:
            slots = slots[-window:]  # window_left = window - 1: the query's own position and window - 1 before
        first = 0 if window is None else max(0, n - window)
        expected = [(int(tables[b, t // BLOCK]), t % BLOCK) for t in range(first, n)]
        assert slots == (expected if n else [(0, 0)]), b


@pytest.mark.parametrize("name", ["flashinfer", "flash_attn"])
def test_library_adapters(device, name):
    _, fn, available = next(entry for entry in triton_paged_decode.BACKENDS if entry[0] == name)
    if not available(device):
        pytest.skip(f"the {name} adapter needs CUDA and the {name} package; not run on {device}")
    block = 256 if name == "flash_attn" else BLOCK  # flash_attn_with_kvcache's paged path: pages of 256k
    lens = [n * block // BLOCK for n in LENS]
    q, cache, tables, lens_t = make_batch(lens, KV_HEADS * 2, torch.bfloat16, device, head_dim=64, block=block)
    for window in (None, 3):
        out = fn(q, cache, tables, lens_t, 0.125, window)
        torch.testing.assert_close(
            out.double().cpu(), reference(q, cache, tables, lens_t, 0.125, window), **tolerance(torch.bfloat16)
        )
