#!/usr/bin/env python3
"""How fast ``splitserve simulate`` runs, and how that scales with requests and workers.

A GPU-like profile (published-figure shaped, see docs/planning.md: 8 ms a step, 0.05 ms a prompt token,
0.3 ms a decoding sequence; a 25 GB/s KV link), chat requests (median 256 prompt / 200 output tokens) at a
rate that keeps every worker about as busy at every size, and a disaggregated deployment of half prefill,
half decode workers. Each row runs in this process, one after the other, on one core; the time is the
simulation's own (dataset generation excluded).

    python scripts/bench_simulator.py [--sizes 1000:10,10000:100,100000:1000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def gpu_like_profile():
    from splitserve.deploy.profile import ModelShape, Profile, TransferCost

    model = ModelShape("llama-8b-shaped", "LlamaForCausalLM", 32, 4096, 32, 8, 128, 14336, 128256, 8192)
    coefficients = {
        "const": 8e-3,
        "prefill_tokens": 5e-5,
        "prefill_attention": 1e-6,
        "decodes": 3e-4,
        "decode_context": 1e-6,
    }
    transfer = TransferCost(1e-3, 25e9)  # synthetic, as every figure here (parts: "not measured")
    return Profile(model, "bfloat16", 2, "cuda", "synthetic", 1, 1, coefficients, transfer, source="synthetic")


def run(num_requests: int, workers: int, seed: int = 0) -> dict:
    from splitserve.bench.arrivals import arrival_offsets
    from splitserve.bench.datasets import DatasetOptions, TokenRange, make_requests
    from splitserve.planning.simulator import RoleSpec, SimConfig, simulate

    profile = gpu_like_profile()
    half = max(1, workers // 2)
    config = SimConfig(
        mode="disaggregated",
        prefill=RoleSpec(half, profile, num_blocks=20000, max_inflight=16),
        decode=RoleSpec(workers - half, profile, num_blocks=20000, max_inflight=256),
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=8192,
        routing_policy="least_loaded",
        max_queue=10**9,
    )
    options = DatasetOptions(name="chat", num_prompts=num_requests, max_model_len=8192, seed=seed)
    requests = [(r.prompt, r.output_len) for r in make_requests(options, TokenRange.for_vocab(128256))]
    rate = 4.0 * half  # about four chat requests a second per prefill worker of this profile
    offsets = arrival_offsets(num_requests, rate, 1.0, seed)
    start = time.process_time()
    result, sim = simulate(config, requests, offsets)
    cpu_s = time.process_time() - start
    return {
        "requests": num_requests,
        "workers": workers,
        "rate": rate,
        "cpu_seconds": cpu_s,
        "requests_per_cpu_second": num_requests / cpu_s,
        "simulated_seconds": result["duration"],
        "completed": result["completed"],
        "decode_steps": sum(w.steps for w in sim.decode),
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000:10,10000:100,100000:1000", help="requests:workers, comma-separated")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    rows = []
    for item in args.sizes.split(","):
        n, w = (int(x) for x in item.split(":"))
        row = run(n, w)
        rows.append(row)
        print(
            f"{n:>7} requests on {w:>5} workers: {row['cpu_seconds']:8.1f} s of CPU "
            f"({row['requests_per_cpu_second']:.0f} requests/s), {row['simulated_seconds']:.0f} s simulated, "
            f"{row['decode_steps']} decode steps, {row['completed']} completed, max RSS {row['max_rss_mib']:.0f} MiB",
            flush=True,
        )
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
