"""The soak test, short: ``scripts/soak.py`` as ``make soak`` runs it (mixed load, random cancels, one
decode worker killed mid-decode and restarted), for under a minute instead of five."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_short_soak_loses_no_request_leaks_no_block_and_holds_its_memory(serving_model, tmp_path):
    out = tmp_path / "soak"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--model", str(serving_model),
                           "--duration-s", "40", "--warmup-s", "12", "--concurrency", "6",
                           "--kill-after-steps", "150", "--out-dir", str(out)],
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    verdict = json.loads((out / "soak.json").read_text())
    assert done.returncode == 0 and verdict["passed"], (verdict.get("checks"), verdict.get("problems"), done.stderr[-2000:])
    outcomes = verdict["outcomes"]
    assert outcomes["full"] >= 20 and outcomes.get("cancelled", 0) >= 1, outcomes
    assert not [k for k in outcomes if k.startswith("bad:")]
    assert verdict["blocks_zero_after_s"] is not None
    checked = [row for row in verdict["memory"] if row["checked"]]
    assert {row["name"] for row in checked} >= {"router", "worker"}, verdict["memory"]
    assert all(row["growth"] < 0.10 for row in checked)
    assert verdict["serve_exit"] == 0
