#!/usr/bin/env python3
"""Where one decode step's time goes: a torch.profiler breakdown of the offline engine, with an op count.

Loads the engine on a checkpoint (default: the qwen2.5-0.5b preset, written with make-model when
missing), starts --batch requests with prompts of about --context tokens (uniform in +-20%), runs
every prefill and --warmup decode steps, then profiles --steps pure decode steps. Time is split with
``record_function`` ranges the script opens around the model's own modules (forward hooks; the
engine is not changed):

- matrix products: every ``Linear`` of the layers (fused q/k/v, o, fused gate/up, down) and the LM
  head (with the final norm: ``compute_logits``);
- attention: the attention modules less their q/k/v and o products (rotary, KV write, block gather,
  masks, the two batched matmuls, softmax);
- the rest: embeddings, norms, activations, residuals, sampling, scheduling and Python.

It also counts the torch operators a step dispatches (top-level ones: not those an operator calls
inside itself) and times the same steps without the profiler, whose per-op cost inflates small work.

    python scripts/profile_step.py [--model DIR] [--preset qwen2.5-0.5b] [--dtype float32]
                                   [--batch 32] [--context 200] [--steps 3] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from torch.autograd.profiler import record_function

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import LLM, SamplingParams  # noqa: E402
from engine.hardware import print_header  # noqa: E402
from engine.model import Attention, Linear  # noqa: E402

RANGES = {"matrix products: layers": "mm_layers", "matrix products: LM head": "mm_head", "attention module": "attn",
          "attention projections": "attn_proj", "decode step": "step"}  # fmt: skip


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def add_ranges(model: torch.nn.Module) -> None:
    """Open a profiler range around every layer Linear, every Attention and compute_logits."""

    def wrap(module: torch.nn.Module, name: str) -> None:
        def pre(_module, _args):
            _module._ss_range = record_function(name)
            _module._ss_range.__enter__()

        def post(_module, _args, _out):
            _module._ss_range.__exit__(None, None, None)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    for module in model.modules():
        if isinstance(module, Attention):
            wrap(module, "attention module")
            wrap(module.qkv_proj, "attention projections")
            wrap(module.o_proj, "attention projections")
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.endswith(("gate_up_proj", "down_proj")):
            wrap(module, "matrix products: layers")
    compute_logits = model.compute_logits

    def logits_in_range(hidden: torch.Tensor) -> torch.Tensor:
        with record_function("matrix products: LM head"):
            return compute_logits(hidden)

    model.compute_logits = logits_in_range


def start_batch(llm: LLM, batch: int, context: int, new_tokens: int) -> None:
    rng = random.Random(0)
    vocab = llm.model_config.vocab_size
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        n = rng.randint(int(context * 0.8), int(context * 1.2))
        llm.add_request([rng.randrange(vocab) for _ in range(n)], sp)
    # Until every request has its prompt in the cache and decodes one token a step.
    while llm.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in llm.scheduler.running):
        llm.step()


def top_level_ops(events) -> int:
    """Operators not called from inside another operator (ranges of ours do not count as operators)."""
    count = 0
    for e in events:
        if e.name in RANGES:
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name in RANGES:
            parent = parent.cpu_parent
        count += parent is None
    return count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="default: models/<preset>")
    ap.add_argument("--preset", default="qwen2.5-0.5b", help="written to --model when it is missing")
    ap.add_argument("--dtype", default=None, help="default bfloat16 where oneDNN runs it natively, else float32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=200, help="mean prompt length")
    ap.add_argument("--steps", type=int, default=3, help="decode steps profiled (and timed without the profiler)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"
    machine = print_header(args.dtype, args.threads, "cpu", to_stderr=args.json)
    model_dir = args.model or ROOT / "models" / f"{args.preset}-{args.dtype}"
    if not (model_dir / "config.json").is_file():
        from splitserve.make_model import make_model

        log(f"writing the {args.preset} preset ({args.dtype}) to {model_dir} ...")
        make_model(args.preset, model_dir, dtype=args.dtype, overwrite=True)
    llm = LLM(model_dir, dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=False,
              max_num_seqs=args.batch, max_num_batched_tokens=4096, kv_cache_bytes=1 << 30)  # fmt: skip
    log(f"prefill of {args.batch} prompts of ~{args.context} tokens ...")
    start_batch(llm, args.batch, args.context, 2 * args.steps + args.warmup + 2)
    for _ in range(args.warmup):
        llm.step()
    plain = []
    for _ in range(args.steps):
        start = time.perf_counter()
        llm.step()
        plain.append(time.perf_counter() - start)
    lengths = sorted(r.num_tokens for r in llm.scheduler.running)
    add_ranges(llm.model)
    log(f"profiling {args.steps} decode steps at batch {args.batch} ...")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            assert len(llm.scheduler.running) == args.batch and not llm.scheduler.waiting
            with record_function("decode step"):
                llm.step()
    events = prof.events()
    totals = {key: 0.0 for key in RANGES.values()}
    for e in events:
        if e.name in RANGES:
            totals[RANGES[e.name]] += e.cpu_time_total / 1e3  # ms
    steps = args.steps
    per_step = {k: v / steps for k, v in totals.items()}
    parts = {
        "matrix products: layers (q/k/v, o, gate/up, down)": per_step["mm_layers"] + per_step["attn_proj"],
        "matrix products: LM head (with final norm)": per_step["mm_head"],
        "attention over the paged cache": per_step["attn"] - per_step["attn_proj"],
    }
    parts["the rest (element-wise, sampling, scheduling, Python)"] = per_step["step"] - sum(parts.values())
    context = sum(lengths) / len(lengths)
    result = {
        "machine": machine, "model": str(model_dir), "dtype": args.dtype, "threads": args.threads,
        "batch": args.batch, "steps": steps, "context_tokens": {"min": lengths[0], "mean": context, "max": lengths[-1]},
        "preemptions": llm.scheduler.num_preemptions,
        "step_ms_profiled": per_step["step"], "step_ms_unprofiled": 1e3 * min(plain),
        "parts_ms": parts, "parts_fraction": {k: v / per_step["step"] for k, v in parts.items()},
        "top_level_ops_per_step": top_level_ops(events) / steps,
        "all_ops_per_step": sum(e.name not in RANGES for e in events) / steps,
    }  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"\n{args.batch} requests decoding, contexts {lengths[0]}-{lengths[-1]} tokens (mean {context:.0f}, "
          f"{result['preemptions']} preemptions); {steps} steps profiled; "
          f"step {result['step_ms_profiled']:.1f} ms under the profiler, {result['step_ms_unprofiled']:.1f} ms "
          f"without (best of {steps})\n")  # fmt: skip
    print("| part of a decode step | ms | fraction |")
    print("| --- | --- | --- |")
    for name, ms in parts.items():
        print(f"| {name} | {ms:.1f} | {result['parts_fraction'][name]:.0%} |")
    print(f"\ntorch operators per step: {result['top_level_ops_per_step']:.0f} top-level "
          f"({result['all_ops_per_step']:.0f} counting the ones they call)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
