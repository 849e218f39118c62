"""`splitserve serve` as a user runs it: ready line, a request (gRPC and the OpenAI API), then SIGTERM
stops everything it started; with `--metrics-port` and `--log-format json`, its /metrics and its JSON
log lines."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from splitserve.client import Client


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(int(entry.name))
    return found


def test_serve_prints_ready_serves_and_stops_on_sigterm(serving_model):
    tmp = tempfile.mkdtemp(prefix="ss")  # short: Ray's socket paths live under it
    env = {**os.environ, "TMPDIR": tmp, "PYTHONUNBUFFERED": "1"}
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "serve", "--model", str(serving_model),
                             "--dtype", "float32", "--port", "0", "--openai-port", "0", "--metrics-port", "0",
                             "--log-format", "json"], stdout=subprocess.PIPE, stderr=log, text=True, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        address = openai_url = None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("splitserve OpenAI API on "):
                openai_url = line.split()[-1]
            if line.startswith("splitserve ready on "):
                address = line.split()[-1]
                break
            assert line or proc.poll() is None, "serve exited before it was ready"
        assert address and address.startswith("127.0.0.1:")
        metrics = proc.stdout.readline().split()
        assert metrics[:2] == ["metrics", "on"] and metrics[2].startswith("http://127.0.0.1:")
        assert processes_mentioning(tmp), "expected Ray processes under the private temp dir"
        with Client(address) as client:
            done = client.generate(token_ids=[1, 2, 3], max_tokens=4, request_id="cli-1")
            assert len(done.token_ids) == 4
        with urllib.request.urlopen(metrics[2], timeout=10) as response:
            assert b'splitserve_requests_total{finish_reason="length",outcome="finished",status="OK"} 1.0' in response.read()
        assert openai_url and openai_url.startswith("http://127.0.0.1:") and openai_url.endswith("/v1")
        with urllib.request.urlopen(f"{openai_url}/models", timeout=10) as response:
            assert json.load(response)["data"][0]["id"] == serving_model.name
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert "splitserve stopped" in proc.stdout.read()
        log.seek(0)
        lines = [json.loads(line) for line in log if line.startswith("{")]  # the router's lines, as JSON
        request = [line for line in lines if line.get("request_id") == "cli-1"]
        assert len(request) == 1 and request[0]["total_ms"] == round(done.timing["total_ms"], 3)
        assert any("serving clients on" in line["message"] for line in lines)
        deadline = time.monotonic() + 10
        while processes_mentioning(tmp) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not processes_mentioning(tmp), "processes outlived serve"
        assert os.listdir(tmp) == [], "serve left its Ray temp folder behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
