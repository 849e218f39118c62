"""Helpers shared by the parity tests: prompts, transformers' greedy loop, the tie rule, and our logits."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.model.transformer import CausalLM, Linear


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with n intra-op threads (TESTING.md: one per process in tests). On the 2 shared cores, two
    OpenMP threads made these one-sequence decodes 5-10x slower in CPU time, mostly spinning."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def linear_paths(model: CausalLM) -> dict[str, str]:
    """Module name -> the kernel that linear layer runs (``Linear.path``): "plain" (``F.linear``; cuBLAS on
    CUDA), "packed" (oneDNN, prepacked weight) or "split" (both, by rows). "lm_head" is listed even when it
    is the tied embedding (plain)."""
    paths = {name: m.path for name, m in model.named_modules() if isinstance(m, Linear)}
    paths.setdefault("lm_head", "plain")
    return paths


def greedy_runs(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Greedy token ids of each prompt, ``max_tokens[i]`` of them (EOS ignored), all submitted at once."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    return [o.token_ids for o in llm.generate(prompts, params)]


def make_prompts(seed: int, lengths: list[int], vocab: int = 2000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int, in_bf16_steps: bool = False) -> tuple[list[int], list[float]]:
    """transformers' own greedy loop with its KV cache; returns tokens and the top-1 minus top-2 gaps.

    ``in_bf16_steps``: each gap in units of the bf16 spacing at the top logit's magnitude (2^(e-7) for a
    top logit in [2^e, 2^(e+1))), so that "adjacent bf16 values" means the same whatever the logits' scale."""
    device = model.device
    out = model(torch.tensor([prompt], device=device), use_cache=True)
    tokens, gaps = [], []
    for _ in range(n):
        logits = out.logits[0, -1].float()
        top = logits.topk(2).values
        gap = float(top[0] - top[1])
        gaps.append(gap / bf16_step(float(top[0])) if in_bf16_steps else gap)
        token = int(logits.argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]], device=device), past_key_values=out.past_key_values, use_cache=True)
    return tokens, gaps


def bf16_step(value: float) -> float:
    """The distance between adjacent bfloat16 values at ``value``'s magnitude (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(value), 2.0**-126))) - 7)


def first_tie(gaps: list[float], tie_gap: float) -> int:
    """The first step whose gap is below tie_gap (len(gaps) when there is none)."""
    return next((i for i, gap in enumerate(gaps) if gap < tie_gap), len(gaps))


def assert_matches(ours: list[int], ref: list[int], gaps: list[float], tie_gap: float, what: str) -> int:
    """Identical token for token until the first difference, which must fall on a step where
    transformers' top-1 minus top-2 gap is below tie_gap; nothing after it is compared (the contexts
    differ from there on). Returns how many tokens matched."""
    assert len(ours) == len(ref), f"{what}: {len(ours)} tokens vs {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert gaps[i] < tie_gap, f"{what}: token {i} differs ({a} vs {b}) with logit gap {gaps[i]:.4g}"
            return i
    return len(ours)


def assert_greedy_parity(
    outputs: list[list[int]], refs: list[tuple[list[int], list[float]]], tie_gap: float, min_tie_free: int, what: str
) -> list[int]:
    """``assert_matches`` for every prompt, so a run whose reference has no gap below tie_gap must match
    in full; and at least ``min_tie_free`` of the reference runs have none. Ties belong to the
    checkpoint, not the engine: that floor keeps the comparison from passing because every run stopped
    at an early tie. Returns the matched lengths."""
    tie_free = sum(first_tie(gaps, tie_gap) == len(gaps) for _, gaps in refs)
    assert tie_free >= min_tie_free, f"{what}: only {tie_free} reference runs without a tie, {min_tie_free} needed"
    matched = []
    for i, (out, (ref, gaps)) in enumerate(zip(outputs, refs)):
        matched.append(assert_matches(out, ref, gaps, tie_gap, f"{what} prompt {i}"))
    return matched


def assert_not_degenerate(outputs: list[list[int]]) -> None:
    for out in outputs:
        assert len(set(out)) >= 8, f"degenerate output {out}"
    assert len({tuple(o) for o in outputs}) == len(outputs), "different prompts gave the same output"


def assert_no_blocks_in_use(llm: LLM) -> None:
    llm.check_integrity()
    assert llm.kv_status()["in_use"] == 0


def prompt_logits(llm: LLM, token_ids: Sequence[int]) -> torch.Tensor:
    """float32 logits [len(token_ids), vocab] at every position of a prompt (no prefix reuse): the engine's
    side of a logits comparison. Its blocks are freed before it returns."""
    token_ids = [int(t) for t in token_ids]
    rid = f"score-{next(llm._ids)}"  # from the LLM's own counter: never an id a request of it holds
    if not llm.blocks.allocate(rid, len(token_ids)):
        raise RuntimeError(f"not enough free KV blocks to score {len(token_ids)} tokens")
    try:
        return llm.runner.score(token_ids, llm.blocks.block_table(rid))
    finally:
        llm.blocks.free(rid)
