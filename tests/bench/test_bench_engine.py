"""scripts/bench_engine.py end to end on the tiny preset (no transformers, no peer): the figures it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_engine.py"


def test_one_decode_batch_of_one_is_measured(tmp_path):
    """``--decode-batches 1`` builds the engine with max_num_seqs 1: its warm-up must run one request (two at
    once never reach a pure-decode step there, and the script divided by zero)."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "tiny", "--model", str(tmp_path / "tiny"), "--no-peer", "--skip-hf"]
        + ["--decode-batches", "1", "--repeats", "1", "--prompt-len", "16", "--new-tokens", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    decode = result["splitserve"]["decode"]
    assert list(decode) == ["1"]
    assert decode["1"]["tok_s"] > 0 and decode["1"]["paths"]
    assert set(result["splitserve"]["prefill_tok_s"]) == {"1", "8"}
