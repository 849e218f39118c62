#!/usr/bin/env python3
"""Where a decode step's time goes: the phases of the offline engine's step by wall clock, and a
torch.profiler breakdown of its operators, at several batch sizes.

Loads the engine on a checkpoint (default: the qwen2.5-0.5b preset in --dtype, written with make-model
when missing). For each --batch it starts that many requests with prompts of about --context tokens
(uniform in +-20%), runs every prefill and --warmup decode steps, times --steps pure decode steps
without the profiler, then profiles --steps more.

The unprofiled steps are split into the phases ``LLM.step`` runs, each timed by wall clock around the
engine's own public calls (wrappers set up here; the engine is not changed), exclusive of the phases it
calls:

- schedule: ``Scheduler.schedule``;
- host prep: ``ModelRunner.plan`` (the step's plan: numpy arrays) and what ``ModelRunner.run_plan`` does
  besides the model's forward (the plan's tensors on the device); on the static decode path
  ``StaticDecodeInputs.fill``;
- forward: the model's forward (every layer, to the final hidden states);
- LM head: ``CausalLM.compute_logits``;
- sampling: the sampler;
- rest of execute: what ``ModelRunner.execute`` runs outside those (the rows it samples selected);
- update: ``Scheduler.update``;
- rest of the step: the step's wall time less all of the above (``LLM.step``'s outputs, detokenized).

The profiled steps open ranges around the same pieces (forward hooks and wrappers), and every top-level
torch operator's time goes to the innermost range around it:

- matmuls: every ``Linear`` (fused q/k/v, o, fused gate/up, down, LM head) and a tied LM head;
- attention: the attention modules less their products, rotary and cache accesses (SDPA, masks, views);
- elementwise: RMSNorm, rotary (tables and rotation), SiLU*mul, residual adds, embedding lookup;
- cache writes/gathers: ``write_kv`` and ``gather_context``;
- host prep: ``ModelRunner.plan`` and ``ModelRunner.run_plan`` outside the model (the flattened batch
  and the attention metadata on the device; the plan itself is numpy, so its time shows only in the
  wall-clock phases), or ``StaticDecodeInputs.fill``;
- sampling: the sampler, and the selection of the rows it samples;
- other: the scheduler and whatever else the step dispatches outside those ranges.

Python overhead is the step's wall time (unprofiled) less the time of every top-level operator
(profiled): what the interpreter spends between operators. A prefill figure is measured too: one
request of --prefill-len tokens, ``max_tokens=1``, best of --steps.

    python scripts/profile_step.py [--model DIR] [--preset qwen2.5-0.5b] [--dtype float32]
                                   [--batch 1 8 32] [--context 200] [--steps 3] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd.profiler import record_function

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import splitserve.engine.attention.paged_attention  # noqa: E402
import splitserve.engine.model.transformer  # noqa: E402
from splitserve.engine import LLM, SamplingParams  # noqa: E402
from splitserve.engine.hardware import print_header  # noqa: E402
from splitserve.engine.model.transformer import MLP, Attention, DecoderLayer, Linear, RMSNorm  # noqa: E402

CATEGORIES = ("matmuls", "attention", "elementwise", "cache writes/gathers", "host prep", "sampling", "other")
PHASES = ("schedule", "host prep", "forward", "LM head", "sampling", "rest of execute", "update")
REST = "rest of the step"
RANGE_PREFIX = "ss:"  # our ranges are named "ss:<category>"; everything else the profiler sees is an operator
STEP_RANGE = "ss:step"


def is_range(name: str) -> bool:
    return name.startswith((RANGE_PREFIX, "ProfilerStep"))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def in_range(category: str, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with record_function(RANGE_PREFIX + category):
            return fn(*args, **kwargs)

    return wrapped


def replace_attribute(obj, name: str, wrapper: Callable, undo: list[Callable[[], None]]) -> None:
    """Set ``obj.name`` to ``wrapper(obj.name)`` on the instance; ``undo`` gets what puts it back."""
    original = getattr(obj, name)
    setattr(obj, name, wrapper(original))
    undo.append(lambda: setattr(obj, name, original) if obj.__dict__.get(name) is not original else None)


def host_prep_pieces(llm: LLM) -> list[tuple[object, str]]:
    """The calls that prepare a step's inputs on the host, on whichever path the step takes: the dynamic
    path's ``plan`` and ``run_plan`` (whose forward is timed apart), the static path's ``fill``."""
    pieces = [(llm.runner, "plan"), (llm.runner, "run_plan")]
    if llm.runner.static is not None:
        pieces.append((llm.runner.static, "fill"))
    return pieces


class PhaseTimer:
    """Wall time of each phase of a step, exclusive: a call's time less that of the timed calls inside it."""

    def __init__(self) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)
        self._inner: list[float] = []  # per open call: the time of the timed calls inside it so far

    def timed(self, phase: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            self._inner.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.totals[phase] += elapsed - self._inner.pop()
                if self._inner:
                    self._inner[-1] += elapsed

        return wrapped

    def install(self, llm: LLM) -> Callable[[], None]:
        """Time the phases of ``llm``'s steps; returns the function that takes the timers away."""
        undo: list[Callable[[], None]] = []
        pieces = [
            (llm.scheduler, "schedule", "schedule"),
            (llm.scheduler, "update", "update"),
            (llm.runner, "execute", "rest of execute"),
            *((obj, name, "host prep") for obj, name in host_prep_pieces(llm)),
            (llm.model, "forward", "forward"),
            (llm.model, "compute_logits", "LM head"),
            (llm.runner, "sampler", "sampling"),
        ]
        for obj, name, phase in pieces:
            replace_attribute(obj, name, functools.partial(self.timed, phase), undo)
        return lambda: [fn() for fn in reversed(undo)]


def add_ranges(llm: LLM) -> Callable[[], None]:
    """Open a category range around the engine's pieces (the innermost one wins for an operator); returns
    the function that takes them away again, so that unprofiled steps are timed without them."""
    undo: list[Callable[[], None]] = []

    def patch(obj, name: str, category: str) -> None:
        replace_attribute(obj, name, functools.partial(in_range, category), undo)

    def wrap(module: torch.nn.Module, category: str) -> None:
        def pre(_module, _args):
            _module._ss_ranges = getattr(_module, "_ss_ranges", [])
            _module._ss_ranges.append(record_function(RANGE_PREFIX + category))
            _module._ss_ranges[-1].__enter__()

        def post(_module, _args, _out):
            _module._ss_ranges.pop().__exit__(None, None, None)

        undo.append(module.register_forward_pre_hook(pre).remove)
        undo.append(module.register_forward_hook(post).remove)

    model = llm.model
    kinds = (
        (Linear, "matmuls"),
        (Attention, "attention"),
        (RMSNorm, "elementwise"),
        (MLP, "elementwise"),
        (DecoderLayer, "elementwise"),
        (torch.nn.Embedding, "elementwise"),
    )
    for module in model.modules():
        for kind, category in kinds:
            if isinstance(module, kind):
                wrap(module, category)
    # Ops of CausalLM.forward outside the layers (rotary tables) are elementwise; the tied LM head's F.linear
    # runs in compute_logits itself, so that range is "matmuls" (the final norm inside it is RMSNorm's).
    patch(model, "forward", "elementwise")
    patch(model, "compute_logits", "matmuls")
    for name in ("write_kv", "gather_context"):
        patch(splitserve.engine.attention.paged_attention, name, "cache writes/gathers")
    patch(splitserve.engine.model.transformer, "apply_rotary", "elementwise")
    for obj, name in host_prep_pieces(llm):
        patch(obj, name, "host prep")
    patch(llm.runner, "execute", "sampling")  # what execute runs outside the model and prep: row selection
    patch(llm.runner, "sampler", "sampling")

    def remove() -> None:
        for fn in reversed(undo):
            fn()

    return remove


def start_batch(llm: LLM, batch: int, context: int, new_tokens: int) -> None:
    """``new_tokens`` decode steps for every request after the last prompt is in: the first prompts decode while
    later ones prefill, one token a step, so each request gets as many more tokens as the prefill takes steps."""
    rng = random.Random(0)
    vocab = llm.model_config.vocab_size
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(int(context * 0.8), int(context * 1.2)))] for _ in range(batch)
    ]
    cfg = llm.core.config
    per_step = min(cfg.max_num_batched_tokens, cfg.prefill_chunk_size or cfg.max_num_batched_tokens)
    prefill_steps = -(-sum(len(p) for p in prompts) // per_step) + batch
    sp = SamplingParams(max_tokens=new_tokens + prefill_steps, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        llm.add_request(prompt, sp)
    # Until every request has its prompt in the cache and decodes one token a step.
    while llm.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in llm.scheduler.running):
        llm.step()


def attribute(events) -> tuple[dict[str, float], int, float]:
    """(ms per category, number of top-level operators, ms of the step range) over all profiled steps."""
    totals = {c: 0.0 for c in CATEGORIES}
    count, step_ms = 0, 0.0
    for e in events:
        if e.name == STEP_RANGE:
            step_ms += e.cpu_time_total / 1e3
        if is_range(e.name):
            continue
        parent, category = e.cpu_parent, None
        while parent is not None and is_range(parent.name):
            if category is None and parent.name.startswith(RANGE_PREFIX) and parent.name != STEP_RANGE:
                category = parent.name[len(RANGE_PREFIX) :]
            parent = parent.cpu_parent
        if parent is None:  # a top-level operator: not called from inside another operator
            count += 1
            totals[category or "other"] += e.cpu_time_total / 1e3
    return totals, count, step_ms


def profile_batch(llm: LLM, batch: int, context: int, steps: int, warmup: int) -> dict:
    log(f"batch {batch}: prefill of {batch} prompts of ~{context} tokens ...")
    start_batch(llm, batch, context, 2 * steps + warmup + 3)
    for _ in range(warmup):
        llm.step()
    plain = []
    timer = PhaseTimer()
    remove_timers = timer.install(llm)
    for _ in range(steps):
        start = time.perf_counter()
        llm.step()
        plain.append(time.perf_counter() - start)
    remove_timers()
    phases = {p: 1e3 * s / steps for p, s in timer.totals.items()}
    mean_ms = 1e3 * sum(plain) / steps
    phases[REST] = mean_ms - sum(phases.values())
    lengths = sorted(r.num_tokens for r in llm.scheduler.running)
    log(f"batch {batch}: profiling {steps} decode steps ...")
    remove_ranges = add_ranges(llm)
    # The profiler's first active step costs several times the others: one step of warm-up, not recorded.
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule) as prof:
        for _ in range(steps + 1):
            assert len(llm.scheduler.running) == batch and not llm.scheduler.waiting, "a request finished early"
            with record_function(STEP_RANGE):
                llm.step()
            prof.step()
    remove_ranges()
    for request in list(llm.scheduler.running):  # done with them: their blocks back, not decoded to the end
        llm.abort(request.request_id)
    llm.check_integrity()
    totals, count, step_ms = attribute(prof.events())
    wall_ms = 1e3 * min(plain)
    parts = {c: ms / steps for c, ms in totals.items()}
    ops_ms = sum(parts.values())
    return {
        "batch": batch,
        "context_tokens": {"min": lengths[0], "mean": sum(lengths) / batch, "max": lengths[-1]},
        "step_ms": wall_ms,
        "step_ms_mean": mean_ms,
        "phases_ms": phases,
        "step_ms_profiled": step_ms / steps,
        "parts_ms": parts,
        "python_overhead_ms": wall_ms - ops_ms,
        "ops_per_step": count / steps,
    }


def prefill_tok_s(llm: LLM, length: int, repeats: int) -> float:
    rng = random.Random(1)
    prompt = [rng.randrange(llm.model_config.vocab_size) for _ in range(length)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate([prompt], sp)
        best = min(best, time.perf_counter() - start)
    return length / best


def print_table(r: dict) -> None:
    ctx = r["context_tokens"]
    print(
        f"\nbatch {r['batch']}: contexts {ctx['min']}-{ctx['max']} tokens (mean {ctx['mean']:.0f}); step "
        f"{r['step_ms']:.1f} ms without the profiler (best of the steps), {r['step_ms_profiled']:.1f} ms under it; "
        f"{r['ops_per_step']:.0f} top-level torch operators per step\n"
    )
    mean = r["step_ms_mean"]
    print(f"| phase of a decode step (wall clock; the unprofiled steps' mean, {mean:.1f} ms) | ms | share |")
    print("| --- | --- | --- |")
    for name, ms in r["phases_ms"].items():
        print(f"| {name} | {ms:.2f} | {ms / mean:.0%} |")
    print()
    print("| part of a decode step (operators, profiled) | ms | share of the step |")
    print("| --- | --- | --- |")
    rows = [*r["parts_ms"].items(), ("Python overhead (wall minus operator time)", r["python_overhead_ms"])]
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} | {ms / r['step_ms']:.0%} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="default: models/<preset>-<dtype>")
    ap.add_argument("--preset", default="qwen2.5-0.5b", help="written to --model when it is missing")
    ap.add_argument("--dtype", default=None, help="default bfloat16 where oneDNN runs it natively, else float32")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=200, help="mean prompt length")
    ap.add_argument("--steps", type=int, default=3, help="decode steps profiled (and timed without the profiler)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prefill-len", type=int, default=256, help="prompt of the prefill figure (0: skip it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    args, engine_options = ap.parse_known_args()
    torch.set_num_threads(args.threads)
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"
    machine = print_header(args.dtype, args.threads, "cpu", to_stderr=args.json)
    model_dir = args.model or ROOT / "models" / f"{args.preset}-{args.dtype}"
    if not (model_dir / "config.json").is_file():
        from splitserve.tools.make_model import make_model

        log(f"writing the {args.preset} preset ({args.dtype}) to {model_dir} ...")
        make_model(args.preset, model_dir, dtype=args.dtype, overwrite=True)
    options = dict(opt.lstrip("-").replace("-", "_").split("=", 1) for opt in engine_options)  # e.g. --compile=1
    options = {k: (v == "1") if v in ("0", "1") else v for k, v in options.items()}
    start = time.perf_counter()
    llm = LLM(
        model_dir,
        dtype=args.dtype,
        num_threads=args.threads,
        enable_prefix_caching=False,
        max_num_seqs=max(args.batch),
        max_num_batched_tokens=8192,
        kv_cache_bytes=1 << 30,
        **options,
    )
    load_s = time.perf_counter() - start
    prefill = prefill_tok_s(llm, args.prefill_len, args.steps) if args.prefill_len else None
    batches = [profile_batch(llm, b, args.context, args.steps, args.warmup) for b in args.batch]
    result = {
        "machine": machine,
        "model": str(model_dir),
        "dtype": args.dtype,
        "threads": args.threads,
        "engine_options": options,
        "load_s": load_s,
        "prefill_len": args.prefill_len,
        "prefill_tok_s": prefill,
        "batches": batches,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"\n{args.dtype}, {args.threads} threads, options {options or 'default'}; load {load_s:.1f} s; "
        + (f"prefill of {args.prefill_len} tokens: {prefill:.0f} tok/s" if prefill else "prefill not measured")
    )
    for r in batches:
        print_table(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
