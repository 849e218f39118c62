#!/usr/bin/env python3
"""docs/planning.md, "At scale": ``splitserve plan`` and ``splitserve simulate`` for 128 H200s serving
Llama-3.1-70B-shaped work, chat and long-document workloads.

The profiles are rooflines of the H200's published figures (``splitserve profile --roofline h200``), NOT
measurements: no H200 profile has been written by ``scripts/gpu_check.sh`` yet. Where one has, give its
folder with ``--profiles`` (files ``h200-70b-tp{2,4,8}.json``) and they are used instead.

For each workload: the plan (the best deployment per GPU, disaggregated or colocated), then a simulated
sweep of the best disaggregated and the best colocated deployment around the rates the plan found, by
``splitserve simulate --rates`` (bench sweep's goodput and plots). Prints one table; everything is
written under ``--out``, the plots under ``OUT/<workload>-<mode>/``.

    python scripts/plan_at_scale.py --out plan-at-scale      # about an hour on one core
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "docs" / "examples" / "plan-70b-h200.yaml"
TPS = (2, 4, 8)
WORKLOADS = {
    "chat": (["--dataset", "chat", "--num-prompts", "300"], ["ttft:1000", "tpot:50"]),
    "long": (
        ["--dataset", "summarize", "--input-len", "8192", "--output-len", "256", "--num-prompts", "200"],
        ["ttft:3000", "tpot:50"],
    ),
}
SWEEP = (0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5)  # of the plan's rate


def splitserve(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", *args], capture_output=True, text=True, cwd=ROOT, env=os.environ
    )
    if done.returncode != 0:
        raise SystemExit(f"splitserve {' '.join(args[:2])}: {done.stderr.strip()[-2000:]}")
    return done.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="plan-at-scale")
    ap.add_argument("--profiles", help="a folder holding h200-70b-tp{2,4,8}.json (default: roofline ones)")
    ap.add_argument("--devices", type=int, default=128)
    ap.add_argument("--workloads", default="chat,long")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    profiles = Path(args.profiles).resolve() if args.profiles else out / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    for tp in TPS:
        path = profiles / f"h200-70b-tp{tp}.json"
        if not path.exists():
            splitserve("profile", "--roofline", "h200", "--shape", "llama3.1-70b", "--tp", str(tp), "--out", str(path))
    sources = {json.loads((profiles / f"h200-70b-tp{tp}.json").read_text())["source"] for tp in TPS}
    print(f"profiles: {'; '.join(sorted(sources))}")
    given = [a for tp in TPS for a in ("--profile", str(profiles / f"h200-70b-tp{tp}.json"))]
    rows = []
    for name in args.workloads.split(","):
        workload, slo = WORKLOADS[name]
        plan_file = out / f"{name}-plan.json"
        if not plan_file.exists():
            started = time.monotonic()
            text = splitserve(
                "plan", *given, "--config", str(BASE), "--slo", *slo, "--devices", str(args.devices),
                "--devices-per-node", "8", "--min-duration", "20", *workload, "--json",
                "--out", str(out / f"{name}-planned.yaml"),
            )  # fmt: skip
            plan_file.write_text(text)
            print(f"{name}: plan in {time.monotonic() - started:.0f} s", file=sys.stderr)
        ranked = json.loads(plan_file.read_text())
        for mode in ("disaggregated", "colocated"):
            best = next(r for r in ranked if r["mode"] == mode)
            rate = best["checked_rate"] or best["predicted_rate"]
            rates = ",".join(f"{rate * f:.4g}" for f in SWEEP)
            deployment = [a for role, n in best["counts"].items() for a in (f"--{role}", str(n))]
            deployment += [a for role, t in best["tp"].items() for a in (f"--{role}-tp", str(t))]
            sweep_dir = out / f"{name}-{mode}"
            result = sweep_dir / "sweep.json"
            if not result.exists():
                started = time.monotonic()
                role_profiles = [
                    a
                    for role, t in best["tp"].items()
                    for a in (f"--{role}-profile", str(profiles / f"h200-70b-tp{t}.json"))
                ]
                splitserve(
                    "simulate", "--profile", role_profiles[1], *role_profiles, "--config", str(BASE), "--mode", mode,
                    *deployment, *workload[:-2], "--num-prompts", str(int(min(8000, max(2000, rate * SWEEP[-1] * 8)))),
                    "--rates", rates, "--goodput", *slo, "--plot-dir", str(sweep_dir), "--save-result", str(result),
                )  # fmt: skip
                print(f"{name} {mode}: sweep in {time.monotonic() - started:.0f} s", file=sys.stderr)
            swept = json.loads(result.read_text())
            goodput = swept["goodput"]["rate"]
            rows.append((name, mode, best["deployment"], best["devices"], best["predicted_rate"], goodput, swept))
    print()
    print("| workload | mode | best deployment | GPUs | plan's rate (req/s) | sweep goodput (req/s) | per GPU |")
    print("|---|---|---|---|---|---|---|")
    for name, mode, deployment, devices, planned, goodput, _ in rows:
        print(
            f"| {name} | {mode} | {deployment} | {devices} | {planned:.4g} | {goodput:.4g} | {goodput / devices:.3g} |"
        )
    for name in args.workloads.split(","):
        by_mode = {mode: goodput / devices for n, mode, _, devices, _, goodput, _ in rows if n == name}
        if by_mode.get("colocated"):
            print(f"{name}: best disaggregated / best colocated goodput per GPU = "
                  f"{by_mode['disaggregated'] / by_mode['colocated']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
