#!/usr/bin/env python3
"""Disaggregated against colocated serving, on the same cores, with the same bench.

For one checkpoint preset and one workload, on an embedded Ray:

- disaggregated: 1 prefill + 1 decode worker, ``--threads`` torch threads each;
- conditional (``--local-prefill T,...``): the same workers, with prompts of up to ``T`` uncached tokens
  prefilled on the decode worker (``router.local_prefill_max_tokens``, NVIDIA Dynamo's rule);
- colocated: 1 worker with 2 x ``--threads`` threads (the same cores), once per step budget in
  ``--budgets`` (``engine.max_num_batched_tokens``; chunks up to the budget), so the baseline is
  tuned: the best budget is reported beside the others.

With ``--compare affinity`` it measures instead how the two disaggregated workers share the cores:

- pinned: prefill on the first usable core, decode on the second (``cpus``), ``--threads`` each;
- unpinned: no pinning, 2 x ``--threads`` threads each, so the two workers oversubscribe the cores
  (what a deployment that sets only ``threads`` to the core count gets).

Each deployment gets the same ``splitserve bench sweep`` (same prompts, same arrival seed, the rates
of ``--rates``), with the SLOs of ``--goodput``. Prints, per configuration, the goodput (DistServe's:
the highest rate with >= 90% of requests meeting both SLOs, interpolated) and TTFT / TPOT percentiles
per rate, and for the disaggregated run the KV transfer's time (first token until the KV landed on the
decode worker) against TTFT. Ratios are disaggregated over the best colocated (pinned over unpinned
with ``--compare affinity``). ``--json`` prints one
JSON object as the last line; every sweep's files go under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.deploy.embedded_ray import use_loopback_ray  # noqa: E402

use_loopback_ray()

WORKLOADS = {  # dataset and its length options
    "chat": {"name": "chat"},
    "long": {"name": "summarize"},
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_config(label: str, model: str, dtype: str, overrides: dict, requests, bench, rates, out_dir: Path) -> dict:
    from splitserve.bench.runner import benchmark
    from splitserve.bench.sweep import run_sweep
    from splitserve.deploy.config import DeploymentConfig
    from splitserve.deploy.deployment import Deployment

    raw = {"model": model, "dtype": dtype, "port": 0, **overrides}
    with Deployment(DeploymentConfig.from_dict(raw)) as deployment:
        log(f"== {label}: serving on {deployment.address}")
        config = replace(bench, addr=deployment.address)
        # Warm-up (first-call kernel set-up, allocator growth), with prompts the sweep never uses.
        warm = requests(len(rates))[:4]
        benchmark(warm, [0.0] * len(warm), replace(config, request_rate=math.inf), "", "")
        sweep = run_sweep(requests, config, rates, 0.9, out_dir / label, "", "")
    rows = [
        {
            k: r[k]
            for k in (
                "request_rate",
                "completed",
                "failed",
                "slo_attainment",
                "median_ttft_ms",
                "p90_ttft_ms",
                "p99_ttft_ms",
                "median_tpot_ms",
                "p90_tpot_ms",
                "p99_tpot_ms",
                "mean_ttft_ms",
                "mean_server_transfer_ms",
                "mean_server_prefill_ms",
                "output_throughput",
            )
        }
        for r in sweep["results"]
    ]
    log(f"   {sweep['goodput']['text']}")
    return {"label": label, "goodput": sweep["goodput"], "rows": rows}


RATIO_KEYS = ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "output_throughput")


def rate_ratios(rows: list[dict], baseline: list[dict]) -> list[dict]:
    """Per request rate, each figure of ``rows`` over the same figure of ``baseline`` (nan where 0)."""
    by_rate = {row["request_rate"]: row for row in baseline}
    return [
        {
            "request_rate": row["request_rate"],
            **{
                k: row[k] / by_rate[row["request_rate"]][k] if by_rate[row["request_rate"]][k] else math.nan
                for k in RATIO_KEYS
            },
        }
        for row in rows
        if row["request_rate"] in by_rate
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", choices=["tiny", "small", "qwen2.5-0.5b"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workload", default="chat", choices=sorted(WORKLOADS))
    p.add_argument("--input-len", type=int, default=None, help="median prompt length (the preset's by default)")
    p.add_argument("--output-len", type=int, default=None, help="median output length")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--rates", default="0.5,1,2,4")
    p.add_argument("--goodput", nargs="+", default=["ttft:1000", "tpot:100"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per disaggregated worker")
    p.add_argument("--budgets", default="256,512,2048", help="colocated step budgets to try")
    p.add_argument(
        "--local-prefill",
        default="",
        help="conditional disaggregation: comma-separated router.local_prefill_max_tokens thresholds, each run "
        "as a disaggregated deployment of its own beside the pure modes (e.g. 256,1024); none by default",
    )
    p.add_argument(
        "--compare",
        default="colocated",
        choices=["colocated", "affinity"],
        help="colocated: disaggregated against colocated on the same cores; affinity: disaggregated "
        "with each worker pinned to a core of its own against unpinned and oversubscribed",
    )
    p.add_argument("--out-dir", default="results/disagg")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from splitserve.engine.hardware import print_header

    t = args.threads
    if args.compare == "affinity":
        import os

        usable = sorted(os.sched_getaffinity(0))
        if len(usable) < 2 * t:
            p.error(
                f"--compare affinity needs {2 * t} usable cores for {t} pinned threads per worker; this process "
                f"may run on {len(usable)}"
            )
        cores = (usable[:t], usable[t : 2 * t])
        threads_text = f"pinned: {t} per worker on cores {cores[0]} / {cores[1]}; unpinned: {2 * t} per worker"
    else:
        threads_text = f"{t} per disaggregated worker, {2 * t} colocated"
    machine = print_header(args.dtype, threads_text, "cpu")

    from splitserve.bench.datasets import DatasetOptions, TokenRange, make_requests
    from splitserve.bench.metrics import parse_goodput
    from splitserve.bench.runner import BenchConfig
    from splitserve.bench.sweep import parse_rates
    from splitserve.tools.make_model import PRESETS, make_model

    rates = parse_rates(args.rates)
    slos = parse_goodput(args.goodput)
    out_dir = Path(args.out_dir) / f"{args.preset}-{args.workload}"
    vocab = PRESETS[args.preset]["vocab_size"]
    context = PRESETS[args.preset]["max_position_embeddings"]
    options = DatasetOptions(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        max_model_len=context,
        seed=0,
        **WORKLOADS[args.workload],
    )
    tokens = TokenRange.for_vocab(vocab)

    def requests(i):  # fresh prompts per rate (and for the warm-up): no prefix cache carried over
        return make_requests(replace(options, seed=i), tokens)

    bench = BenchConfig(seed=0, goodput=slos, progress=False, request_timeout_s=600.0)
    runs = []
    with tempfile.TemporaryDirectory(prefix="ssdg") as tmp:
        model = str(make_model(args.preset, Path(tmp) / args.preset, dtype=args.dtype, seed=0))
        if args.compare == "affinity":
            pinned = {role: {"cpus": list(cpus), "threads": t} for role, cpus in zip(("prefill", "decode"), cores)}
            runs.append(run_config("pinned", model, args.dtype, pinned, requests, bench, rates, out_dir))
            unpinned = {"prefill": {"threads": 2 * t}, "decode": {"threads": 2 * t}}
            runs.append(run_config("unpinned", model, args.dtype, unpinned, requests, bench, rates, out_dir))
        else:
            disaggregated = {"prefill": {"threads": t}, "decode": {"threads": t}}
            runs.append(run_config("disaggregated", model, args.dtype, disaggregated, requests, bench, rates, out_dir))
            for threshold in [int(x) for x in args.local_prefill.split(",") if x.strip()]:
                conditional = {**disaggregated, "router": {"local_prefill_max_tokens": threshold}}
                label = f"conditional-{threshold}"
                runs.append(run_config(label, model, args.dtype, conditional, requests, bench, rates, out_dir))
            for budget in [int(b) for b in args.budgets.split(",")]:
                overrides = {
                    "mode": "colocated",
                    "colocated": {"threads": 2 * t},
                    "engine": {"max_num_batched_tokens": budget},
                }
                runs.append(
                    run_config(f"colocated-b{budget}", model, args.dtype, overrides, requests, bench, rates, out_dir)
                )
    disagg = runs[0]
    if args.compare == "affinity":
        best = runs[1]
    else:
        colocated = [r for r in runs if r["label"].startswith("colocated")]
        best = max(colocated, key=lambda r: (r["goodput"]["rate"], sum(row["slo_attainment"] for row in r["rows"])))
    first = requests(0)
    ins = [r.prompt_len for r in first]
    outs = [r.output_len for r in first]
    print(
        f"{args.preset} ({args.dtype}), workload {args.workload}: {len(first)} prompts per rate, input median "
        f"{sorted(ins)[len(ins) // 2]} (max {max(ins)}), output median {sorted(outs)[len(outs) // 2]}; SLOs "
        f"TTFT <= {slos.get('ttft')} ms, TPOT <= {slos.get('tpot')} ms"
    )
    header = (
        f"{'config':20s} {'rate':>5s} {'attain':>7s} {'TTFT p50':>9s} {'p90':>8s} {'p99':>8s} "
        f"{'TPOT p50':>9s} {'p90':>7s} {'p99':>7s} {'tok/s':>7s}"
    )
    print(header)
    for run in runs:
        for row in run["rows"]:
            print(
                f"{run['label']:20s} {row['request_rate']:5g} {row['slo_attainment']:7.0%} "
                f"{row['median_ttft_ms']:9.0f} "
                f"{row['p90_ttft_ms']:8.0f} {row['p99_ttft_ms']:8.0f} {row['median_tpot_ms']:9.1f} "
                f"{row['p90_tpot_ms']:7.1f} "
                f"{row['p99_tpot_ms']:7.1f} {row['output_throughput']:7.1f}"
            )
        print(f"{'':20s} {run['goodput']['text']}")
    share = [row["mean_server_transfer_ms"] / row["mean_ttft_ms"] for row in disagg["rows"] if row["mean_ttft_ms"]]
    transfers = ", ".join(f"{row['mean_server_transfer_ms']:.1f} ms" for row in disagg["rows"])
    shares = ", ".join(f"{s:.1%}" for s in share)
    print(
        f"KV transfer (first token -> KV landed on the decode worker), mean per rate: {transfers}; "
        f"against mean TTFT: {shares}"
    )
    below = [r["label"] for r in (disagg, best) if r["goodput"]["status"] == "below_range"]
    ratio = None if below else disagg["goodput"]["rate"] / best["goodput"]["rate"]
    ratio_text = f"n/a ({' and '.join(below)} below the range)" if below else f"{ratio:.2f}"
    summary = {
        "machine": machine,
        "preset": args.preset,
        "workload": args.workload,
        "slos_ms": slos,
        "runs": runs,
        "compare": args.compare,
        "goodput_ratio": ratio,
    }
    if args.compare == "affinity":
        print(f"goodput pinned / unpinned = {ratio_text}")
        summary["rate_ratios"] = rate_ratios(disagg["rows"], best["rows"])
        print(
            f"{'rate':>5s} {'TTFT p50':>9s} {'TTFT p90':>9s} {'TPOT p50':>9s} {'TPOT p90':>9s} {'tok/s':>7s}"
            "   (pinned / unpinned; below 1 is better for TTFT and TPOT, above 1 for tok/s)"
        )
        for row in summary["rate_ratios"]:
            print(
                f"{row['request_rate']:5g} "
                + " ".join(f"{row[k]:9.2f}" for k in RATIO_KEYS[:-1])
                + f" {row[RATIO_KEYS[-1]]:7.2f}"
            )
    else:
        print(f"best colocated: {best['label']}; goodput disaggregated / colocated = {ratio_text}")
        summary["best_colocated"] = best["label"]
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
