#!/usr/bin/env python3
"""Decode ms/step on the static-shape path against the dynamic one, same engine, same run.

One engine is built with ``decode_path="static"``; the dynamic path is measured on the very same engine
by detaching its static inputs (the runner then takes the dynamic path for every step; the one extra
scratch KV block changes nothing there), twice: its decodes attended in place (the engine's
``dynamic_decode_attention``, the CPU kernel where it builds) and through the gather (``gather``).
Pure-decode steps are timed as ``scripts/bench_engine.py`` does (mixed prompt lengths around --prompt-len,
continuous batching), at each batch size, the paths interleaved, best of --repeats, so drift in the
machine's speed hits them alike.

With the torch reference, the static path's attention reads every row's whole padded block table
(``max_model_len / block_size`` blocks) each layer, so its cost grows with --max-model-len; the gather
reads only the blocks in use; an in-place kernel reads only the positions each row attends to.

Usage: python scripts/bench_decode_path.py [--model DIR] [--dtype float32] [--batches 1,8,32]
       [--max-model-len 1024] [--threads 2] [--device cpu|cuda] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_engine import ensure_model, log, splitserve_decode  # noqa: E402

from splitserve.engine import LLM  # noqa: E402
from splitserve.engine.hardware import print_header  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "qwen2.5-0.5b-fp32")
    ap.add_argument("--preset", default="qwen2.5-0.5b", help="written to --model when it is missing")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    machine = print_header(args.dtype, args.threads, args.device, to_stderr=args.json)
    model_dir = ensure_model(args.model, args.preset, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(
        model_dir,
        dtype=args.dtype,
        device=args.device,
        num_threads=args.threads,
        enable_prefix_caching=False,
        max_num_seqs=max(batches),
        max_model_len=args.max_model_len,
        kv_cache_bytes=1 << 30,
        decode_path="static",
        cuda_graphs=False,
    )
    static_inputs, in_place = llm.runner.static, llm.runner.decode_attention
    paths = ("gather", "dynamic", "static") if in_place is not None else ("dynamic", "static")

    def measure(path: str, batch: int, new_tokens: int) -> float:
        llm.runner.static = static_inputs if path == "static" else None
        llm.runner.decode_attention = None if path == "gather" else in_place
        return splitserve_decode(llm, batch, args.prompt_len, new_tokens, args.device)["ms_per_step"]

    for path in paths:  # warm-up: first calls at a shape pay for kernel selection
        measure(path, 2, 4)
    result = {
        "model": str(model_dir),
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "max_model_len": args.max_model_len,
        "prompt_len": args.prompt_len,
        "machine": machine,
        "dynamic_decode_backend": llm.core.dynamic_decode_backend,
        "static_decode_backend": llm.core.decode_backend,
        "ms_per_step": {},
    }
    for batch in batches:
        times: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(args.repeats):
            for path in times:
                times[path].append(measure(path, batch, args.new_tokens))
        best = {path: min(t) for path, t in times.items()}
        result["ms_per_step"][batch] = best
        log(f"batch {batch}: " + ", ".join(f"{path} {ms:.1f} ms/step" for path, ms in best.items()))
    if args.json:
        print(json.dumps(result))
        return 0
    width = static_inputs.max_blocks_per_seq
    print(
        f"\nmax_model_len {args.max_model_len} ({width} blocks per row), {args.dtype}, "
        f"{args.threads} threads, {args.device}; dynamic: {result['dynamic_decode_backend']}, "
        f"static: {result['static_decode_backend']}"
    )
    gather = "gather" in paths
    print(
        "| batch |"
        + (" dynamic, gather ms/step |" if gather else "")
        + " dynamic ms/step | static ms/step | static / dynamic |"
        + (" gather / dynamic |" if gather else "")
    )
    print("|---|---|---|---|" + ("---|---|" if gather else ""))
    for batch, best in result["ms_per_step"].items():
        row = f"| {batch} |" + (f" {best['gather']:.1f} |" if gather else "")
        row += f" {best['dynamic']:.1f} | {best['static']:.1f} | {best['static'] / best['dynamic']:.2f} |"
        print(row + (f" {best['gather'] / best['dynamic']:.2f} |" if gather else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
