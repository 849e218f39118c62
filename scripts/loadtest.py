#!/usr/bin/env python3
"""Multi-node load test: a simulated multi-node Ray cluster, a deployment across it, a bounded load.

1. starts a simulated cluster on this machine (``splitserve.deploy.sim_cluster``: a head, one node per
   prefill worker and one per decode worker, real raylets on 127.0.0.1);
2. ``splitserve serve --config`` joined to it, in its own process, as an operator runs it;
3. ``splitserve bench sweep --ray-address ... --clients N`` against it (a list of rates, the chat-like
   dataset by default, SLOs): the load comes from N client actors spread over the cluster's nodes,
   merged into one result per rate (``splitserve.bench.ray_clients``; ``--clients 0``: one process);
4. checks that no request failed, that no load client was lost, and that, once the load is over, no
   worker holds a KV block;
5. writes ``loadtest.json`` (the verdict, the sweep's summary, the workers and their nodes) next to
   the sweep's ``sweep.json``, ``rate_<R>.json`` and PNG plots in ``--out-dir``.

Exit status 0 only when every check passed. ``make loadtest`` runs the default; the CI test runs a
short version (tests/load/test_loadtest.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.deploy.embedded_ray import use_loopback_ray  # noqa: E402

use_loopback_ray()  # before Ray is imported; every child inherits it

from splitserve.deploy.sim_cluster import ServeProcess, SimCluster  # noqa: E402
from splitserve.engine.hardware import print_header  # noqa: E402


def log(message: str) -> None:
    print(f"loadtest: {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset",
        default="tiny",
        choices=["tiny", "small", "qwen2.5-0.5b"],
        help="random-weight checkpoint written for the run (default tiny)",
    )
    p.add_argument("--model", default=None, help="a local HF folder instead of --preset")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers, each on its own node")
    p.add_argument("--decode", type=int, default=2, help="decode workers, each on its own node")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--dataset", default="chat")
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--rates", default="2,4,8", help="request rates of the sweep, req/s")
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:200"], help="SLOs, KEY:MS")
    p.add_argument("--out-dir", default="results/loadtest")
    p.add_argument(
        "--clients", type=int, default=2, help="load client actors on the cluster (0: the bench in one process)"
    )
    p.add_argument("--client-cpus", type=float, default=1.0, help="Ray CPUs each load client reserves")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of the whole bench, seconds")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = print_header(args.dtype, f"{args.threads} per worker", "cpu")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sslt") as tmp:
        model = args.model
        if model is None:
            from splitserve.tools.make_model import make_model

            model = str(make_model(args.preset, Path(tmp) / args.preset, dtype=args.dtype, seed=0))
        started = time.monotonic()
        nodes = [("prefill", 1)] * args.prefill + [("decode", 1)] * args.decode
        log(f"starting a simulated cluster: head + {args.prefill} prefill + {args.decode} decode nodes")
        with SimCluster(nodes) as sim:
            config = {
                "model": model,
                "dtype": args.dtype,
                "port": 0,
                "ray_address": sim.address,
                "prefill": {"replicas": args.prefill, "threads": args.threads},
                "decode": {"replicas": args.decode, "threads": args.threads},
            }
            served = ServeProcess(config, Path(tmp) / "deploy.yaml")
            try:
                log(f"serving on {served.address} ({served.ready_s:.1f}s after serve started)")
                workers = served.workers()
                bench = [
                    "bench",
                    "sweep",
                    "--rates",
                    args.rates,
                    "--dataset",
                    args.dataset,
                    "--num-prompts",
                    str(args.num_prompts),
                    "--out-dir",
                    str(out),
                    "--no-progress",
                    "--request-timeout",
                    "120",
                ]
                for name in ("input_len", "output_len"):
                    if getattr(args, name) is not None:
                        bench += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
                if args.clients:
                    bench += ["--ray-address", sim.address, "--clients", str(args.clients)]
                    bench += ["--client-cpus", str(args.client_cpus)]
                bench += ["--goodput", *args.goodput]
                log(f"splitserve {' '.join(bench)}")
                print(served.cli(*bench, timeout_s=args.timeout))
                leaked = _blocks_in_use_after(served, timeout_s=15)
            finally:
                exit_code = served.stop()
        sweep = json.loads((out / "sweep.json").read_text())
        failed = {str(r["request_rate"]): r["failed"] for r in sweep["results"] if r["failed"]}
        clients = {f"{r['request_rate']:g}": _clients_of(r) for r in sweep["results"] if "ray_clients" in r}
        lost = {rate: c["lost"] for rate, c in clients.items() if c["lost"]}
        checks = {
            "no_request_failed": not failed,
            "no_client_lost": not lost,
            "no_block_leaked": not leaked,
            "serve_stopped_cleanly": exit_code == 0,
        }
        verdict = {
            "machine": machine,
            "passed": all(checks.values()),
            "checks": checks,
            "failed_by_rate": failed,
            "leaked_blocks": leaked,
            "clients_lost_by_rate": lost,
            "load_clients": clients,
            "workers": [{k: w[k] for k in ("role", "worker_id", "node_id", "address")} for w in workers],
            "serve_ready_s": served.ready_s,
            "wall_s": time.monotonic() - started,
            "goodput": sweep["goodput"],
            "results": sweep["results"],
        }
    (out / "loadtest.json").write_text(json.dumps(verdict, indent=2))
    for name, ok in checks.items():
        log(f"{'ok  ' if ok else 'FAIL'} {name}")
    log(f"results in {out}/ (loadtest.json, sweep.json, rate_*.json, *.png)")
    return 0 if verdict["passed"] else 1


def _clients_of(result: dict) -> dict:
    """One rate's load clients: how many, on how many nodes, their clocks, and those lost."""
    report = result["ray_clients"]
    return {
        "clients": report["clients"],
        "nodes": report["nodes"],
        "node_ids": [c["node_id"] for c in report["per_client"]],
        "max_clock_offset_ms": report["max_clock_offset_ms"],
        "clock_uncertainty_ms": report["clock_uncertainty_ms"],
        "lost": [c["client"] for c in report["clients_lost"]],
    }


def _blocks_in_use_after(served: ServeProcess, timeout_s: float) -> dict[str, int]:
    """Workers still holding KV blocks once the load is over (empty when none does within the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {w["worker_id"]: w["kv_blocks_in_use"] for w in served.workers() if w["kv_blocks_in_use"]}
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
