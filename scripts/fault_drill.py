#!/usr/bin/env python3
"""Fault drills with figures: each worker kill point (mid-prefill, mid-transfer on either side,
mid-decode) and the router's death, timed, for docs/reliability.md.

For each worker drill (``tests/harness/drill.py``): the longest pause any client stream saw, how many
streams moved (re-prefilled elsewhere), whether every output equalled the offline engine, when the
kill point fired (the worker's process ended, from the start of the streams), how long after that the
killed worker was back (Ray restart, re-registered) and when no block was held. For the router: how
long the streams took to end with UNAVAILABLE after the last token, how long after the last token until
the dead deployment's workers were gone (their ports closed), and ``serve`` to ready again. Prints a
table; ``--json`` prints one JSON object. A drill that breaks is printed with its error and the others
still run; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.deploy.embedded_ray import use_loopback_ray  # noqa: E402

use_loopback_ray()  # before Ray is imported

from splitserve.tools.make_model import make_model  # noqa: E402
from tests.harness.drill import DRILLS, reference_outputs, run_drill, run_router_drill  # noqa: E402


def drill_row(model: str, name: str, reference: list[list[int]], folder: Path) -> dict:
    if name == "router":
        r = run_router_drill(model, folder)
        return {
            "drill": "router_mid_stream",
            "codes": sorted({s["code"].name for s in r["streams"]}),
            "streams_ended_within_s": r["streams_ended_within_s"],
            "workers_gone_within_s": r["workers_gone_within_s"],
            "restart_ready_s": r["restart_ready_s"],
            "exact_after_restart": [s["tokens"] for s in r["after"]] == reference,
        }
    r = run_drill(model, name)
    return {
        "drill": name,
        "exact": [s["tokens"] for s in r["streams"]] == reference,
        "longest_pause_s": r["longest_pause_s"],
        "moved": r["moved"],
        "killed_after_s": r["killed_after_s"],
        "worker_back_within_s": r["worker_back_within_s"],
        "blocks_zero_after_s": r["blocks_zero_after_s"],
        "streams_s": r["streams_s"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: a tiny random-weight one)")
    p.add_argument("--drills", default=",".join([*DRILLS, "router"]))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="drill") as tmp:
        model = args.model or str(make_model("tiny", Path(tmp) / "tiny", dtype="float32", seed=0))
        reference = reference_outputs(model)
        rows = []
        for name in args.drills.split(","):
            print(f"drill: {name}", file=sys.stderr, flush=True)
            try:
                rows.append(drill_row(model, name, reference, Path(tmp)))
            except Exception as e:  # a drill that breaks is a finding: say so, and run the others
                rows.append({"drill": name, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"})
    failed = any("error" in row for row in rows)
    if args.json:
        print(json.dumps(rows))
        return int(failed)
    for row in rows:
        print("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
