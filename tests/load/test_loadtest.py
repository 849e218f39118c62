"""The multi-node load test, short: ``scripts/loadtest.py`` as ``make loadtest`` runs it (a simulated
3-node cluster, ``splitserve serve`` joined to it, ``splitserve bench sweep`` from 2 load clients on the
cluster), with a small load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_short_multinode_loadtest_serves_everything_and_leaks_nothing(tmp_path):
    out = tmp_path / "lt"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "loadtest.py"),
            "--num-prompts",
            "16",
            "--rates",
            "4,16",
            "--input-len",
            "64",
            "--output-len",
            "16",
            "--out-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    verdict = json.loads((out / "loadtest.json").read_text())
    assert verdict["passed"] and all(verdict["checks"].values())
    assert verdict["machine"]["logical_cores"] >= 1 and "avx512f" in verdict["machine"]["isa"]
    assert done.stdout.startswith("cpu: "), done.stdout[:200]  # the machine header comes first
    assert [r["completed"] for r in verdict["results"]] == [16, 16]
    assert all(r["failed"] == 0 and r["output_throughput"] > 0 for r in verdict["results"])
    roles = {w["worker_id"]: (w["role"], w["node_id"]) for w in verdict["workers"]}
    assert sorted(roles) == ["decode-0", "decode-1", "prefill-0"]
    assert len({node for _, node in roles.values()}) == 3, "each worker runs on a node of its own"
    assert verdict["clients_lost_by_rate"] == {} and set(verdict["load_clients"]) == {"4", "16"}
    for clients in verdict["load_clients"].values():  # 2 clients of 1 CPU each, on 2 of the 4 one-CPU nodes
        assert clients["clients"] == clients["nodes"] == 2 and clients["lost"] == []
        assert clients["max_clock_offset_ms"] < 50 and clients["clock_uncertainty_ms"] < 50
    assert [r["ray_clients"]["requests_lost"] for r in verdict["results"]] == [0, 0]
    for name in ("sweep.json", "rate_4.json", "rate_16.json", "ttft.png", "tpot.png", "attainment.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
