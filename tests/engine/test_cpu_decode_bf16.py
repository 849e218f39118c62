"""The CPU decode kernel in bfloat16 (engine/attention/cpu_paged_decode.cpp, its bf16 section) against SDPA, which
transformers and the gather path decode with: the same steps as torch's flash attention, its exp (``fexp_u20``),
its bf16 probabilities and its order of their sum, under torch's AVX-512, AVX2 and default kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.attention import cpu_paged_decode

ROOT = Path(__file__).resolve().parents[2]
needs_kernel = pytest.mark.skipif(
    cpu_paged_decode.load() is None, reason=f"cpu paged decode kernel not built: {cpu_paged_decode.failure()}"
)


def paged(keys: torch.Tensor, values: torch.Tensor, block_size: int, gen: torch.Generator):
    """keys/values [B, kv_heads, L, d] -> (cache, tables): each row's positions in blocks scattered over the cache."""
    batch, kv_heads, length, d = keys.shape
    nb = -(-length // block_size)
    cache = torch.randn(batch * nb + 3, 2, kv_heads, block_size, d, generator=gen).to(keys.dtype)
    tables = torch.randperm(batch * nb + 3, generator=gen)[: batch * nb].view(batch, nb)
    for b in range(batch):
        for kv, src in ((0, keys[b]), (1, values[b])):
            padded = torch.zeros(kv_heads, nb * block_size, d, dtype=keys.dtype)
            padded[:, :length] = src
            cache[tables[b], kv] = padded.view(kv_heads, nb, block_size, d).transpose(0, 1)
    return cache, tables


def sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, d] against [B, kv_heads, L, d]: each KV head's query group folded, as the gather path calls SDPA."""
    batch, heads, d = q.shape
    grouped = q.view(batch, keys.shape[1], heads // keys.shape[1], d)
    return F.scaled_dot_product_attention(grouped, keys, values, scale=scale).reshape(batch, heads, d)


def exact_scores_case(length: int, d: int, seed: int, heads: int = 1):
    """Queries (``heads`` of them on one KV head) whose scores are exact in any order of sums: keys and values rows
    of the identity, so that the output is each position's bf16 probability times 1/sum. What is left to differ is
    the exp, the probabilities' rounding and their sum's order."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, heads, d, generator=gen) * 8).bfloat16()
    eye = torch.eye(d)[:length].bfloat16()[None, None]  # [1, 1, L, d]
    cache, tables = paged(eye, eye, 16, gen)
    return q, eye, cache, tables


def differing(lengths, d, trials, heads: int = 1) -> dict[str, int]:
    out = {}
    for length in lengths:
        n = 0
        for seed in range(trials):
            q, eye, cache, tables = exact_scores_case(length, d, seed, heads)
            want = sdpa(q, eye, eye, 0.125)
            got = cpu_paged_decode.paged_decode_cpu(q, cache, tables, torch.tensor([length]), 0.125, None)
            n += int((got != want).sum())
        out[str(length)] = n
    return out


@needs_kernel
@pytest.mark.parametrize(
    "heads", [1, 5, 9]
)  # keys transposed (under 4 queries a KV head); queries in lanes, 1 or 2 passes
def test_exact_scores_give_sdpa_s_bits(heads):
    """Lengths with and without a tail past torch's whole vectors (16 or 8 lanes), over one and several blocks."""
    got = differing([1, 7, 16, 17, 64], 64, 12, heads) | differing([70, 128], 128, 6, heads)
    assert got == dict.fromkeys(got, 0), got


CHILD = """
import json, sys
sys.path.insert(0, {root!r})
import torch
from tests.engine.test_cpu_decode_bf16 import differing
from splitserve.engine.attention import cpu_paged_decode
print(json.dumps({{"capability": torch.backends.cpu.get_cpu_capability(), "form": cpu_paged_decode.sdpa_form(),
                  "differing": differing([1, 17, 64], 64, 8) | differing([70], 128, 4)}}))
"""


@needs_kernel
@pytest.mark.parametrize("capability, form", [("avx2", [8, True]), ("default", [8, False])])
def test_exact_scores_under_torch_s_other_kernels(capability, form):
    """torch's AVX2 kernels sum 8 lanes with the same exp; its default build sums one by one with std::exp."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    run = subprocess.run(
        [sys.executable, "-c", CHILD.format(root=str(ROOT))], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["capability"] == capability.upper()
    assert result["form"] == form
    assert result["differing"] == dict.fromkeys(result["differing"], 0), result


@needs_kernel
def test_a_wrong_form_is_visible():
    """The checks above can fail: the other exp and sum order move outputs where the right ones move none."""
    op = getattr(torch.ops, cpu_paged_decode.load().__name__).paged_decode
    lanes, poly = cpu_paged_decode.sdpa_form()
    moved = 0
    for seed in range(12):
        q, eye, cache, tables = exact_scores_case(64, 64, seed)
        want = sdpa(q, eye, eye, 0.125)
        assert torch.equal(op(q, cache, tables, torch.tensor([64]), 0.125, 0, lanes, poly), want)
        moved += int((op(q, cache, tables, torch.tensor([64]), 0.125, 0, lanes, not poly) != want).sum())
    assert moved > 0


@needs_kernel
@pytest.mark.parametrize("length", [17, 150, 512, 600, 1100])
def test_random_inputs_agree_with_sdpa_but_for_sum_order(length):
    """Random q, k, v: the dot products and the values' sums may be summed in another order than SDPA's GEMMs (on
    this machine they were not: no output moved but at 600 positions, 0.03%); an output that moves, moves by a
    bf16 step."""
    gen = torch.Generator().manual_seed(length)
    batch, heads, kv_heads, d = 3, 14, 2, 64
    q = (torch.randn(batch, heads, d, generator=gen) * 2).bfloat16()
    keys = (torch.randn(batch, kv_heads, length, d, generator=gen) * 1.5).bfloat16()
    values = (torch.randn(batch, kv_heads, length, d, generator=gen) * 1.5).bfloat16()
    cache, tables = paged(keys, values, 16, gen)
    want = sdpa(q, keys, values, d**-0.5)
    got = cpu_paged_decode.paged_decode_cpu(q, cache, tables, torch.full((batch,), length), d**-0.5, None)
    moved = (got != want).float().mean().item()
    assert moved <= 0.002, moved
    step = (got.float() - want.float()).abs() / want.float().abs().clamp_min(2.0**-20)
    assert float(step.max()) <= 2.0**-6, float(step.max())  # one bf16 step is 2^-8 to 2^-7 of a value


@needs_kernel
def test_window_rows_attend_their_span():
    gen = torch.Generator().manual_seed(5)
    length, window, d = 90, 40, 64
    q = torch.randn(1, 4, d, generator=gen).bfloat16()
    keys = torch.randn(1, 2, length, d, generator=gen).bfloat16()
    values = torch.randn(1, 2, length, d, generator=gen).bfloat16()
    cache, tables = paged(keys, values, 16, gen)
    want = sdpa(q, keys[:, :, -window:], values[:, :, -window:], 0.125)
    got = cpu_paged_decode.paged_decode_cpu(q, cache, tables, torch.tensor([length]), 0.125, window)
    assert (got != want).float().mean().item() <= 0.01
    assert not torch.equal(got, sdpa(q, keys, values, 0.125))


@needs_kernel
def test_bad_lanes_are_refused():
    q, eye, cache, tables = exact_scores_case(8, 64, 0)
    op = getattr(torch.ops, cpu_paged_decode.load().__name__).paged_decode
    with pytest.raises(RuntimeError, match="lanes"):
        op(q, cache, tables, torch.tensor([8]), 0.125, 0, 12, True)


def test_sdpa_form_follows_torch_s_kernels(monkeypatch):
    cpu_paged_decode.sdpa_form.cache_clear()
    try:
        for capability, form in [("AVX512", (16, True)), ("AVX2", (8, True)), ("DEFAULT", (8, False))]:
            monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
            cpu_paged_decode.sdpa_form.cache_clear()
            assert cpu_paged_decode.sdpa_form() == form
    finally:
        monkeypatch.undo()
        cpu_paged_decode.sdpa_form.cache_clear()
