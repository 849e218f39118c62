#!/usr/bin/env python3
"""The peer's offline engine (vLLM's `LLM`), measured as scripts/bench_engine.py measures splitserve.

Runs inside the peer's venv (`make peer` builds .peer): it imports only the standard library, torch and
vllm, never splitserve. scripts/bench_engine.py starts it as a subprocess on the same checkpoint, dtype
and cores, with vLLM's CPU settings in the environment (VLLM_TARGET_DEVICE=cpu, VLLM_CPU_OMP_THREADS_BIND,
VLLM_CPU_NUM_OF_RESERVED_CPU=0, OMP_NUM_THREADS, VLLM_CPU_KVCACHE_SPACE).

The prompts are the same token ids as bench_engine.py's (the same seeds and the same generator):

- prefill tok/s at batch 1 and 8: prompts of --prompt-len tokens, max_tokens=1, best of --repeats;
- decode tok/s at each --decode-batches: prompt lengths drawn from [prompt_len / 2, 3 * prompt_len / 2]
  as bench_engine.py draws them, greedy, ignore_eos. The requests go through vLLM's own `LLMEngine.step()`
  loop with delta outputs, and only the pure-decode steps are timed: from the step that delivers the last
  request's first token to the step that delivers the last token, divided by the tokens delivered in
  between (as bench_engine.py times our engine's pure-decode steps). Best of two.
  `T(new_tokens) - T(1)` over the same prompts is reported beside it (`ms_per_step_t_diff`) and not
  used: it subtracts two runs that each hold one long prefill (about 36 s at batch 16 x 512 on 2 cores)
  to get a few seconds of decode, so a few percent of prefill noise moves it by half (measured: 71 ms a
  step by the difference against 131 ms timed step by step, in one run).

vLLM's own log goes wherever it goes; this script's result is the last stdout line, one JSON object.

Usage (inside the peer venv): python scripts/peer_vllm.py --model DIR [--dtype float32] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    """Exactly scripts/bench_engine.py's make_prompts."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def decode_lengths(batch: int, prompt_len: int) -> list[int]:
    """Exactly the mixed lengths of scripts/bench_engine.py's splitserve_decode."""
    rng = random.Random(1000 + batch)
    return [rng.randint(prompt_len // 2, 3 * prompt_len // 2) for _ in range(batch)]


def timed_generate(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    outs = llm.generate(inputs, sp, use_tqdm=False)
    elapsed = time.perf_counter() - start
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != [max_tokens] * len(prompts):
        raise RuntimeError(f"vLLM returned {got} tokens per prompt, expected {max_tokens} each")
    return elapsed


def stepped_decode(llm, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds per pure-decode step: the prompts run through ``LLMEngine.step()`` with delta outputs; the clock
    starts when every request has its first token and stops at the last token, and the tokens delivered in
    between, divided by the batch, count the steps."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    tag = f"{time.monotonic_ns()}"
    for i, p in enumerate(prompts):
        engine.add_request(f"decode-{tag}-{i}", {"prompt_token_ids": p}, sp)
    tokens: dict[str, int] = {}
    start = None
    after_start = 0
    end = 0.0
    deadline = time.monotonic() + 1800.0
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM's decode did not finish in 1800 s")
        outs = engine.step()
        now = time.perf_counter()
        new = 0
        for o in outs:
            n = len(o.outputs[0].token_ids)
            tokens[o.request_id] = tokens.get(o.request_id, 0) + n
            new += n
        if start is not None:
            after_start += new
            end = now
        elif len(tokens) == len(prompts) and min(tokens.values()) > 0:
            start = now
    got = sorted(tokens.values())
    if got != [max_tokens] * len(prompts):
        raise RuntimeError(f"vLLM returned {got} tokens per prompt, expected {max_tokens} each")
    if start is None or after_start == 0:
        raise RuntimeError("vLLM ran no pure-decode step (raise --new-tokens)")
    return (end - start) / (after_start / len(prompts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--decode-batches", default="1,8,32")
    ap.add_argument("--prefill-batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile (quicker start, slower steps)")
    args = ap.parse_args()

    import torch
    import vllm
    from vllm import LLM

    decode_batches = [int(b) for b in args.decode_batches.split(",")]
    prefill_batches = [int(b) for b in args.prefill_batches.split(",")]
    max_batch = max(decode_batches + prefill_batches)
    # Room for every prompt of the largest batch in one step, so the first step prefills all of them.
    batched_tokens = max(2048, max_batch * (3 * args.prompt_len // 2 + 1), max(prefill_batches) * args.prompt_len)
    log(f"vLLM {vllm.__version__}, torch {torch.__version__}: loading {args.model} ({args.dtype}) ...")
    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=False,
        max_num_seqs=max_batch,
        max_num_batched_tokens=batched_tokens,
    )
    load_s = time.perf_counter() - start
    log(f"vLLM ready in {load_s:.1f}s (the first start compiles; later ones read ~/.cache/vllm)")
    vocab = llm.llm_engine.model_config.get_vocab_size()

    # Warm-up at the shapes measured below.
    timed_generate(llm, make_prompts(vocab, [args.prompt_len] * 2, seed=2), 4)
    for b in prefill_batches:
        timed_generate(llm, make_prompts(vocab, [args.prompt_len] * b, seed=b), 1)

    prefill: dict[int, float] = {}
    log("vLLM prefill ...")
    for b in prefill_batches:
        prompts = make_prompts(vocab, [args.prompt_len] * b, seed=b)
        t = min(timed_generate(llm, prompts, 1) for _ in range(args.repeats))
        prefill[b] = b * args.prompt_len / t
    decode: dict[int, dict] = {}
    log("vLLM decode ...")
    for b in decode_batches:
        prompts = make_prompts(vocab, decode_lengths(b, args.prompt_len), seed=b)
        t_one = timed_generate(llm, prompts, 1)
        t_full = timed_generate(llm, prompts, args.new_tokens)
        step = min(stepped_decode(llm, prompts, args.new_tokens) for _ in range(2))
        decode[b] = {
            "tok_s": b / step,
            "ms_per_step": 1e3 * step,
            "ms_per_step_t_diff": 1e3 * (t_full - t_one) / (args.new_tokens - 1),
        }
        log(
            f"  vLLM batch {b}: {decode[b]['tok_s']:.1f} tok/s ({decode[b]['ms_per_step']:.1f} ms/step timed by step; "
            f"{decode[b]['ms_per_step_t_diff']:.1f} ms/step by T(N) - T(1), not used)"
        )

    result = {
        "engine": "vllm",
        "vllm_version": vllm.__version__,
        "torch_version": str(torch.__version__),
        "python": platform.python_version(),
        "model": args.model,
        "dtype": args.dtype,
        "enforce_eager": args.enforce_eager,
        "load_s": load_s,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "kvcache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        "prefill_tok_s": prefill,
        "decode": decode,
    }
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
