#!/usr/bin/env python3
"""Decode ms/step on the static-shape path against the dynamic one, same engine, same run.

One engine is built with ``decode_path="static"``; the dynamic path is measured on the very same engine
by detaching its static inputs (the runner then takes the dynamic path for every step; the one extra
scratch KV block changes nothing there). Pure-decode steps are timed as ``scripts/bench_engine.py``
does (mixed prompt lengths around --prompt-len, continuous batching), at each batch size, the two
paths interleaved, best of --repeats, so drift in the machine's speed hits both alike.

The static path's attention reads every row's whole padded block table (``max_model_len /
block_size`` blocks) each layer, so its cost grows with --max-model-len; the dynamic one reads only
the blocks in use.

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
    static_inputs = llm.runner.static

    def measure(path: str, batch: int, new_tokens: int) -> float:
        llm.runner.static = static_inputs if path == "static" else None
        return splitserve_decode(llm, batch, args.prompt_len, new_tokens, args.device)["ms_per_step"]

    for path in ("dynamic", "static"):  # warm-up: first calls at a shape pay for kernel selection
        measure(path, 2, 4)
    result = {
        "model": str(model_dir),
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "max_model_len": args.max_model_len,
        "prompt_len": args.prompt_len,
        "machine": machine,
        "ms_per_step": {},
    }
    for batch in batches:
        times: dict[str, list[float]] = {"dynamic": [], "static": []}
        for _ in range(args.repeats):
            for path in times:
                times[path].append(measure(path, batch, args.new_tokens))
        best = {path: min(t) for path, t in times.items()}
        result["ms_per_step"][batch] = best
        log(f"batch {batch}: dynamic {best['dynamic']:.1f} ms/step, static {best['static']:.1f} ms/step")
    if args.json:
        print(json.dumps(result))
        return 0
    width = static_inputs.max_blocks_per_seq
    print(
        f"\nmax_model_len {args.max_model_len} ({width} blocks per row), {args.dtype}, "
        f"{args.threads} threads, {args.device}"
    )
    print("| batch | dynamic ms/step | static ms/step | static / dynamic |")
    print("|---|---|---|---|")
    for batch, best in result["ms_per_step"].items():
        print(f"| {batch} | {best['dynamic']:.1f} | {best['static']:.1f} | {best['static'] / best['dynamic']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
