"""The CPU prefill attention kernel (engine/attention/cpu_paged_prefill.py) against a float64 reference at its edge
cases, its refusals, and the engine with it against the engine with SDPA, token for token (fp32, greedy), with
prompts chunked, cached prefixes, sliding windows and blocks reused. tests/engine/test_parity*.py hold the default
(the kernel, where it serves) to transformers."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import LLM
from splitserve.engine.attention import cpu_paged_prefill
from splitserve.engine.core import EngineConfig
from tests.engine.parity import assert_no_blocks_in_use, greedy_runs, make_prompts, torch_threads

REASON = cpu_paged_prefill.unavailable_reason(torch.device("cpu"), torch.float32, 64)
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"the CPU prefill kernel does not serve here: {REASON}")


def reference(q, keys, values, context_len, scale, window):
    """q [Tq, H, d] at positions [L - Tq, L) against keys/values [kv_heads, L, d], in float64."""
    tq, heads, _ = q.shape
    group = heads // keys.shape[0]
    qpos = torch.arange(context_len - tq, context_len)[:, None]
    kpos = torch.arange(context_len)[None, :]
    allowed = kpos <= qpos
    if window:
        allowed &= kpos > qpos - window
    k = keys.double().repeat_interleave(group, 0)  # [H, L, d]
    v = values.double().repeat_interleave(group, 0)
    scores = torch.einsum("thd,hld->htl", q.double(), k) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("htl,hld->thd", scores.softmax(-1), v)


def make_case(tq, computed, heads, kv_heads, head_dim, block_size, seed=0, fused=True):
    """A cache whose every slot outside the request's context is NaN (a read of one shows in the output), the
    request's blocks in shuffled order among others, and q as a view of a fused projection (rows strided)."""
    gen = torch.Generator().manual_seed(seed)
    length = tq + computed
    blocks = -(-length // block_size)
    cache = torch.full((2 * blocks + 3, 2, kv_heads, block_size, head_dim), float("nan"))
    table = torch.randperm(cache.shape[0], generator=gen)[:blocks]
    keys = torch.randn(kv_heads, length, head_dim, generator=gen)
    values = torch.randn(kv_heads, length, head_dim, generator=gen)
    for pos in range(length):
        cache[table[pos // block_size], 0, :, pos % block_size] = keys[:, pos]
        cache[table[pos // block_size], 1, :, pos % block_size] = values[:, pos]
    if fused:
        qkv = torch.randn(tq, (heads + 2 * kv_heads) * head_dim, generator=gen)
        q = qkv[:, : heads * head_dim].view(tq, heads, head_dim)
    else:
        q = torch.randn(tq, heads, head_dim, generator=gen)
    return q, cache, table, keys, values


def check(tq, computed=0, heads=14, kv_heads=2, head_dim=64, block_size=16, window=None, fused=True):
    q, cache, table, keys, values = make_case(tq, computed, heads, kv_heads, head_dim, block_size, fused=fused)
    scale = head_dim**-0.5
    got = cpu_paged_prefill.paged_prefill_cpu(q, cache, table, tq + computed, scale, window)
    want = reference(q, keys, values, tq + computed, scale, window)
    assert got.shape == (tq, heads, head_dim) and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_block_boundaries(block_size):
    k = 3 * block_size
    for tq, computed in ((k, 0), (k - 1, 0), (k + 1, 0), (block_size, k), (block_size + 1, k - 1)):
        check(tq, computed, block_size=block_size)


@needs_kernel
def test_one_token_contexts_and_single_queries():
    check(1)  # a one-token prompt
    check(1, computed=1)
    check(1, computed=200)  # one new token after a long cached prefix


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (14, 2), (8, 1)])  # groups 1, 4, 7, 8
@pytest.mark.parametrize("head_dim", [16, 48, 64, 128])
def test_groups_and_head_dims(heads, kv_heads, head_dim):
    check(37, computed=11, heads=heads, kv_heads=kv_heads, head_dim=head_dim)


@needs_kernel
@pytest.mark.parametrize("tq, computed", [(300, 0), (129, 0), (97, 700), (256, 256)])
def test_long_chunks_cross_the_softmax_chunks(tq, computed):
    """More keys than one softmax chunk (128) and more positions than one work item, in every combination."""
    check(tq, computed)


@needs_kernel
@pytest.mark.parametrize("window", [1, 8, 24, 100, 1000])  # from one key to beyond the context
def test_windows(window):
    check(60, window=window)
    check(40, computed=90, window=window)


@needs_kernel
def test_contiguous_queries_and_threads():
    check(50, computed=20, fused=False)
    with torch_threads(1):
        check(200, computed=30)


@needs_kernel
def test_refusals_name_what_is_wrong():
    q, cache, table, _, _ = make_case(8, 4, 4, 2, 64, 4)
    op = cpu_paged_prefill.paged_prefill_cpu
    with pytest.raises(RuntimeError, match="float32 only"):
        op(q.bfloat16(), cache.bfloat16(), table, 12, 0.1, None)
    with pytest.raises(RuntimeError, match="does not cover the context"):
        op(q, cache, table[:2], 12, 0.1, None)
    with pytest.raises(RuntimeError, match="queries <= context_len"):
        op(q, cache, table, 7, 0.1, None)
    with pytest.raises(RuntimeError, match="table must be int64"):
        op(q, cache, table.int(), 12, 0.1, None)
    q24, cache24, table24, _, _ = make_case(8, 0, 4, 2, 24, 4)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16"):
        op(q24, cache24, table24, 8, 0.1, None)


def test_unavailable_reasons():
    assert "float32 only" in cpu_paged_prefill.unavailable_reason(torch.device("cpu"), torch.bfloat16, 64)
    assert "not on the CPU" in cpu_paged_prefill.unavailable_reason(torch.device("cuda"), torch.float32, 64)
    assert "head_dim 24" in cpu_paged_prefill.unavailable_reason(torch.device("cpu"), torch.float32, 24)


# Chunks of 6 prompt tokens with up to 4 sequences: prefill chunks share steps with decodes, and later chunks
# attend to earlier ones from the cache; prefix caching gives first chunks a cached context too.
ENGINE = dict(
    dtype="float32",
    block_size=4,
    num_blocks=64,
    max_model_len=96,
    max_num_seqs=4,
    max_num_batched_tokens=12,
    prefill_chunk_size=6,
)


class CallCounter:
    """Counts the prefill kernel's calls, and those with a context before the chunk."""

    def __init__(self, llm: LLM) -> None:
        self.calls = self.later = 0
        inner = llm.runner.prefill_attention

        def counting(q, cache, table, context_len, scale, window):
            self.calls += 1
            self.later += context_len > q.shape[0]
            return inner(q, cache, table, context_len, scale, window)

        llm.runner.prefill_attention = counting


@needs_kernel
@pytest.mark.parametrize("name", ["tiny", "llama", "qwen2", "mistral"])
def test_kernel_equals_sdpa_token_for_token(name, arch_model_dirs, tiny_model_dir):
    model_dir = {"tiny": tiny_model_dir, **arch_model_dirs}[name]
    with torch_threads(1):
        kernel = LLM(model_dir, **ENGINE)
        sdpa = LLM(model_dir, prefill_attention="sdpa", **ENGINE)
        assert kernel.core.prefill_backend == "paged_prefill cpu" and sdpa.core.prefill_backend == "sdpa"
        assert sdpa.runner.prefill_attention is None
        counter = CallCounter(kernel)
        # Prompts of 2 to 40 tokens (chunked in 6s, past the windows of 24), two sharing a 16-token prefix that
        # the second finds cached; more requests than max_num_seqs, so later ones reuse freed blocks.
        prompts = make_prompts(11, [2, 40, 13, 27, 7, 33, 19])
        prompts.append(prompts[1][:16] + prompts[3][:9])
        max_tokens = [12, 4, 20, 6, 15, 9, 5, 8]
        expected = greedy_runs(sdpa, prompts, max_tokens)
        got = greedy_runs(kernel, prompts, max_tokens)
    assert got == expected
    assert all(len(set(t)) > 1 for t in got)  # not degenerate
    layers = kernel.core.model_config.num_layers
    assert counter.calls > 0 and counter.calls % layers == 0
    assert counter.later > 0  # later chunks attended through the kernel too
    for llm in (kernel, sdpa):
        assert_no_blocks_in_use(llm)


def test_sdpa_where_the_kernel_does_not_serve(tiny_model_dir):
    bf16 = LLM(tiny_model_dir, **{**ENGINE, "dtype": "bfloat16"})
    assert bf16.core.prefill_backend == "sdpa" and bf16.runner.prefill_attention is None
    out = greedy_runs(bf16, make_prompts(3, [5, 9]), [4, 4])
    assert all(len(t) == 4 for t in out)
    assert_no_blocks_in_use(bf16)


def test_setting_is_checked():
    with pytest.raises(ValueError, match="prefill_attention"):
        EngineConfig(model_dir="m", prefill_attention="fast")
    assert EngineConfig(model_dir="m").prefill_attention == "in_place"
