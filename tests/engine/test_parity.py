"""Parity with Hugging Face transformers on the same checkpoint, in fp32.

For Llama, Qwen2 and Mistral: prefill logits allclose, and greedy generation identical token for
token for a batch of prompts of different lengths, with prefix-cache hits and with chunked prefill in
chunk sizes that are not multiples of the block size. A run may part from transformers' only at a
step where transformers' own top-1 minus top-2 logit gap is below 1e-3 (a genuine tie), and is
compared only up to there; every test also requires all but one of its reference runs to be tie-free
(``assert_greedy_parity``), so those must match in full. Every run ends with no block in use and the
allocator's invariants holding. These models are small (hidden 128): every projection runs plain
``F.linear``; test_parity_paths.py covers the prepacked path and bf16.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from tests.engine.parity import (
    assert_greedy_parity,
    assert_no_blocks_in_use,
    assert_not_degenerate,
    hf_greedy,
    make_prompts,
    prompt_logits,
    torch_threads,
)

ARCHS = ["llama", "qwen2", "mistral"]
NEW_TOKENS = 40
TIE_GAP = 1e-3
PROMPT_LENGTHS = [3, 17, 30, 47, 64]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def hf_models(arch_model_dirs):
    from transformers import AutoModelForCausalLM

    models = {}
    for arch in ARCHS:
        m = AutoModelForCausalLM.from_pretrained(arch_model_dirs[arch], dtype=torch.float32).eval()
        models[arch] = m
    return models


def make_llm(model_dir, device: str, **kw) -> LLM:
    kw.setdefault("num_blocks", 256)
    return LLM(model_dir, dtype="float32", device=device, block_size=16, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_allclose(arch, arch_model_dirs, hf_models, device):
    llm = make_llm(arch_model_dirs[arch], device)
    for prompt in make_prompts(1, [1, 9, 40, 70]):
        ours = prompt_logits(llm, prompt).cpu()
        with torch.inference_mode():
            ref = hf_models[arch](torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)
    assert_no_blocks_in_use(llm)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "mode",
    [
        pytest.param({}, id="batched"),
        pytest.param({"prefill_chunk_size": 7, "max_num_batched_tokens": 23}, id="chunked"),
    ],
)
def test_greedy_batch_matches_transformers(arch, mode, arch_model_dirs, hf_models, device):
    """5 prompts of mixed lengths, 40 tokens: identical token for token to transformers' greedy run,
    except that a run may part from it at a step where transformers' top-1 minus top-2 gap is below
    1e-3, and is compared only up to there. At least 4 of the 5 reference runs have no such tie, so
    those 4 must match in all 40 tokens."""
    llm = make_llm(arch_model_dirs[arch], device, **mode)
    prompts = make_prompts(2, PROMPT_LENGTHS)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    refs = [hf_greedy(hf_models[arch], prompt, NEW_TOKENS) for prompt in prompts]
    assert_greedy_parity([o.token_ids for o in outputs], refs, TIE_GAP, len(prompts) - 1, arch)
    assert all(o.finish_reason == "length" for o in outputs)
    assert_not_degenerate([o.token_ids for o in outputs])
    assert_no_blocks_in_use(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_prefix_cache_hits(arch, arch_model_dirs, hf_models, device):
    llm = make_llm(arch_model_dirs[arch], device, prefill_chunk_size=13)
    shared = make_prompts(3, [40])[0]
    suffixes = make_prompts(4, [5, 20, 1])
    first = llm.generate([shared + [7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert first[0].num_cached_tokens == 0
    prompts = [shared + s for s in suffixes]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    # two full 16-token blocks of the shared 40-token prefix
    assert [o.num_cached_tokens for o in outputs] == [32] * len(prompts)
    refs = [hf_greedy(hf_models[arch], prompt, NEW_TOKENS) for prompt in prompts]
    assert_greedy_parity([o.token_ids for o in outputs], refs, TIE_GAP, len(prompts) - 1, f"{arch} cached")
    assert_no_blocks_in_use(llm)
    assert llm.kv_status()["cached"] > 0


def test_decode_across_many_blocks_and_preemption(arch_model_dirs, hf_models, device):
    """A cache too small for the batch forces preemption and recompute; output is unchanged."""
    arch = "llama"
    llm = make_llm(arch_model_dirs[arch], device, num_blocks=12)
    prompts = make_prompts(5, [30, 25, 40])
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert llm.scheduler.num_preemptions > 0
    refs = [hf_greedy(hf_models[arch], prompt, NEW_TOKENS) for prompt in prompts]
    assert_greedy_parity([o.token_ids for o in outputs], refs, TIE_GAP, len(prompts) - 1, "preempted")
    assert_no_blocks_in_use(llm)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ],
    ids=["linear", "yarn", "llama3-old-type-key"],
)
@pytest.mark.parametrize("config_format", ["legacy", "current"])
def test_rope_scaling_variants_match_transformers(rope_scaling, config_format, tmp_path, test_tokenizer, device):
    from transformers import AutoModelForCausalLM

    from splitserve.tools.make_model import write_random_checkpoint
    from tests.conftest import ARCH_CONFIGS

    cfg = {**ARCH_CONFIGS["llama"], "rope_scaling": rope_scaling}
    path = write_random_checkpoint(
        tmp_path / "m", cfg, dtype="float32", seed=3, tokenizer=test_tokenizer, config_format=config_format
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = make_llm(path, device)
    prompt = make_prompts(6, [90])[0]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(prompt_logits(llm, prompt).cpu(), ref, atol=2e-4, rtol=2e-4)
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))[0]
    ref = hf_greedy(hf, prompt, NEW_TOKENS)
    assert_greedy_parity([out.token_ids], [ref], TIE_GAP, 1, f"{rope_scaling}")
    assert_no_blocks_in_use(llm)
