"""Parity with Hugging Face transformers on the same checkpoint, in fp32.

For Llama, Qwen2 and Mistral: prefill logits allclose, and greedy generation identical token for
token (a divergence is accepted only where transformers' own top-1 minus top-2 logit gap is below
1e-3, a genuine tie) for a batch of prompts of different lengths, with prefix-cache hits and with
chunked prefill in chunk sizes that are not multiples of the block size. Every run ends with no
block in use and the allocator's invariants holding.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "mistral"]
NEW_TOKENS = 40
TIE_GAP = 1e-3
PROMPT_LENGTHS = [3, 17, 30, 47, 64]


def make_prompts(seed: int, lengths=PROMPT_LENGTHS, vocab: int = 2000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def hf_models(arch_model_dirs):
    from transformers import AutoModelForCausalLM

    models = {}
    for arch in ARCHS:
        m = AutoModelForCausalLM.from_pretrained(arch_model_dirs[arch], dtype=torch.float32).eval()
        models[arch] = m
    return models


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' own greedy loop with its KV cache; returns tokens and the top-1 minus top-2 gaps."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, gaps = [], []
    for _ in range(n):
        logits = out.logits[0, -1].float()
        top = logits.topk(2).values
        gaps.append(float(top[0] - top[1]))
        token = int(logits.argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, gaps


def assert_matches(ours: list[int], ref: list[int], gaps: list[float], what: str) -> int:
    """Identical up to a tie; returns how many tokens matched."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert gaps[i] < TIE_GAP, f"{what}: token {i} differs ({a} vs {b}) with logit gap {gaps[i]:.4g}"
            return i
    assert len(ours) == len(ref), f"{what}: {len(ours)} tokens vs {len(ref)}"
    return len(ours)


def assert_not_degenerate(outputs: list[list[int]]) -> None:
    for out in outputs:
        assert len(set(out)) >= 8, f"degenerate output {out}"
    assert len({tuple(o) for o in outputs}) == len(outputs), "different prompts gave the same output"


def assert_no_blocks_in_use(llm: LLM) -> None:
    llm.check_integrity()
    assert llm.kv_status()["in_use"] == 0


def make_llm(model_dir, device: str, **kw) -> LLM:
    kw.setdefault("num_blocks", 256)
    return LLM(model_dir, dtype="float32", device=device, block_size=16, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_allclose(arch, arch_model_dirs, hf_models, device):
    llm = make_llm(arch_model_dirs[arch], device)
    for prompt in make_prompts(1, lengths=[1, 9, 40, 70]):
        ours = llm.prompt_logits(prompt).cpu()
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
    llm = make_llm(arch_model_dirs[arch], device, **mode)
    prompts = make_prompts(2)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    matched = []
    for prompt, out in zip(prompts, outputs):
        ref, gaps = hf_greedy(hf_models[arch], prompt, NEW_TOKENS)
        matched.append(assert_matches(out.token_ids, ref, gaps, f"{arch} prompt of {len(prompt)}"))
        assert out.finish_reason == "length"
    assert sum(m == NEW_TOKENS for m in matched) >= len(prompts) - 1, f"too many ties: {matched}"
    assert min(matched) >= 32 or sorted(matched)[1] >= 32
    assert_not_degenerate([o.token_ids for o in outputs])
    assert_no_blocks_in_use(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_prefix_cache_hits(arch, arch_model_dirs, hf_models, device):
    llm = make_llm(arch_model_dirs[arch], device, prefill_chunk_size=13)
    shared = make_prompts(3, lengths=[40])[0]
    suffixes = make_prompts(4, lengths=[5, 20, 1])
    first = llm.generate([shared + [7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert first[0].num_cached_tokens == 0
    prompts = [shared + s for s in suffixes]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.num_cached_tokens == 32  # two full 16-token blocks of the shared 40-token prefix
        ref, gaps = hf_greedy(hf_models[arch], prompt, NEW_TOKENS)
        assert assert_matches(out.token_ids, ref, gaps, f"{arch} cached prompt of {len(prompt)}") >= 32
    assert_no_blocks_in_use(llm)
    assert llm.kv_status()["cached"] > 0


def test_decode_across_many_blocks_and_preemption(arch_model_dirs, hf_models, device):
    """A cache too small for the batch forces preemption and recompute; output is unchanged."""
    arch = "llama"
    llm = make_llm(arch_model_dirs[arch], device, num_blocks=12)
    prompts = make_prompts(5, lengths=[30, 25, 40])
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert llm.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        ref, gaps = hf_greedy(hf_models[arch], prompt, NEW_TOKENS)
        assert assert_matches(out.token_ids, ref, gaps, f"prompt of {len(prompt)}") >= 32
    assert_no_blocks_in_use(llm)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 32},
    ],
    ids=["linear", "yarn", "llama3-old-type-key"],
)
@pytest.mark.parametrize("config_format", ["legacy", "current"])
def test_rope_scaling_variants_match_transformers(rope_scaling, config_format, tmp_path, test_tokenizer, device):
    from transformers import AutoModelForCausalLM

    from splitserve.make_model import write_random_checkpoint
    from tests.conftest import ARCH_CONFIGS

    cfg = {**ARCH_CONFIGS["llama"], "rope_scaling": rope_scaling}
    path = write_random_checkpoint(tmp_path / "m", cfg, dtype="float32", seed=3, tokenizer=test_tokenizer,
                                   config_format=config_format)  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = make_llm(path, device)
    prompt = make_prompts(6, lengths=[90])[0]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(llm.prompt_logits(prompt).cpu(), ref, atol=2e-4, rtol=2e-4)
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))[0]
    tokens, gaps = hf_greedy(hf, prompt, NEW_TOKENS)
    assert assert_matches(out.token_ids, tokens, gaps, f"{rope_scaling}") >= 32
    assert_no_blocks_in_use(llm)
