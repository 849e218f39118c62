#!/usr/bin/env python3
"""Engine benchmark: splitserve's offline engine against transformers and the machine's own bounds.

Everything is measured in one run on the same checkpoint (default: the qwen2.5-0.5b preset in bf16,
written with `splitserve make-model` when missing), with fixed prompt lengths and thread counts:

- prefill tok/s at batch 1 and 8 (prompts of --prompt-len tokens), splitserve and transformers;
- decode tok/s: splitserve at batch 1, 8 and 32 with mixed prompt lengths under continuous batching
  (time spent in pure decode steps only), transformers `generate` at batch 1, 8, 16 and 32 (static
  batches: (T(N) - T(1)) / (N - 1) per step, as the field measures it);
- two bounds for a decode step: (weight bytes + KV bytes read) / copy bandwidth, and the time of
  `F.linear` on the model's own weight shapes at that batch size (the practical bound);
- ratios: batch-1 decode vs transformers batch 1, batch-32 decode vs transformers' best static
  batch, prefill vs transformers;
- with a bf16 --dtype, splitserve also at `--dtype auto` (--engine-dtypes), which computes a bf16 checkpoint
  in float32 on a CPU without native bf16 where measuring says so (docs/engine.md): each engine's compute
  dtype and linear kernels (what the tuner chose per weight shape) are printed and in the JSON, its
  figures beside transformers' (an auto engine that computes in bf16, as on a CPU with native bf16, is
  the bf16 one: measured once);
- the peer, vLLM's CPU build (`make peer` builds .peer; `--peer PYTHON` names another, `--no-peer` skips
  it): its offline `LLM` on the same checkpoint, dtype and cores (scripts/peer_vllm.py, in its own
  process before our engine loads, so the two never hold memory or cores at once), the same prompts,
  and our figures as ratios to its own: prefill at batch 1 and 8, decode at each --decode-batches (its
  pure-decode steps timed one by one through vLLM's `LLMEngine.step()`, as ours are; the older
  T(N) - T(1) figure is printed beside it and not used: it was biased low by prefill noise).

Both engines are loaded side by side and measured interleaved (best of --repeats for prefill, best of
two for decode), so drift in this noisy machine's speed hits both alike.

Usage: python scripts/bench_engine.py [--json] [--model DIR] [--dtype float32] [--threads 2] [--device cpu|cuda]
       [--peer PYTHON | --no-peer]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.bench import peer  # noqa: E402
from splitserve.cli import dtype_arg  # noqa: E402
from splitserve.engine import LLM, ModelConfig, SamplingParams  # noqa: E402
from splitserve.engine.hardware import print_header  # noqa: E402
from splitserve.engine.model.loader import parse_dtype  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_time(fn, repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


# ---- machine bounds ---------------------------------------------------------------------------


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes moved (read + write) per second by a large tensor copy."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = best_time(lambda: dst.copy_(src), 5, device)
    return 2 * nbytes / t


def weight_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """[out, in] of every matrix a decode step multiplies by, as splitserve fuses them."""
    per_layer = [
        (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size),
        (cfg.hidden_size, cfg.q_size),
        (2 * cfg.intermediate_size, cfg.hidden_size),
        (cfg.hidden_size, cfg.intermediate_size),
    ]
    return per_layer * cfg.num_layers + [(cfg.vocab_size, cfg.hidden_size)]


def linear_bound(cfg: ModelConfig, batch: int, dtype: torch.dtype, device: str) -> float:
    """Seconds for F.linear over all of the model's weight shapes at m = batch (best of 5)."""
    shapes = weight_shapes(cfg)
    distinct = {s: torch.randn(s, dtype=dtype, device=device) * 0.02 for s in set(shapes)}
    inputs = {k: torch.randn(batch, k, dtype=dtype, device=device) for k in {s[1] for s in shapes}}
    total = 0.0
    for shape, w in distinct.items():
        x = inputs[shape[1]]
        F.linear(x, w)
        total += best_time(lambda x=x, w=w: F.linear(x, w), 5, device) * shapes.count(shape)
    return total


# ---- splitserve -------------------------------------------------------------------------------


def make_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def splitserve_prefill_time(llm: LLM, batch: int, prompt_len: int, device: str) -> float:
    prompts = make_prompts(llm.model_config.vocab_size, [prompt_len] * batch, seed=batch)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    return best_time(lambda: llm.generate(prompts, sp), 1, device)


def splitserve_decode(llm: LLM, batch: int, prompt_len: int, new_tokens: int, device: str) -> dict:
    """Mixed prompt lengths in [prompt_len / 2, 3 * prompt_len / 2], continuous batching, pure-decode steps timed.
    ``paths``: how many of the timed steps each path ran (``ModelRunner.steps``: dynamic, static, graph)."""
    rng = random.Random(1000 + batch)
    lengths = [rng.randint(prompt_len // 2, 3 * prompt_len // 2) for _ in range(batch)]
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in make_prompts(llm.model_config.vocab_size, lengths, seed=batch):
        llm.add_request(p, sp)
    decode_time, decode_tokens, steps, context = 0.0, 0, 0, 0
    paths: Counter[str] = Counter()
    while llm.has_unfinished_requests():
        running = [r for r in llm.scheduler.running if r.num_computed_tokens == r.num_tokens - 1]
        pure_decode = not llm.scheduler.waiting and len(running) == len(llm.scheduler.running) == batch
        ctx = sum(r.num_tokens for r in running)
        before = Counter(llm.runner.steps)
        sync(device)
        start = time.perf_counter()
        llm.step()
        sync(device)
        if pure_decode:
            decode_time += time.perf_counter() - start
            decode_tokens += batch
            steps += 1
            context += ctx
            paths += llm.runner.steps - before
    llm.check_integrity()
    return {
        "tok_s": decode_tokens / decode_time,
        "ms_per_step": 1e3 * decode_time / steps,
        "mean_context": context / steps / batch,
        "paths": dict(paths),
    }


# ---- transformers -----------------------------------------------------------------------------


class HFGenerate:
    """transformers' generate on static batches of equal-length prompts."""

    def __init__(self, model, prompt_len: int, device: str) -> None:
        self.model, self.prompt_len, self.device = model, prompt_len, device

    def time(self, batch: int, new_tokens: int) -> float:
        gen = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, self.model.config.vocab_size, (batch, self.prompt_len), generator=gen).to(self.device)

        def run() -> None:
            with torch.inference_mode():
                self.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    min_new_tokens=new_tokens,
                    max_new_tokens=new_tokens,
                    eos_token_id=None,
                    pad_token_id=0,
                )

        return best_time(run, 1, self.device)


# ---- main -------------------------------------------------------------------------------------


def ensure_model(path: Path, preset: str, dtype: str) -> Path:
    if not (path / "config.json").is_file():
        from splitserve.tools.make_model import make_model

        log(f"writing the {preset} preset to {path} ...")
        make_model(preset, path, dtype=dtype, overwrite=True)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "qwen2.5-0.5b")
    ap.add_argument("--preset", default="qwen2.5-0.5b", help="written to --model when it is missing")
    ap.add_argument("--dtype", default="bfloat16", type=dtype_arg, help="vLLM's names: auto, bf16, half, float32, ...")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--decode-batches", default="1,8,32")
    ap.add_argument("--hf-batches", default="1,8,16,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--engine-dtypes",
        default=None,
        help="comma-separated splitserve dtypes, the first being the main engine (default: --dtype, and auto "
        "after it when --dtype is bfloat16)",
    )
    ap.add_argument("--skip-hf", action="store_true", help="measure splitserve and the bounds only")
    ap.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    peer.add_arguments(ap, timeout_s=1800.0, timeout_help="seconds for the whole vLLM run")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    dev = args.device
    peer_python = peer.peer_python(args.peer, args.no_peer) if dev == "cpu" else None
    model_dir = ensure_model(args.model, args.preset, "bfloat16" if args.dtype == "auto" else args.dtype)
    cfg = ModelConfig.from_model_dir(model_dir)
    dtype = parse_dtype(args.dtype, cfg.checkpoint_dtype)
    args.dtype = str(dtype).removeprefix("torch.")
    if args.engine_dtypes is None:
        engine_dtypes = [args.dtype] + (["auto"] if args.dtype == "bfloat16" and dev == "cpu" else [])
    else:
        engine_dtypes = [dtype_arg(d) for d in args.engine_dtypes.split(",")]
    cpus = peer.pinned_cpus(args.threads) if dev == "cpu" else []
    if cpus:
        os.sched_setaffinity(0, cpus)  # our engine on the very cores the peer is bound to
    machine = print_header(args.dtype, args.threads, dev, to_stderr=args.json)
    decode_batches = [int(b) for b in args.decode_batches.split(",")]
    hf_batches = [int(b) for b in args.hf_batches.split(",")]
    result: dict = {
        "model": str(model_dir),
        "dtype": args.dtype,
        "device": dev,
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "machine": machine,
    }

    log("bounds ...")
    bw = copy_bandwidth(dev)
    elem = torch.empty((), dtype=dtype).element_size()
    weight_bytes = sum(o * i for o, i in weight_shapes(cfg)) * elem
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.kv_size * elem
    result["copy_bandwidth_gb_s"] = bw / 1e9
    result["weight_bytes"] = weight_bytes
    result["cpus"] = cpus
    result["no_peer"] = args.no_peer

    if peer_python is not None:
        log(f"vLLM (the peer, {peer_python}) on cores {peer.cpu_list(cpus)}: the first start compiles for minutes ...")
        extra = [
            "--prompt-len",
            str(args.prompt_len),
            "--new-tokens",
            str(args.new_tokens),
            "--decode-batches",
            args.decode_batches,
            "--repeats",
            str(args.repeats),
        ]
        vllm = peer.run_offline(
            peer_python,
            model_dir,
            args.dtype,
            cpus,
            args.peer_timeout,
            extra,
            log_path=ROOT / "results" / "peer_vllm_engine.log",
        )
        if "error" in vllm:
            log(f"vLLM failed ({vllm['error']})")
        else:
            log(
                f"vLLM ready in {vllm['load_s']:.0f} s; prefill {vllm['prefill_tok_s']}, decode "
                + ", ".join(
                    f"batch {b}: {d['tok_s']:.1f} tok/s ({d['ms_per_step']:.1f} ms a step timed by step; "
                    f"{d.get('ms_per_step_t_diff', float('nan')):.1f} by T(N) - T(1), not used)"
                    for b, d in vllm["decode"].items()
                )
            )
        result["vllm"] = vllm

    engines: dict[str, LLM] = {}
    for name in engine_dtypes:
        candidate = LLM(
            model_dir,
            dtype=name,
            device=dev,
            num_threads=args.threads,
            enable_prefix_caching=False,
            max_num_seqs=max(decode_batches),
            max_num_batched_tokens=max(2048, 8 * args.prompt_len),
            kv_cache_bytes=1 << 30,
        )
        # The same compute dtype is the same engine (auto that stayed bf16): measured once.
        same = next((n for n, e in engines.items() if e.core.dtype == candidate.core.dtype), None)
        log(f"splitserve --dtype {name}: {candidate.core.linear_kernels}" + (f" (the {same} engine)" if same else ""))
        result.setdefault("engines", {})[name] = {
            "linear_kernels": candidate.core.linear_kernels,
            "attention": f"prefill {candidate.core.prefill_backend}, decode {candidate.core.dynamic_decode_backend}",
            "same_as": same,
        }
        if same is None:
            engines[name] = candidate
        else:
            del candidate
    llm = engines[engine_dtypes[0]]
    others = {name: e for name, e in engines.items() if e is not llm}
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
        hf = HFGenerate(model.to(dev).eval(), args.prompt_len, dev)

    # Warm-up both (first calls at a new shape pay for kernel selection), then measure them
    # interleaved, best of --repeats, so that drift in this machine's speed hits both alike.
    # (Two requests, or one where max_num_seqs is 1: a batch it cannot run at once has no pure-decode step.)
    for e in engines.values():
        splitserve_decode(e, min(2, max(decode_batches)), args.prompt_len, 4, dev)
    for b in (1, 8):
        for e in engines.values():
            splitserve_prefill_time(e, b, args.prompt_len, dev)
        if hf:
            hf.time(b, 2)
    ours: dict = {"prefill_tok_s": {}, "decode": {}}
    extra: dict[str, dict] = {name: {"prefill_tok_s": {}, "decode": {}} for name in others}
    theirs: dict = {}
    log("prefill ...")
    for b in (1, 8):
        t_ours, t_hf = [], []
        t_extra: dict[str, list[float]] = {name: [] for name in others}
        for _ in range(args.repeats):
            t_ours.append(splitserve_prefill_time(llm, b, args.prompt_len, dev))
            for name, e in others.items():
                t_extra[name].append(splitserve_prefill_time(e, b, args.prompt_len, dev))
            if hf:
                t_hf.append(hf.time(b, 1))
        ours["prefill_tok_s"][b] = b * args.prompt_len / min(t_ours)
        for name, times in t_extra.items():
            extra[name]["prefill_tok_s"][b] = b * args.prompt_len / min(times)
        if hf:
            theirs.setdefault(b, {})["prefill_tok_s"] = b * args.prompt_len / min(t_hf)
            theirs[b]["t1"] = min(t_hf)
    log("decode ...")
    for b in sorted(set(decode_batches) | (set(hf_batches) if hf else set())):
        runs, t_one, t_full = [], [], []
        extra_runs: dict[str, list[dict]] = {name: [] for name in others}
        for _ in range(2):
            if b in decode_batches:
                runs.append(splitserve_decode(llm, b, args.prompt_len, args.new_tokens, dev))
                for name, e in others.items():
                    extra_runs[name].append(splitserve_decode(e, b, args.prompt_len, args.new_tokens, dev))
            if hf and b in hf_batches:
                t_one.append(theirs[b]["t1"] if b in theirs else hf.time(b, 1))
                t_full.append(hf.time(b, args.new_tokens))
        if runs:
            d = max(runs, key=lambda r: r["tok_s"])
            linear_s = linear_bound(cfg, b, dtype, dev)
            bytes_s = (weight_bytes + d["mean_context"] * b * kv_bytes_per_token) / bw
            d["linear_bound_ms"] = 1e3 * linear_s
            d["bytes_bound_ms"] = 1e3 * bytes_s
            d["fraction_of_linear_bound"] = linear_s / (d["ms_per_step"] / 1e3)
            d["fraction_of_bytes_bound"] = bytes_s / (d["ms_per_step"] / 1e3)
            ours["decode"][b] = d
            log(f"  splitserve batch {b}: {d['tok_s']:.1f} tok/s ({d['ms_per_step']:.1f} ms/step)")
            for name, e_runs in extra_runs.items():
                best = max(e_runs, key=lambda r: r["tok_s"])
                extra[name]["decode"][b] = best
                figures = f"{best['tok_s']:.1f} tok/s ({best['ms_per_step']:.1f} ms/step)"
                log(f"  splitserve --dtype {name} batch {b}: {figures}")
        if t_full:
            step = (min(t_full) - min(t_one)) / (args.new_tokens - 1)
            entry = theirs.setdefault(b, {})
            entry.update({"decode_tok_s": b / step, "ms_per_step": 1e3 * step})
            entry.setdefault("prefill_tok_s", b * args.prompt_len / min(t_one))
            entry.pop("t1", None)
            log(f"  transformers batch {b}: {entry['decode_tok_s']:.1f} tok/s ({entry['ms_per_step']:.1f} ms/step)")
    result["splitserve"] = ours
    for name, figures in extra.items():
        result["engines"][name].update(figures)
    for name, e in engines.items():
        result["engines"][name]["compute_dtype"] = str(e.core.dtype).removeprefix("torch.")
    vllm = result.get("vllm")
    if vllm and "error" not in vllm:
        result["ratios_vs_vllm"] = vllm_ratios(ours, vllm)
        # Issue 29's targets: decode >= 1.0x at every measured batch (1 and 16 at 512 tokens of context), prefill
        # >= 1.0x at batch 1 and 8.
        decode_ratios = [v for k, v in result["ratios_vs_vllm"].items() if k.startswith("decode_batch")]
        result["targets_vs_vllm"] = {
            f"decode >= 1.0x vLLM (batch {', '.join(str(b) for b in ours['decode'])})": bool(decode_ratios)
            and min(decode_ratios) >= 1.0,
            "prefill >= 1.0x vLLM (batch 1 and 8)": all(
                result["ratios_vs_vllm"].get(f"prefill_batch{b}_vs_vllm", 0) >= 1.0 for b in (1, 8)
            ),
        }
    if hf:
        result["transformers"] = theirs
        best_hf = max(v["decode_tok_s"] for v in theirs.values() if "decode_tok_s" in v)
        result["ratios"] = {
            "decode_batch1_vs_hf_batch1": ours["decode"][1]["tok_s"] / theirs[1]["decode_tok_s"]
            if 1 in theirs
            else None,
            "decode_batch32_vs_hf_best": ours["decode"][max(decode_batches)]["tok_s"] / best_hf,
            "prefill_batch1_vs_hf": ours["prefill_tok_s"][1] / theirs[1]["prefill_tok_s"],
            "prefill_batch8_vs_hf": ours["prefill_tok_s"][8] / theirs[8]["prefill_tok_s"],
        }
        for name, figures in extra.items():
            result["engines"][name]["ratios"] = {
                f"decode_batch{b}_vs_hf_batch{b}": d["tok_s"] / theirs[b]["decode_tok_s"]
                for b, d in figures["decode"].items()
                if "decode_tok_s" in theirs.get(b, {})
            } | {f"prefill_batch{b}_vs_hf": v / theirs[b]["prefill_tok_s"] for b, v in figures["prefill_tok_s"].items()}
        result["targets"] = {
            "decode_batch1_vs_hf_batch1 >= 1.2": (result["ratios"]["decode_batch1_vs_hf_batch1"] or 0) >= 1.2,
            "decode_batch32_vs_hf_best >= 2.0": result["ratios"]["decode_batch32_vs_hf_best"] >= 2.0,
            "prefill_vs_hf >= 1.0 (batch 1 and 8)": min(
                result["ratios"]["prefill_batch1_vs_hf"], result["ratios"]["prefill_batch8_vs_hf"]
            )
            >= 1.0,
        }

    if args.json:
        print(json.dumps(result, indent=None, default=float))
    else:
        print_table(result)
    return 0


def vllm_ratios(ours: dict, vllm: dict) -> dict[str, float]:
    """Ours over vLLM's (JSON keys are strings on vLLM's side): > 1 is faster than vLLM."""
    ratios = {}
    for b, v in ours["prefill_tok_s"].items():
        if (theirs := vllm["prefill_tok_s"].get(str(b))) is not None:
            ratios[f"prefill_batch{b}_vs_vllm"] = v / theirs
    for b, d in ours["decode"].items():
        if (theirs := vllm["decode"].get(str(b))) is not None:
            ratios[f"decode_batch{b}_vs_vllm"] = d["tok_s"] / theirs["tok_s"]
    return ratios


def print_table(r: dict) -> None:
    ours, hf = r["splitserve"], r.get("transformers", {})
    vllm = r.get("vllm") or {}
    measured = "error" not in vllm and bool(vllm)
    print(
        f"model {r['model']} ({r['dtype']}, {r['device']}, {r['threads']} threads), prompts of "
        f"{r['prompt_len']} tokens, {r['new_tokens']} new tokens; copy bandwidth {r['copy_bandwidth_gb_s']:.1f} GB/s"
    )
    if not vllm:
        print("vLLM: not measured (--no-peer)" if r.get("no_peer") else peer.NOT_MEASURED)
    elif not measured:
        print(f"vLLM: failed: {vllm['error']}")
    else:
        print(
            f"vLLM {vllm['vllm_version']} (torch {vllm['torch_version']}), offline LLM, cores "
            f"{vllm['omp_threads_bind']}; ready in {vllm['load_s']:.0f} s (compiles on a first start)"
        )
    print()
    cell = lambda x, f=".1f": format(x, f) if x else "-"  # noqa: E731
    ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
    print("| | batch | splitserve | transformers | ratio | vLLM | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    peer_prefill = vllm.get("prefill_tok_s", {}) if measured else {}
    peer_decode = vllm.get("decode", {}) if measured else {}
    for b, v in ours["prefill_tok_s"].items():
        h, p = hf.get(b, {}).get("prefill_tok_s"), peer_prefill.get(str(b))
        print(
            f"| prefill tok/s | {b} | {v:.0f} | {cell(h, '.0f')} | {ratio(v, h)} | {cell(p, '.0f')} | {ratio(v, p)} |"
        )
    for b in sorted(set(ours["decode"]) | set(hf)):
        v = ours["decode"].get(b, {}).get("tok_s")
        h = hf.get(b, {}).get("decode_tok_s")
        p = peer_decode.get(str(b), {}).get("tok_s")
        print(f"| decode tok/s | {b} | {cell(v)} | {cell(h)} | {ratio(v, h)} | {cell(p)} | {ratio(v, p)} |")
    for name, e in r.get("engines", {}).items():
        if "decode" not in e:
            continue
        label = f"--dtype {name} ({e['compute_dtype']})"
        for b, v in e["prefill_tok_s"].items():
            h = hf.get(b, {}).get("prefill_tok_s")
            print(f"| prefill tok/s, {label} | {b} | {v:.0f} | {cell(h, '.0f')} | {ratio(v, h)} | - | - |")
        for b, d in e["decode"].items():
            h = hf.get(b, {}).get("decode_tok_s")
            print(f"| decode tok/s, {label} | {b} | {cell(d['tok_s'])} | {cell(h)} | {ratio(d['tok_s'], h)} | - | - |")
    print()
    for name, e in r.get("engines", {}).items():
        same = f" (the same engine as --dtype {e['same_as']})" if e.get("same_as") else ""
        print(f"splitserve --dtype {name}: {e['linear_kernels']}{same}; attention: {e.get('attention', '-')}")
    print()
    print("| splitserve decode | batch | ms/step | linear bound ms | fraction | bytes bound ms | fraction |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for b, d in ours["decode"].items():
        print(
            f"| | {b} | {d['ms_per_step']:.1f} | {d['linear_bound_ms']:.1f} | {d['fraction_of_linear_bound']:.2f} "
            f"| {d['bytes_bound_ms']:.1f} | {d['fraction_of_bytes_bound']:.2f} |"
        )
    if "ratios" in r:
        print()
        for k, v in r["ratios"].items():
            print(f"{k}: {v:.2f}" if v is not None else f"{k}: -")
        for k, ok in r["targets"].items():
            print(f"target {k}: {'met' if ok else 'NOT met'}")
    if "ratios_vs_vllm" in r:
        print()
        for k, v in r["ratios_vs_vllm"].items():
            print(f"{k}: {v:.2f}")
        for k, ok in r["targets_vs_vllm"].items():
            print(f"target {k}: {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    sys.exit(main())
