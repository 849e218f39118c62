#!/usr/bin/env python3
"""The decoder layer's elementwise chain, timed per call: eager (the engine's code) against torch.compile.

For the qwen2.5-0.5b shapes (hidden 896, intermediate 4864, 14 + 2 heads of 64) at --tokens rows, each in
float32 and bfloat16: residual add + RMSNorm, rotary on queries and keys, SiLU*mul. It prints the best
of --repeats calls of each, the compile time of each compiled function (Inductor, ``dynamic=True``,
``emulate_precision_casts`` so that bf16 rounds where eager does), and whether the compiled result is
bit-equal to eager. This is what decides ``torch.compile`` is not used in the engine: see
docs/performance.md.

    python scripts/bench_elementwise.py [--tokens 1 32 512] [--threads 1] [--repeats 300] [--no-compile]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.engine.hardware import print_header  # noqa: E402
from splitserve.engine.model.rope import apply_rotary  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS, HEAD_DIM = 896, 4864, 16, 64


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    h = x + residual
    return weight * F.rms_norm(h.float(), weight.shape, eps=1e-6).to(h.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def make_inputs(tokens: int, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, ...]]:
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape).to(dtype)

    weight = (torch.rand(HIDDEN) + 0.5).to(dtype)
    half = HEAD_DIM // 2
    return {
        "add + RMSNorm": (rand(tokens, HIDDEN), rand(tokens, HIDDEN), weight),
        "rotary (q and k)": (rand(tokens, HEADS, HEAD_DIM), rand(tokens, 1, half), rand(tokens, 1, half)),
        "SiLU*mul": (rand(tokens, 2 * INTERMEDIATE),),
    }


def best_us(fn, args, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return 1e6 * min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print_header("float32, bfloat16", args.threads, "cpu")
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = True
    fns = {"add + RMSNorm": add_rms_norm, "rotary (q and k)": apply_rotary, "SiLU*mul": silu_mul}
    compiled = {name: torch.compile(fn, dynamic=True) for name, fn in fns.items()}
    print("| function | dtype | tokens | eager us | compiled us | compile s | bit-equal |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for tokens in args.tokens:
                inputs = make_inputs(tokens, dtype)
                for name, fn in fns.items():
                    eager = best_us(fn, inputs[name], args.repeats)
                    if args.no_compile:
                        print(f"| {name} | {dtype} | {tokens} | {eager:.1f} | - | - | - |")
                        continue
                    start = time.perf_counter()
                    out = compiled[name](*inputs[name])
                    compile_s = time.perf_counter() - start
                    same = torch.equal(out, fn(*inputs[name]))
                    fast = best_us(compiled[name], inputs[name], args.repeats)
                    print(
                        f"| {name} | {dtype} | {tokens} | {eager:.1f} | {fast:.1f} | {compile_s:.1f} | {same} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
