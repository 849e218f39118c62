#!/usr/bin/env python3
"""Where a GPU's time goes: decode and prefill against the device's own bounds and transformers, one run.

For each model (on cuda: the qwen2.5-0.5b and llama3.1-8b presets, random weights, bf16, written to a
temp folder), measured in this run:

- decode ms/step at batch 1, 8, 32 and 128 (prompts of 64..192 tokens, continuous batching, only steps in
  which every request decodes), beside the bytes bound: (weights + the batch's KV) / the copy bandwidth;
- prefill tok/s of one prompt of 512 and of 2048 tokens, beside the GEMM bound: the prompt's matmul FLOPs
  (projections, attention, one row of the LM head) at the bf16 GEMM peak;
- transformers on the same checkpoint: `generate` on static batches, per step (T(n) - T(1)) / (n - 1),
  and `generate(max_new_tokens=1)` for prefill;
- the machine's copy bandwidth (a 1 GiB device copy) and bf16 GEMM peak (8192^3 matmuls).

Then ONE summary table, the issue's GPU targets, and which decode path (dynamic, static eager, static with
CUDA graphs) and attention backend the timed decode steps ran, as the engine counted them
(``ModelRunner.steps``), not as configured. Every step has a deadline and the whole run a budget
(--budget, default 450 s), so a slow step costs its row ("timed out"), not the table. `--device cpu`
rehearses the same code on the tiny preset with tiny sizes in seconds (scripts/gpu_check.sh --device
cpu, which `make test` runs).

Usage: python scripts/gpu_bench.py --device cuda [--json-out FILE] [--models qwen2.5-0.5b,llama3.1-8b]
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_engine import (  # noqa: E402
    HFGenerate,
    best_time,
    copy_bandwidth,
    splitserve_decode,
    splitserve_prefill_time,
    weight_shapes,
)

from splitserve.engine import LLM, ModelConfig  # noqa: E402
from splitserve.engine.core import DYNAMIC_DECODE_BACKEND  # noqa: E402
from splitserve.engine.hardware import print_header  # noqa: E402


@dataclass(frozen=True)
class Plan:
    models: tuple[str, ...]
    decode_batches: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    gemm_size: int
    copy_bytes: int
    kv_cache_bytes: int
    step_s: float  # deadline of one measurement
    write_s: float  # deadline of writing and of loading one checkpoint


PLANS = {
    "cuda": Plan(
        ("qwen2.5-0.5b", "llama3.1-8b"),
        (1, 8, 32, 128),
        (512, 2048),
        prompt_len=128,
        new_tokens=32,
        gemm_size=8192,
        copy_bytes=1 << 30,
        kv_cache_bytes=16 << 30,
        step_s=60,
        write_s=180,
    ),
    "cpu": Plan(
        ("tiny",),
        (1, 4),
        (16, 64),
        prompt_len=8,
        new_tokens=4,
        gemm_size=256,
        copy_bytes=32 << 20,
        kv_cache_bytes=32 << 20,
        step_s=60,
        write_s=60,
    ),
}


class StepTimeout(Exception):
    pass


@dataclass
class Budget:
    """A deadline per step, never past the run's own."""

    total_s: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.start)

    @contextmanager
    def step(self, seconds: float):
        limit = min(seconds, self.left())
        if limit <= 1:
            raise StepTimeout("run budget spent")

        def expire(*_):
            raise StepTimeout(f"over {limit:.0f} s")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def attempt(budget: Budget, seconds: float, what: str, fn):
    """fn() within its deadline; a StepTimeout or error becomes a string for the table."""
    start = time.monotonic()
    try:
        with budget.step(seconds):
            value = fn()
        log(f"  {what}: {time.monotonic() - start:.1f} s")
        return value
    except StepTimeout as e:
        log(f"  {what}: timed out ({e})")
        return "timed out"
    except Exception as e:  # noqa: BLE001 - one failed row must not cost the table
        log(f"  {what}: failed: {type(e).__name__}: {e}")
        return f"failed: {type(e).__name__}"


# ---- machine --------------------------------------------------------------------------------------


def gemm_peak(device: str, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of the best of 5 square n^3 matmuls."""
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    a @ b
    return 2 * n**3 / best_time(lambda: a @ b, 5, device)


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """Matmul FLOPs of a prefill: every projection per token, causal attention, the LM head for the last token."""
    *layers, head = weight_shapes(cfg)
    projections = sum(o * i for o, i in layers)
    attention = cfg.num_layers * 2 * tokens * tokens * cfg.q_size  # QK^T and PV over the causal half
    return 2 * tokens * projections + attention + 2 * head[0] * head[1]


def triton_status(device: str) -> str:
    from splitserve.engine.attention import triton_paged_decode

    if triton_paged_decode.triton is None:
        return "not installed (the Triton paged decode kernel is unavailable)"
    state = "available" if triton_paged_decode.is_available(device) else "needs CUDA"
    return f"{triton_paged_decode.triton.__version__} (paged decode kernel {state})"


# What ``ModelRunner.steps`` counts, as the report names it.
PATH_NAMES = {"graph": "static, CUDA graphs replayed", "static": "static, eager", "dynamic": "dynamic"}


def decode_ran(paths: Counter, static_backend: str, dynamic_backend: str = DYNAMIC_DECODE_BACKEND) -> tuple[str, str]:
    """The decode path and attention backend that the timed decode steps ran (``paths``: the engine's own
    count of them by path, summed over the rows), not the configured ones: a static engine whose capture
    failed replays no graph, and a step its buckets do not hold runs the dynamic path."""
    total = sum(paths.values())
    if not total:
        return "no decode step timed", "-"
    path = "; ".join(f"{PATH_NAMES[p]} in {n} of {total} timed steps" for p, n in paths.most_common())
    backends = dict.fromkeys(dynamic_backend if p == "dynamic" else static_backend for p, _ in paths.most_common())
    return path, " and ".join(backends)


# ---- one model ------------------------------------------------------------------------------------


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def bench_model(preset: str, plan: Plan, args, budget: Budget, work: Path, bw: float) -> dict:
    from splitserve.tools.make_model import make_model

    log(f"== {preset}")
    model_dir = attempt(
        budget,
        plan.write_s,
        "write checkpoint",
        lambda: make_model(preset, work / preset, dtype=args.dtype, overwrite=True),
    )
    if not isinstance(model_dir, Path):
        return {"error": f"checkpoint: {model_dir}"}
    cfg = ModelConfig.from_model_dir(model_dir)
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    out = {
        "weight_bytes": sum(o * i for o, i in weight_shapes(cfg)) * elem,
        "kv_bytes_per_token": 2 * cfg.num_layers * cfg.kv_size * elem,
        "prefill_flops": {n: prefill_flops(cfg, n) for n in plan.prefill_tokens},
    }
    out.update(bench_splitserve(model_dir, plan, args, budget))
    for b in plan.decode_batches:
        if isinstance(d := out["splitserve"].get(f"decode_{b}"), dict):
            kv_bytes = d["mean_context"] * b * out["kv_bytes_per_token"]
            d["bytes_bound_ms"] = 1e3 * (out["weight_bytes"] + kv_bytes) / bw
    free(args.device)
    if not args.skip_hf:
        out["transformers"] = bench_transformers(model_dir, plan, args, budget)
        free(args.device)
    return out


def bench_splitserve(model_dir: Path, plan: Plan, args, budget: Budget) -> dict:
    dev = args.device
    llm = attempt(
        budget,
        plan.write_s,
        "load splitserve",
        lambda: LLM(
            model_dir,
            dtype=args.dtype,
            device=dev,
            num_threads=args.threads,
            enable_prefix_caching=False,
            max_num_seqs=max(plan.decode_batches),
            max_num_batched_tokens=max(plan.prefill_tokens),
            kv_cache_bytes=plan.kv_cache_bytes,
        ),
    )
    if not isinstance(llm, LLM):
        return {"error": f"splitserve load: {llm}", "splitserve": {}}
    static_backend = llm.core.decode_backend  # the paged_decode backend its static steps run
    ours: dict = {}
    # After a timeout or error mid-step the engine holds half-run requests: its later rows are skipped.
    broken = attempt(
        budget,
        plan.step_s,
        "warm-up",
        lambda: (splitserve_decode(llm, 2, plan.prompt_len, 2, dev), splitserve_prefill_time(llm, 1, 16, dev)),
    )
    broken = broken if isinstance(broken, str) else None
    for b in plan.decode_batches:
        d = (
            f"skipped ({broken})"
            if broken
            else attempt(
                budget,
                plan.step_s,
                f"splitserve decode batch {b}",
                lambda b=b: splitserve_decode(llm, b, plan.prompt_len, plan.new_tokens, dev),
            )
        )
        broken = broken or (d if isinstance(d, str) else None)
        ours[f"decode_{b}"] = d
    for n in plan.prefill_tokens:
        t = (
            f"skipped ({broken})"
            if broken
            else attempt(
                budget,
                plan.step_s,
                f"splitserve prefill {n}",
                lambda n=n: min(splitserve_prefill_time(llm, 1, n, dev) for _ in range(2)),
            )
        )
        broken = broken or (t if isinstance(t, str) else None)
        ours[f"prefill_{n}"] = n / t if isinstance(t, float) else t
    ran = sum((Counter(d["paths"]) for d in ours.values() if isinstance(d, dict)), Counter())
    path, backend = decode_ran(ran, static_backend, llm.core.dynamic_decode_backend)
    llm = None  # frees the engine before the next backend loads
    return {"splitserve": ours, "decode_backend": backend, "decode_path": path}


def bench_transformers(model_dir: Path, plan: Plan, args, budget: Budget) -> dict:
    dev, dtype = args.device, getattr(torch, args.dtype)

    def load():
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(dev).eval()

    model = attempt(budget, plan.write_s, "load transformers", load)
    if isinstance(model, str):
        return {"error": model}
    theirs: dict = {}
    decode = HFGenerate(model, plan.prompt_len, dev)
    attempt(budget, plan.step_s, "transformers warm-up", lambda: decode.time(2, 2))
    for b in plan.decode_batches:
        t = attempt(
            budget,
            plan.step_s,
            f"transformers decode batch {b}",
            lambda b=b: (decode.time(b, plan.new_tokens) - decode.time(b, 1)) / (plan.new_tokens - 1),
        )
        theirs[f"decode_{b}"] = {"ms_per_step": 1e3 * t} if isinstance(t, float) else t
    for n in plan.prefill_tokens:
        prefill = HFGenerate(model, n, dev)
        t = attempt(
            budget,
            plan.step_s,
            f"transformers prefill {n}",
            lambda prefill=prefill: min(prefill.time(1, 1) for _ in range(2)),
        )
        theirs[f"prefill_{n}"] = n / t if isinstance(t, float) else t
    model = decode = None  # frees the weights before the next run
    return theirs


# ---- report ---------------------------------------------------------------------------------------


def rows(result: dict, plan: Plan) -> list[list[str]]:
    def num(x, fmt):
        return format(x, fmt) if isinstance(x, float) else (x if isinstance(x, str) else "-")

    table = []
    peak = result["gemm_peak_flops"]
    for preset, r in result["models"].items():
        ours, theirs = r.get("splitserve", {}), r.get("transformers", {})
        for b in plan.decode_batches:
            d, h = ours.get(f"decode_{b}"), theirs.get(f"decode_{b}")
            ms = d["ms_per_step"] if isinstance(d, dict) else d
            hms = h["ms_per_step"] if isinstance(h, dict) else h
            bound = d["bytes_bound_ms"] if isinstance(d, dict) else None
            ratio = hms / ms if isinstance(ms, float) and isinstance(hms, float) else None
            frac = bound / ms if isinstance(ms, float) and isinstance(bound, float) else None
            table.append(
                [
                    preset,
                    "decode ms/step",
                    f"batch {b}",
                    num(ms, ".2f"),
                    num(hms, ".2f"),
                    num(ratio, ".2f") + ("x" if ratio else ""),
                    num(bound, ".3f") + " (bytes)",
                    num(frac, ".2f"),
                ]
            )
        for n in plan.prefill_tokens:
            v, h = ours.get(f"prefill_{n}"), theirs.get(f"prefill_{n}")
            flops = r.get("prefill_flops", {}).get(n)
            bound = peak * n / flops if isinstance(peak, float) and flops else None
            ratio = v / h if isinstance(v, float) and isinstance(h, float) else None
            frac = v / bound if isinstance(v, float) and bound else None
            table.append(
                [
                    preset,
                    "prefill tok/s",
                    f"{n} tokens",
                    num(v, ".0f"),
                    num(h, ".0f"),
                    num(ratio, ".2f") + ("x" if ratio else ""),
                    num(bound, ".0f") + " (GEMM)",
                    num(frac, ".2f"),
                ]
            )
    return table


def targets(result: dict) -> list[str]:
    """The issue's H200 targets, where their figures were measured."""
    models = result["models"]

    def ms(preset, b):
        d = models.get(preset, {}).get("splitserve", {}).get(f"decode_{b}")
        return d if isinstance(d, dict) else None

    def line(what: str, value: float, met: bool) -> str:
        return f"{what}: {value:.2f} ({'met' if met else 'NOT met'})"

    lines = []
    if q := ms("qwen2.5-0.5b", 1):
        lines.append(line("qwen2.5-0.5b batch-1 decode <= 3.6 ms/step", q["ms_per_step"], q["ms_per_step"] <= 3.6))
    if l1 := ms("llama3.1-8b", 1):
        frac = l1["bytes_bound_ms"] / l1["ms_per_step"]
        lines.append(line("llama3.1-8b batch-1 decode >= 0.6 of the bytes bound", frac, frac >= 0.6))
        if l32 := ms("llama3.1-8b", 32):
            ratio = l32["ms_per_step"] / l1["ms_per_step"]
            lines.append(line("llama3.1-8b batch-32 step <= 1.3x the batch-1 step", ratio, ratio <= 1.3))
    for preset, r in models.items():
        v, flops = r.get("splitserve", {}).get("prefill_2048"), r.get("prefill_flops", {}).get(2048)
        if isinstance(v, float) and flops and isinstance(result["gemm_peak_flops"], float):
            frac = v * flops / 2048 / result["gemm_peak_flops"]
            lines.append(line(f"{preset} prefill 2048 >= 0.5 of the GEMM peak", frac, frac >= 0.5))
    return lines


def print_report(result: dict, plan: Plan) -> None:
    bw, peak = result["copy_bandwidth_gb_s"], result["gemm_peak_flops"]
    print(
        f"\n== summary: {result['device']}, {result['dtype']}; copy bandwidth "
        f"{bw:.0f} GB/s, {result['dtype']} GEMM peak {peak / 1e12:.1f} TFLOP/s (both measured in this run)"
        if isinstance(bw, float) and isinstance(peak, float)
        else f"\n== summary: {result['device']} ({bw}, {peak})"
    )
    print(f"triton: {result['triton']}")
    for preset, r in result["models"].items():
        errors = [e for e in (r.get("error"), r.get("transformers", {}).get("error")) if e]
        print(
            f"{preset}: timed decode steps ran: {r.get('decode_path', '-')}; decode attention backend: "
            f"{r.get('decode_backend', '-')}" + "".join(f"; {e}" for e in errors)
        )
    header = ["model", "measure", "size", "splitserve", "transformers", "vs transformers", "bound", "fraction of bound"]
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows(result, plan):
        print("| " + " | ".join(row) + " |")
    if result["device"].startswith("cuda"):
        print()
        for line in targets(result) or ["targets: no figure to compare"]:
            print("target " + line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--models", default=None, help="comma-separated presets (default: the device's plan)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    ap.add_argument("--budget", type=float, default=450, help="seconds for the whole run")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()

    plan = PLANS["cuda" if args.device.startswith("cuda") else "cpu"]
    if args.models:
        plan = replace(plan, models=tuple(args.models.split(",")))
    torch.set_num_threads(args.threads)
    budget = Budget(args.budget)
    dev, dtype = args.device, getattr(torch, args.dtype)
    machine = print_header(args.dtype, args.threads, dev)
    result = {"device": dev, "dtype": args.dtype, "machine": machine, "plan": vars(plan), "models": {}}
    result["triton"] = triton_status(dev)
    log("== machine")
    bw = attempt(budget, plan.step_s, "copy bandwidth", lambda: copy_bandwidth(dev, plan.copy_bytes))
    peak = attempt(budget, plan.step_s, f"{args.dtype} GEMM peak", lambda: gemm_peak(dev, dtype, plan.gemm_size))
    result["copy_bandwidth_gb_s"] = bw / 1e9 if isinstance(bw, float) else bw
    result["gemm_peak_flops"] = peak
    with tempfile.TemporaryDirectory(prefix="gpu_bench") as work:
        for preset in plan.models:
            if not isinstance(bw, float):
                break
            result["models"][preset] = bench_model(preset, plan, args, budget, Path(work), bw)
            shutil.rmtree(Path(work) / preset, ignore_errors=True)  # 16 GB for llama3.1-8b
    result["targets"] = targets(result) if dev.startswith("cuda") else []
    result["seconds"] = time.monotonic() - budget.start
    print_report(result, plan)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, default=str, indent=1) + "\n")
    failed = [p for p, r in result["models"].items() if "error" in r]
    return 1 if failed or not isinstance(bw, float) else 0


if __name__ == "__main__":
    sys.exit(main())
