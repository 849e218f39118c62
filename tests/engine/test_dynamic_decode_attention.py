"""The dynamic path's decodes attended in place (``dynamic_decode_attention="in_place"``, the CPU kernel) equal the
gather token for token (fp32, greedy), on every architecture the engine loads (Qwen2 with a sliding-window layer,
Mistral with a window on every layer), with decodes and prefill chunks mixed in one step, blocks reused after
being freed and contexts past the windows. tests/engine/test_parity*.py hold the default (in place) to
transformers; this holds it to the older gather on the same requests, and checks which one each step ran.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import LLM
from splitserve.engine.attention import cpu_paged_decode
from splitserve.engine.core import DYNAMIC_DECODE_BACKEND, EngineConfig
from tests.engine.parity import assert_no_blocks_in_use, greedy_runs, make_prompts, torch_threads

# Chunks of 6 prompt tokens with up to 4 sequences: prefill chunks share steps with running decodes.
ENGINE = dict(
    dtype="float32",
    block_size=4,
    num_blocks=48,
    max_model_len=96,
    max_num_seqs=4,
    max_num_batched_tokens=12,
    prefill_chunk_size=6,
    decode_path="dynamic",
)

needs_kernel = pytest.mark.skipif(
    not cpu_paged_decode.is_available(torch.device("cpu"), torch.float32),
    reason=f"the CPU paged-decode kernel is unavailable here: {cpu_paged_decode.failure()}",
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def model_dirs(arch_model_dirs, tiny_model_dir):
    return {"tiny": tiny_model_dir, **arch_model_dirs}


class CallCounter:
    """Counts the in-place backend's calls and the decode rows they attended."""

    def __init__(self, llm: LLM) -> None:
        self.calls = self.rows = 0
        runner = llm.runner
        inner = runner.decode_attention

        def counting(q, cache, tables, lens, scale, window):
            self.calls += 1
            self.rows += q.shape[0]
            return inner(q, cache, tables, lens, scale, window)

        runner.decode_attention = counting


@needs_kernel
@pytest.mark.parametrize("name", ["tiny", "llama", "qwen2", "mistral"])
def test_in_place_equals_the_gather_token_for_token(name, model_dirs):
    in_place = LLM(model_dirs[name], **ENGINE)
    gather = LLM(model_dirs[name], dynamic_decode_attention="gather", **ENGINE)
    assert in_place.core.dynamic_decode_backend == "paged_decode cpu"
    assert gather.core.dynamic_decode_backend == DYNAMIC_DECODE_BACKEND and gather.runner.decode_attention is None
    counter = CallCounter(in_place)
    # 9 requests of 4 to 30 prompt tokens, 3 to 30 new: contexts to 60 tokens cross the windows (24) and many
    # block edges; more requests than max_num_seqs and 48 blocks make later ones reuse freed blocks.
    prompts = make_prompts(7, [4, 30, 11, 25, 6, 18, 9, 27, 14])
    max_tokens = [30, 3, 17, 8, 25, 5, 12, 30, 9]
    expected = greedy_runs(gather, prompts, max_tokens)
    got = greedy_runs(in_place, prompts, max_tokens)
    assert got == expected
    assert len({tuple(t) for t in got}) > 1 and all(len(set(t)) > 1 for t in got)  # not degenerate
    layers = in_place.core.model_config.num_layers
    assert counter.calls > 0 and counter.calls % layers == 0
    assert counter.rows >= layers * (sum(max_tokens) - len(max_tokens))  # every decode attended in place
    for llm in (in_place, gather):
        assert_no_blocks_in_use(llm)


@needs_kernel
@pytest.mark.parametrize("name", ["tiny", "llama", "qwen2", "mistral"])
def test_bf16_in_place_equals_the_gather_one_request_at_a_time(name, model_dirs):
    """In bfloat16 the kernel takes SDPA's steps (tests/engine/test_cpu_decode_bf16.py): a request decoded alone, as
    transformers decodes it, gets the gather's tokens (SDPA over its own span, windows cut). In a batch of mixed
    lengths the gather's SDPA runs over the longest row's span with a mask, which groups the shorter rows'
    probabilities into other vector lanes than their own span does, so near-ties may flip there; the bf16 parity
    tests hold either to transformers (tests/engine/test_parity_paths.py)."""
    engine = {**ENGINE, "dtype": "bfloat16", "max_num_seqs": 1}
    in_place = LLM(model_dirs[name], **engine)
    gather = LLM(model_dirs[name], dynamic_decode_attention="gather", **engine)
    assert in_place.core.dynamic_decode_backend == "paged_decode cpu"
    counter = CallCounter(in_place)
    prompts = make_prompts(8, [4, 30, 11, 25])
    max_tokens = [30, 20, 30, 25]
    got, expected = greedy_runs(in_place, prompts, max_tokens), greedy_runs(gather, prompts, max_tokens)
    assert got == expected
    assert len({tuple(t) for t in got}) > 1 and all(len(set(t)) > 1 for t in got)
    layers = in_place.core.model_config.num_layers
    assert counter.rows >= layers * (sum(max_tokens) - len(max_tokens))
    for llm in (in_place, gather):
        assert_no_blocks_in_use(llm)


@needs_kernel
def test_gather_is_used_where_only_the_reference_is_available(tiny_model_dir, monkeypatch):
    """The kernel runs float32 and bfloat16 decodes; disabled, the gather does."""
    bf16 = LLM(tiny_model_dir, **{**ENGINE, "dtype": "bfloat16"})
    assert bf16.core.dynamic_decode_backend == "paged_decode cpu" and bf16.runner.decode_attention is not None
    monkeypatch.setattr(cpu_paged_decode, "is_available", lambda device, dtype: False)
    from splitserve.engine.attention import paged_decode

    monkeypatch.setattr(paged_decode, "REGISTRY", paged_decode.BackendRegistry())
    paged_decode.REGISTRY.register("torch", paged_decode.paged_decode_torch, lambda device, dtype: True, priority=0)
    disabled = LLM(tiny_model_dir, **ENGINE)
    assert disabled.core.dynamic_decode_backend == DYNAMIC_DECODE_BACKEND and disabled.runner.decode_attention is None
    out = greedy_runs(disabled, make_prompts(3, [5, 9]), [6, 6])
    assert all(len(t) == 6 for t in out)
    assert_no_blocks_in_use(disabled)


def test_setting_is_checked():
    with pytest.raises(ValueError, match="dynamic_decode_attention"):
        EngineConfig(model_dir="m", dynamic_decode_attention="fast")
    assert EngineConfig(model_dir="m").dynamic_decode_attention == "in_place"
