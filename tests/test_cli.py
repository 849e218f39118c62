"""The `splitserve` command line, run as a user runs it (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "splitserve.cli", *args], capture_output=True, text=True, timeout=120, check=check
    )


def test_make_model_then_generate(tmp_path):
    out = tmp_path / "tiny"
    made = run_cli("make-model", "--preset", "tiny", "--dtype", "float32", "--out", str(out))
    assert "wrote tiny" in made.stdout
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    gen = run_cli(
        "generate", "--model", str(out), "--prompt", "Hello", "--prompt", "def f(x):", "--max-tokens", "6", "--json"
    )
    lines = [json.loads(line) for line in gen.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello", "def f(x):"]
    for line in lines:
        assert line["finish_reason"] in ("length", "stop")
        assert 1 <= len(line["token_ids"]) <= 6
    assert "tok/s" in gen.stderr and "'in_use': 0" in gen.stderr


def test_errors_are_reported_by_name(tmp_path):
    missing = run_cli("generate", "--model", str(tmp_path / "nowhere"), check=False)
    assert missing.returncode == 2
    assert "config.json" in missing.stderr
    bad = run_cli("make-model", "--preset", "huge", "--out", str(tmp_path / "x"), check=False)
    assert bad.returncode == 2 and "huge" in bad.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    exists = run_cli("make-model", "--preset", "tiny", "--out", str(tmp_path / "full"), check=False)
    assert exists.returncode == 2 and "full" in exists.stderr
