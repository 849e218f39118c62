"""`splitserve serve` as a user runs it: ready line, a request (gRPC and the OpenAI API), then a signal
stops everything it started; with `--metrics-port` and `--log-format json`, its /metrics and its JSON
log lines. However the stop arrives (SIGINT or SIGTERM, to its pid or to its whole process group, a
second one while it stops, with a stream in flight, joined to a Ray cluster), it exits within 5 s
(asserted with 3x slack), leaves no process in its session and no temp folder, and its last line is
"splitserve stopped". Each case starts its own `serve`, in a session of its own (`setsid`, as a
supervisor or a terminal starts it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from splitserve.client.grpc_client import Client

EXIT_BOUND_S = 15.0  # 3x the 5 s target
READY_S = 240.0  # a start takes tens of seconds on 2 busy cores


def session_processes(sid: int) -> dict[int, str]:
    """The processes of this session that have not exited (a zombie has): pid -> start time and name."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                head, _, rest = (entry / "stat").read_text().rpartition(")")
            except OSError:
                continue
            fields = rest.split()
            if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                found[int(entry.name)] = f"{fields[19]} {head.split('(', 1)[1]}"
    return found


class Served:
    """`splitserve serve ARGS` in a session of its own (its pid is its session's and process group's
    id), with TMPDIR a private folder; stdout and stderr are read on threads."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.tmp = tempfile.mkdtemp(prefix="ss")  # short: Ray's socket paths live under it
        env = {**os.environ, "TMPDIR": self.tmp, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(
                target=lambda s=stream, ls=lines: ls.extend(line.rstrip("\n") for line in s), daemon=True
            ).start()
        self.started: dict[int, str] = {}
        self.address = self.line("splitserve ready on ", READY_S).split()[-1]

    def line(self, prefix: str, timeout_s: float, stream: str = "out") -> str:
        lines = self.out if stream == "out" else self.err
        deadline = time.monotonic() + timeout_s
        exited_at = None
        while time.monotonic() < deadline:
            found = next((line for line in list(lines) if prefix in line), None)
            if found:
                return found
            if self.proc.poll() is not None:
                exited_at = exited_at or time.monotonic()
                assert time.monotonic() - exited_at < 1, f"serve exited ({self.proc.returncode}): {self.err[-5:]}"
            time.sleep(0.05)
        raise AssertionError(f"no line with {prefix!r} within {timeout_s}s; stderr ends {self.err[-5:]}")

    def ray_temp_dir(self) -> str:
        return self.line("embedded Ray in ", 10, "err").split("embedded Ray in ")[1].split()[0]

    def signal(self, signum: int, to: str) -> float:
        """Send it to serve's pid or to its whole process group; returns when (monotonic)."""
        self.started = self.started or session_processes(self.proc.pid)
        (os.killpg if to == "group" else os.kill)(self.proc.pid, signum)
        return time.monotonic()

    def exited(self, since: float, bound_s: float = EXIT_BOUND_S) -> tuple[int, float]:
        """Wait for serve to exit; returns its exit code and the seconds since ``since``."""
        code = self.proc.wait(bound_s)
        return code, time.monotonic() - since

    def assert_clean(self) -> None:
        """No process of its session runs (those that were there before the signal nor any other),
        its temp folder is gone, and its last line is "splitserve stopped"."""
        deadline = time.monotonic() + 2  # processes SIGKILLed a moment ago may still be on their way out
        while session_processes(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.started) > 2, "expected serve's Ray processes in its session before the signal"
        assert session_processes(self.proc.pid) == {}, "processes outlived serve"
        time.sleep(0.2)  # the reader threads catch up with the closed pipes
        assert self.out[-1] == "splitserve stopped"
        assert os.listdir(self.tmp) == [], "serve left a temp folder behind"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid, started in {**self.started, **session_processes(self.proc.pid)}.items():
            if session_processes(self.proc.pid).get(pid) == started:  # still the same process: ours
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.tmp, ignore_errors=True)


def make_stream(address: str, max_tokens: int = 4000) -> tuple[threading.Thread, threading.Event, dict]:
    """A long greedy stream in a thread; ``first`` is set at its first message, ``end`` gets how it ended."""
    first, end = threading.Event(), {}

    def run() -> None:
        try:
            with Client(address, timeout_s=120) as client:
                for _ in client.stream(token_ids=[1, 2, 3], max_tokens=max_tokens, ignore_eos=True):
                    first.set()
            end["code"] = "OK"
        except grpc.RpcError as e:
            end["code"], end["details"] = e.code().name, e.details()
        end["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert first.wait(60), f"the stream did not start: {end}"
    return thread, first, end


def slow_decode_config(tmp_path) -> str:
    """Decode steps of 50 ms: a 4000-token stream is still running when serve is stopped."""
    path = tmp_path / "slow.yaml"
    path.write_text("faults:\n  decode_step_delay_s: 0.05\n")
    return str(path)


def test_serve_prints_ready_serves_and_stops_on_sigterm(serving_model):
    served = Served(
        "--model",
        str(serving_model),
        "--dtype",
        "float32",
        "--port",
        "0",
        "--openai-port",
        "0",
        "--metrics-port",
        "0",
        "--log-format",
        "json",
    )
    try:
        openai_url = served.line("splitserve OpenAI API on ", 1).split()[-1]
        assert served.address.startswith("127.0.0.1:")
        metrics = served.line("metrics on ", 10).split()
        assert metrics[:2] == ["metrics", "on"] and metrics[2].startswith("http://127.0.0.1:")
        assert served.ray_temp_dir().startswith(served.tmp)
        with Client(served.address) as client:
            done = client.generate(token_ids=[1, 2, 3], max_tokens=4, request_id="cli-1")
            assert len(done.token_ids) == 4
        with urllib.request.urlopen(metrics[2], timeout=10) as response:
            assert (
                b'splitserve_requests_total{finish_reason="length",outcome="finished",status="OK"} 1.0'
                in response.read()
            )
        assert openai_url.startswith("http://127.0.0.1:") and openai_url.endswith("/v1")
        with urllib.request.urlopen(f"{openai_url}/models", timeout=10) as response:
            assert json.load(response)["data"][0]["id"] == serving_model.name
        code, took = served.exited(served.signal(signal.SIGTERM, "pid"))
        print(f"SIGTERM to the pid: serve exited in {took:.1f}s")
        assert code == 0 and took < EXIT_BOUND_S
        served.assert_clean()
        lines = [json.loads(line) for line in served.err if line.startswith("{")]  # the router's lines, as JSON
        request = [line for line in lines if line.get("request_id") == "cli-1"]
        assert len(request) == 1 and request[0]["total_ms"] == round(done.timing["total_ms"], 3)
        assert any("serving clients on" in line["message"] for line in lines)
    finally:
        served.close()


@pytest.mark.parametrize(
    ("signum", "to"),
    [(signal.SIGINT, "pid"), (signal.SIGINT, "group"), (signal.SIGTERM, "group")],
    ids=["SIGINT-pid", "SIGINT-group", "SIGTERM-group"],
)  # SIGTERM to the pid: the test above
def test_serve_stops_within_bound_however_the_signal_arrives(serving_model, signum, to):
    served = Served("--model", str(serving_model), "--dtype", "float32", "--port", "0")
    try:
        ray_temp_dir = served.ray_temp_dir()
        assert os.path.isdir(ray_temp_dir) and ray_temp_dir.startswith(served.tmp)
        code, took = served.exited(served.signal(signum, to))
        print(f"{signal.Signals(signum).name} to the {to}: serve exited in {took:.1f}s")
        assert code == 0 and took < EXIT_BOUND_S
        served.assert_clean()
        assert f"stopping on {signal.Signals(signum).name}" in "\n".join(served.err)
    finally:
        served.close()


def test_serve_ends_streams_in_flight_with_unavailable(serving_model, tmp_path):
    served = Served(
        "--model", str(serving_model), "--dtype", "float32", "--port", "0", "--config", slow_decode_config(tmp_path)
    )
    try:
        thread, _, end = make_stream(served.address)
        sent = served.signal(signal.SIGTERM, "group")
        thread.join(EXIT_BOUND_S)
        assert not thread.is_alive(), "the stream did not end within the bound"
        assert end.get("code") == "UNAVAILABLE", end
        assert end["at"] - sent < EXIT_BOUND_S
        code, took = served.exited(sent)
        print(
            f"SIGTERM to the group, a stream in flight: it ended {end['at'] - sent:.1f}s after, "
            f"serve exited in {took:.1f}s"
        )
        assert code == 0 and took < EXIT_BOUND_S
        served.assert_clean()
        with pytest.raises(grpc.RpcError) as refused:  # nothing listens any more
            with Client(served.address, timeout_s=5) as client:
                client.generate(token_ids=[1, 2, 3], max_tokens=2)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        served.close()


def test_second_signal_while_stopping_exits_at_once(serving_model, tmp_path):
    served = Served(
        "--model", str(serving_model), "--dtype", "float32", "--port", "0", "--config", slow_decode_config(tmp_path)
    )
    try:
        make_stream(served.address)  # the router's grace for it keeps the stop going for a while
        first = served.signal(signal.SIGTERM, "group")
        served.line("stopping on SIGTERM", EXIT_BOUND_S, "err")
        second = served.signal(signal.SIGINT, "pid")
        code, took = served.exited(second)
        print(
            f"a second signal while stopping: serve exited {took:.2f}s after it, {time.monotonic() - first:.1f}s "
            f"after the first"
        )
        assert code == 128 + signal.SIGINT  # 130: cut short, unlike a completed stop (0)
        assert took < 3.0  # at once (3x a 1 s target): no step of the stop is waited for
        assert "second SIGINT while stopping: exiting at once" in "\n".join(served.err)
        served.assert_clean()
    finally:
        served.close()


RAY_PROBE = """
import json, ray
from splitserve.deploy import ray_adapter
ray.init(address={address!r}, log_to_driver=False)
actors = ray_adapter.actor_table()
print(json.dumps({{"actors": actors, "answer": ray.get(ray.remote(lambda: 42).remote(), timeout=60)}}))
"""


def probe_cluster(address: str) -> dict:
    """The cluster's actors, and whether it still runs a task, from a driver of its own."""
    done = subprocess.run(
        [sys.executable, "-c", RAY_PROBE.format(address=address)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_serve_joined_to_a_cluster_stops_its_workers_and_leaves_the_cluster(serving_model):
    from splitserve.deploy.sim_cluster import SimCluster

    with SimCluster([], head_cpus=2) as cluster:
        served = Served(
            "--model", str(serving_model), "--dtype", "float32", "--port", "0", "--ray-address", cluster.address
        )
        try:
            with Client(served.address) as client:
                assert len(client.generate(token_ids=[1, 2, 3], max_tokens=4).token_ids) == 4
            ours = [a for a in probe_cluster(cluster.address)["actors"] if a["class"] == "WorkerActor"]
            assert len(ours) == 2 and all(a["state"] == "ALIVE" for a in ours), ours
            code, took = served.exited(served.signal(signal.SIGTERM, "group"))
            print(f"SIGTERM to the group, joined to a cluster: serve exited in {took:.1f}s")
            assert code == 0 and took < EXIT_BOUND_S
            assert served.out[-1] == "splitserve stopped"
            assert session_processes(served.proc.pid) == {}, "processes outlived serve"
            after = probe_cluster(cluster.address)
            assert after["answer"] == 42  # the cluster stays and answers
            states = {a["pid"]: a["state"] for a in after["actors"] if a["class"] == "WorkerActor"}
            assert states == {a["pid"]: "DEAD" for a in ours}
            deadline = time.monotonic() + 10
            while any(Path(f"/proc/{a['pid']}").exists() for a in ours) and time.monotonic() < deadline:
                time.sleep(0.1)
            left = [a["pid"] for a in ours if Path(f"/proc/{a['pid']}").exists()]
            assert not left, "worker processes outlived serve"
        finally:
            served.close()
