#!/usr/bin/env python3
"""The linear-layer paths at the engine's own shapes: oneDNN prepacked, ``F.linear`` and the tuner's pick.

A decode step multiplies the batch by every weight matrix of the model once (fused q/k/v and
gate/up, as splitserve runs them, and the LM head). For each dtype and batch size m this times one
whole pass over those matrices, three ways:

- ``F.linear`` on the plain ``[out, in]`` weight (MKL for float32, oneDNN or an emulation for bf16);
- oneDNN prepacked (``mkldnn._reorder_linear_weight`` once, then ``mkldnn._linear_pointwise``), the
  path ``splitserve.engine.model.transformer.Linear.pack()`` takes; where this CPU refuses it the reason is printed;
- the project's panel kernel (``splitserve.engine.model.cpu_gemv``), at m up to its ``MAX_ROWS``, where
  it is built;
- the engine's choice, matrix by matrix: what ``splitserve.engine.model.linear_tuner`` picks at load (``auto``) for each
  shape, timed here on its own row grid (``ROW_GRID``; the LM head up to 64 rows), split allowed,

and reports ms per pass, GB/s of weights read and GFLOP/s; then, per shape, the tuner's times and choice.
Beside it, one large ``torch.mm`` (2048 x 2048 x 2048) per dtype: what the cores reach when the product is
compute-bound (skipped for bf16 where this CPU only emulates it: minutes for one product). Each figure is
the best of --repeats after one warm-up call, each call with the weight out of the CPU's caches first (as
the tuner times, and as a model's step finds it; before 2026-12-06 they were timed warm); the machine
header is printed first.

    python scripts/bench_linear.py [--preset qwen2.5-0.5b] [--dtypes float32,bfloat16] [--batches 1,8,32]
                                   [--threads 2] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.engine.hardware import cpu_isa, native_bf16, print_header  # noqa: E402
from splitserve.engine.model import cpu_gemv  # noqa: E402
from splitserve.engine.model.config import ModelConfig  # noqa: E402
from splitserve.engine.model.linear_tuner import (  # noqa: E402
    ROW_GRID,
    SPLITS,
    UNTIMED_BELOW,
    cache_evictor,
    candidates,
    decide,
    kernel_fn,
    measure,
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


EVICT = cache_evictor()


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Best of ``repeats`` calls, each with the weight out of the CPU's caches first (as in a model's step,
    where the rest of the model's weights pushed it out: the tuner times the same way)."""
    fn()  # warm-up: kernel selection and first-touch of the output
    times = []
    for _ in range(repeats):
        EVICT()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def decode_weight_shapes(cfg: ModelConfig) -> Counter[tuple[int, int]]:
    """[out, in] of every matrix one decode step multiplies by, with how many times it occurs."""
    per_layer = [
        (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size),  # fused q/k/v
        (cfg.hidden_size, cfg.q_size),  # o
        (2 * cfg.intermediate_size, cfg.hidden_size),  # fused gate/up
        (cfg.hidden_size, cfg.intermediate_size),  # down
    ]
    shapes = Counter({s: cfg.num_layers for s in per_layer})
    shapes[(cfg.vocab_size, cfg.hidden_size)] += 1  # LM head
    return shapes


def packed_or_reason(weight: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight), None
    except RuntimeError as e:
        return None, str(e).splitlines()[0]


def measure_dtype(
    shapes: Counter, dtype: torch.dtype, batches: list[int], repeats: int, lm_head_rows: tuple[int, int]
) -> dict:
    """Seconds per whole pass at each m for F.linear, prepacked and the engine's choice."""
    weights = {s: torch.randn(s, dtype=dtype) * 0.02 for s in shapes}
    packed, reason = {}, None
    for s, w in weights.items():
        packed[s], why = packed_or_reason(w)
        reason = reason or why
    gemv_ok = cpu_gemv.available(next(iter(weights.values())))
    panels = {s: cpu_gemv.pack(w) for s, w in weights.items()} if gemv_ok else {}
    # As the engine's load tunes a model of these weights (split allowed, float32 copies allowed): a bf16 weight
    # where this CPU (or $SPLITSERVE_CPU_ISA) has no native bf16 is also timed on its float32-compute paths.
    fp32_compute = dtype != torch.float32 and not native_bf16(cpu_isa())
    tuned = {}  # shape -> (path, split_rows, times) as the tuner decides it at load
    engine_fns = {}  # shape -> path -> the engine's call of a kernel the grid below does not time itself
    for s, w in weights.items():
        paths = candidates(w, fp32_weights=True, fp32_compute=fp32_compute)
        if w.numel() < UNTIMED_BELOW or len(paths) == 1:
            tuned[s] = ("plain", 0, None)
        else:
            rows = tuple(m for m in ROW_GRID if s[0] != lm_head_rows[0] or m <= lm_head_rows[1])
            times = measure(w, None, rows, paths=paths)
            tuned[s] = (*decide(times, allow_split=True), times)
        path, split_rows, _ = tuned[s]
        own = ("plain", "packed", "gemv")  # timed by the grid (gemv on its panels above)
        engine_fns[s] = {part: kernel_fn(part, w, None) for part in SPLITS.get(path, (path,)) if part not in own}
        log(f"  {dtype} {s[0]}x{s[1]}: tuner picks {path}" + (f" at {split_rows} rows" if split_rows else ""))
    numel = sum(o * i * n for (o, i), n in shapes.items())
    weight_bytes = numel * weights[next(iter(weights))].element_size()
    rows = []
    for m in batches:
        gemv_here = gemv_ok and m <= cpu_gemv.MAX_ROWS
        per_path = {
            "F.linear": 0.0,
            "packed": 0.0 if reason is None else None,
            "gemv": 0.0 if gemv_here else None,
            "engine": 0.0,
        }
        for s, w in weights.items():
            x = torch.randn(m, s[1], dtype=dtype)
            t_plain = best_seconds(lambda x=x, w=w: F.linear(x, w), repeats)
            per_path["F.linear"] += t_plain * shapes[s]
            t_packed = None
            if packed[s] is not None:
                p = packed[s]
                t_packed = best_seconds(
                    lambda x=x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), repeats
                )
                if per_path["packed"] is not None:
                    per_path["packed"] += t_packed * shapes[s]
            t_gemv = None
            gemv_call = (lambda x, p=panels[s], n=s[0]: cpu_gemv.gemv(x, p, None, n)) if gemv_ok else None
            if gemv_here:
                t_gemv = best_seconds(lambda x=x, fn=gemv_call: fn(x), repeats)
                per_path["gemv"] += t_gemv * shapes[s]
            path, split_rows, _ = tuned[s]
            if path in SPLITS:
                path = SPLITS[path][0] if m <= split_rows else SPLITS[path][1]
            known = {"plain": t_plain, "packed": t_packed, "gemv": t_gemv}.get(path)
            if known is None:  # a float32-compute path, or gemv past the rows the grid offers it
                fn = gemv_call if path == "gemv" else engine_fns[s][path]
                known = best_seconds(lambda x=x, fn=fn: fn(x), repeats)
            per_path["engine"] += known * shapes[s]
        for path, seconds in per_path.items():
            row = {"m": m, "path": path, "ms": None, "weight_gb_s": None, "gflop_s": None}
            if seconds is not None:
                row.update(
                    ms=1e3 * seconds, weight_gb_s=weight_bytes / seconds / 1e9, gflop_s=2 * m * numel / seconds / 1e9
                )
            rows.append(row)
        log(f"  {dtype} m={m}: " + ", ".join(f"{r['path']} {r['ms']:.1f} ms" for r in rows[-4:] if r["ms"] is not None))
    choices = [
        {"shape": [o, i], "count": shapes[(o, i)], "path": path, "split_rows": split_rows, "times_ms": times}
        for (o, i), (path, split_rows, times) in tuned.items()
    ]
    return {"weights": numel, "weight_bytes": weight_bytes, "packed_refused": reason, "tuner": choices, "rows": rows}


def large_gemm_gflop_s(dtype: torch.dtype, n: int, repeats: int) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / best_seconds(lambda: torch.mm(a, b), repeats) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b", help="a make-model preset whose shapes are used")
    ap.add_argument(
        "--dtypes",
        default=None,
        help="comma-separated; default bfloat16 where oneDNN runs it natively, else float32 (bf16 is "
        "emulated there and takes minutes at m = 32)",
    )
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gemm-size", type=int, default=2048)
    ap.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    args = ap.parse_args()
    from splitserve.tools.make_model import PRESETS

    if args.preset not in PRESETS:
        ap.error(f"--preset: unknown {args.preset!r}; valid: {', '.join(PRESETS)}")
    torch.set_num_threads(args.threads)
    if args.dtypes is None:
        args.dtypes = "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"
    dtypes = args.dtypes.split(",")
    machine = print_header(args.dtypes, args.threads, "cpu", to_stderr=args.json)
    cfg = ModelConfig.from_dict(PRESETS[args.preset])
    shapes = decode_weight_shapes(cfg)
    batches = [int(b) for b in args.batches.split(",")]
    result: dict = {
        "machine": machine,
        "preset": args.preset,
        "threads": args.threads,
        "repeats": args.repeats,
        "shapes": [[o, i, n] for (o, i), n in shapes.items()],
        "dtypes": {},
    }
    with torch.inference_mode():
        for name in dtypes:
            dtype = getattr(torch, name)
            log(f"{name}: a whole weight pass per m, then one {args.gemm_size}^3 mm ...")
            entry = measure_dtype(shapes, dtype, batches, args.repeats, (cfg.vocab_size, 64))
            native = dtype not in (torch.bfloat16, torch.float16) or entry["packed_refused"] is None
            # Emulated bf16 takes minutes for one 2048^3 product: skipped, and said so.
            entry["large_gemm_gflop_s"] = large_gemm_gflop_s(dtype, args.gemm_size, args.repeats) if native else None
            result["dtypes"][name] = entry
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"\n{args.preset} decode weights ({sum(shapes.values())} matrices per step), {args.threads} threads, "
        f"best of {args.repeats}\n"
    )
    gemv_absent = f"not offered past {cpu_gemv.MAX_ROWS} rows" if cpu_gemv.EXTENSION.load() else "not built"
    print("| dtype | m | path | ms per pass | GB/s of weights | GFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, entry in result["dtypes"].items():
        for r in entry["rows"]:
            cells = (
                (gemv_absent if r["path"] == "gemv" else "refused", "-", "-")
                if r["ms"] is None
                else (f"{r['ms']:.1f}", f"{r['weight_gb_s']:.1f}", f"{r['gflop_s']:.0f}")
            )
            print(f"| {name} | {r['m']} | {r['path']} | " + " | ".join(cells) + " |")
    print(
        "\nThe tuner's choice per shape (engine/model/linear_tuner.py: best-of ms at each row count m,"
        " split allowed):\n"
    )
    grid = ", ".join(map(str, ROW_GRID))
    # Every path timed for some shape (the float32-compute ones where bf16 is not native), plain first.
    timed = list(dict.fromkeys(p for e in result["dtypes"].values() for c in e["tuner"] for p in c["times_ms"] or {}))
    timed = sorted(timed or ["plain"], key=lambda p: p != "plain")
    heads = [f"plain ms (m: {grid})"] + [f"{p} ms" for p in timed[1:]]
    print("| dtype | shape [out x in] | per step | " + " | ".join(heads) + " | choice |")
    print("| --- | --- | --- | " + "--- | " * len(heads) + "--- |")
    for name, entry in result["dtypes"].items():
        for c in entry["tuner"]:
            times = c["times_ms"] or {}
            cells = [" / ".join(f"{ms:.3g}" for ms in times[p].values()) if p in times else "-" for p in timed]
            choice = f"{c['path']} at {c['split_rows']} rows" if c["path"] in SPLITS else c["path"]
            print(
                f"| {name} | {c['shape'][0]} x {c['shape'][1]} | {c['count']} | " + " | ".join(cells) + f" | {choice} |"
            )
    print()
    for name, entry in result["dtypes"].items():
        gemm = entry["large_gemm_gflop_s"]
        gemm_text = f"{gemm:.0f} GFLOP/s" if gemm is not None else "skipped (emulated on this CPU)"
        print(
            f"{name}: {entry['weight_bytes'] / 1e9:.2f} GB of weights; torch.mm {args.gemm_size}^3 {gemm_text}"
            + (f"; prepacked refused: {entry['packed_refused']}" if entry["packed_refused"] else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
