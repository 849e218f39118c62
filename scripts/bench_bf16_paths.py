#!/usr/bin/env python3
"""Every bf16 linear path the tuner can pick, on a preset's own weight shapes, and what ``--dtype auto`` decides.

For each distinct weight shape of the preset (fused q/k/v with its bias, o, fused gate/up, down, the LM
head), in bf16, this times the tuner's candidates as the tuner times them at load
(``splitserve.engine.model.linear_tuner.measure``: best-of ms at each row count of ``ROW_GRID``, the LM
head up to 64 rows, interleaved): "plain" (``F.linear``), "packed" (oneDNN, where it runs bf16 here),
"upcast" (bf16 weight upcast per call), "fp32" and "fp32-packed" (float32 copies of the weight). It
prints them with the tuner's choice per shape, then the sum over the model's layers both ways, as
``--dtype auto`` weighs them on a CPU without native bf16 (``linear_tuner.compare_fp32``): the fastest
path keeping the weights in bf16 against the fastest on float32 weights. The machine header comes first
(``$SPLITSERVE_CPU_ISA``, when set, is named there: it changes the candidates, not the CPU).

    python scripts/bench_bf16_paths.py [--preset qwen2.5-0.5b] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.engine.hardware import print_header  # noqa: E402
from splitserve.engine.model.config import ModelConfig  # noqa: E402
from splitserve.engine.model.linear_tuner import (  # noqa: E402
    ROW_GRID,
    SPLIT_ABOVE,
    Choice,
    candidates,
    decide,
    measure,
    weighted_both_ways,
)


def shapes_of(cfg: ModelConfig) -> Counter:
    """(out, in, bias) -> layers, as splitserve fuses them; the LM head once."""
    shapes: Counter = Counter()
    for _ in range(cfg.num_layers):
        shapes[(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size, cfg.qkv_bias)] += 1
        shapes[(cfg.hidden_size, cfg.q_size, cfg.o_bias)] += 1
        shapes[(2 * cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)] += 1
        shapes[(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)] += 1
    shapes[(cfg.vocab_size, cfg.hidden_size, False)] += 1
    return shapes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from splitserve.tools.make_model import PRESETS

    torch.set_num_threads(args.threads)
    machine = print_header("bfloat16", args.threads, "cpu", to_stderr=args.json)
    cfg = ModelConfig.from_dict(PRESETS[args.preset])
    result: dict = {"machine": machine, "preset": args.preset, "threads": args.threads, "shapes": []}
    totals = {"bf16": 0.0, "fp32": 0.0}
    torch.manual_seed(0)
    for (out, inp, bias), count in shapes_of(cfg).items():
        weight = (torch.randn(out, inp) * 0.02).to(torch.bfloat16)
        b = (torch.randn(out) * 0.02).to(torch.bfloat16) if bias else None
        paths = candidates(weight, True)
        rows = tuple(m for m in ROW_GRID if out != cfg.vocab_size or m <= 64)
        times = measure(weight, b, rows, paths=paths)
        path, split_rows = decide(times, allow_split=True)
        # Summed as compare_fp32 sums them (a split-fp32 layer keeps the bf16 weight: the bf16 side).
        shape_bf16, shape_fp32 = weighted_both_ways(Choice(path, split_rows, "measured", times), count)
        totals["bf16"] += shape_bf16
        totals["fp32"] += shape_fp32
        choice = f"{path} at {split_rows} rows" if path in SPLIT_ABOVE else path
        result["shapes"].append(
            {"shape": [out, inp], "bias": bias, "count": count, "times_ms": times, "choice": choice}
        )
    result["weighted_ms"] = totals
    if args.json:
        print(json.dumps(result))
        return 0
    grid = ", ".join(map(str, ROW_GRID))
    print(f"\n{args.preset}, bf16, {args.threads} threads: best-of ms at m = {grid} (the LM head up to 64)\n")
    print("| shape [out x in] | layers | path | ms |")
    print("| --- | --- | --- | --- |")
    for s in result["shapes"]:
        for p, t in s["times_ms"].items():
            mark = " (chosen)" if s["choice"].startswith(p) and (p != "plain" or s["choice"] == "plain") else ""
            label = f"{s['shape'][0]} x {s['shape'][1]}{' +bias' if s['bias'] else ''}"
            print(f"| {label} | {s['count']} | {p}{mark} | {' / '.join(f'{ms:.3g}' for ms in t.values())} |")
    chosen = ", ".join(f"{s['shape'][0]}x{s['shape'][1]} {s['choice']}" for s in result["shapes"])
    print(f"\nchoices: {chosen}")
    print(
        f"weighted sum over the layers (ROW_WEIGHTS): fastest bf16-storage path {totals['bf16']:.3g} ms, "
        f"fastest float32-weight path {totals['fp32']:.3g} ms: --dtype auto on a CPU without native bf16 "
        f"would compute in {'float32' if totals['fp32'] < totals['bf16'] else 'bfloat16'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
