"""A multi-node Ray cluster simulated on one machine, for trying placement, node loss and scaling
without a real cluster (and for the multi-node tests and measurements).

Each node is a real Ray node (its own raylet and worker processes) on 127.0.0.1, started with
``ray.cluster_utils.Cluster`` in a process of its own, with a private temp folder. Worker nodes carry
the custom resource of their role (``splitserve_prefill`` / ``splitserve_decode``), so a deployment
joined to it with ``ray_address`` places each role on its own nodes::

    python -m splitserve.deploy.sim_cluster --node prefill:1 --node decode:2 --node decode:2
    {"address": "127.0.0.1:PORT", "nodes": {"head": ID, "prefill-0": ID, "decode-0": ID, ...}}

Then, one JSON command a line on stdin (each answered by one JSON line): ``{"cmd": "remove",
"node": "decode-0"}`` (a node failure: its processes die), ``{"cmd": "add", "role": "decode",
"units": 2}``, ``{"cmd": "quit"}`` (or end of input, SIGTERM): every node stops and the temp folder
is removed. ``SimCluster`` drives it from Python, and ``ServeProcess`` runs ``splitserve serve``
joined to it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _serve(specs: list[tuple[str, int]], head_cpus: int) -> int:
    from splitserve.deploy.embedded_ray import use_loopback_ray

    use_loopback_ray()
    temp_dir = tempfile.mkdtemp(prefix="sscl")
    os.environ["RAY_TMPDIR"] = temp_dir  # Ray's "current cluster" file goes here, not to /tmp/ray
    ray_dir = os.path.join(temp_dir, "ray")
    os.makedirs(ray_dir)
    from ray.cluster_utils import Cluster

    def node_args(cpus: int, resources: dict) -> dict:
        return dict(
            num_cpus=cpus,
            resources=resources,
            node_ip_address="127.0.0.1",
            include_dashboard=False,
            object_store_memory=80 << 20,
        )

    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True, connect=False, head_node_args={**node_args(head_cpus, {}), "temp_dir": ray_dir}
        )
        nodes = {"head": cluster.head_node}
        counters: dict[str, int] = {}

        def add(role: str, units: int) -> str:
            name = f"{role}-{counters.setdefault(role, 0)}"
            counters[role] += 1
            nodes[name] = cluster.add_node(**node_args(1, {f"splitserve_{role}": units}))
            return name

        for role, units in specs:
            add(role, units)
        cluster.wait_for_nodes()
        _reply({"address": cluster.address, "temp_dir": temp_dir, "nodes": {k: n.node_id for k, n in nodes.items()}})
        signal.signal(signal.SIGTERM, lambda *_: sys.stdin.close())
        while True:
            try:
                line = sys.stdin.readline()
            except (ValueError, OSError):  # stdin closed by SIGTERM
                break
            if not line:
                break
            try:
                command = json.loads(line)
                if command["cmd"] == "quit":
                    break
                if command["cmd"] == "remove":
                    cluster.remove_node(nodes.pop(command["node"]), allow_graceful=command.get("graceful", False))
                    _reply({"ok": True})
                elif command["cmd"] == "add":
                    name = add(command["role"], int(command.get("units", 1)))
                    _reply({"ok": True, "node": name, "node_id": nodes[name].node_id})
                else:
                    _reply({"ok": False, "error": f"cmd: unknown command {command['cmd']!r}"})
            except (KeyError, ValueError, TypeError) as e:
                _reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
    finally:
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    return 0


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class SimCluster:
    """Start ``python -m splitserve.deploy.sim_cluster`` and talk to it; ``close()`` stops every node."""

    def __init__(self, nodes: list[tuple[str, int]], head_cpus: int = 1, timeout_s: float = 120.0) -> None:
        args = [sys.executable, "-m", "splitserve.deploy.sim_cluster", "--head-cpus", str(head_cpus)]
        for role, units in nodes:
            args += ["--node", f"{role}:{units}"]
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
        )
        try:
            info = self._read()
        except Exception:
            self.close()
            raise
        self.address: str = info["address"]
        self.nodes: dict[str, str] = info["nodes"]  # name -> Ray node id

    def remove(self, name: str) -> None:
        """Lose a node: its raylet and every worker process on it die at once."""
        self._call({"cmd": "remove", "node": name})
        self.nodes.pop(name)

    def add(self, role: str, units: int = 1) -> str:
        reply = self._call({"cmd": "add", "role": role, "units": units})
        self.nodes[reply["node"]] = reply["node_id"]
        return reply["node"]

    def close(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> SimCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, command: dict) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if not reply.get("ok"):
            raise RuntimeError(f"sim cluster: {reply.get('error')}")
        return reply

    def _read(self) -> dict:
        import selectors

        deadline = time.monotonic() + self.timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"sim cluster: no answer within {self.timeout_s}s")
                if selector.select(left):
                    line = self.proc.stdout.readline()
                    if not line:
                        raise RuntimeError(f"sim cluster exited (code {self.proc.wait(10)})")
                    if line.startswith("{"):
                        return json.loads(line)


class ServeProcess:
    """``splitserve serve --config FILE`` in a process of its own (as an operator runs it); ready
    once it prints its address. ``ready_s`` is the time from start to ready."""

    def __init__(self, config: dict, path, timeout_s: float = 180.0, env: dict | None = None) -> None:
        import yaml

        Path(path).write_text(yaml.safe_dump(config))
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "serve", "--config", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.address = ""
        self.openai_url = ""  # "http(s)://host:port/v1" when the config sets openai_port
        try:
            self.address = self._await_ready(started + timeout_s)
        except Exception:
            self.stop()
            raise
        self.ready_s = time.monotonic() - started

    def _await_ready(self, deadline: float) -> str:
        """Read serve's stdout until its ready line. A thread reads it (and keeps draining it): lines
        that arrive together sit in the pipe's reader buffer, where waiting on the pipe would miss them."""
        import queue
        import threading

        lines: queue.Queue = queue.Queue()

        def pump() -> None:
            for line in self.proc.stdout:
                lines.put(line)
            lines.put("")

        threading.Thread(target=pump, name="serve-stdout", daemon=True).start()
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            if line.startswith("splitserve OpenAI API on "):
                self.openai_url = line.split()[-1]
            if line.startswith("splitserve ready on "):
                return line.split()[-1]
            if not line:
                raise RuntimeError(f"serve exited with {self.proc.wait(10)} before it was ready")
        raise TimeoutError("serve was not ready in time")

    def cli(self, *args: str, timeout_s: float = 300.0) -> str:
        """Run ``splitserve ARGS --addr <this server>``; returns its stdout."""
        done = subprocess.run(
            [sys.executable, "-m", "splitserve.cli", *args, "--addr", self.address],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0:
            raise RuntimeError(f"splitserve {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def workers(self) -> list[dict]:
        """``splitserve status --json``'s workers."""
        return json.loads(self.cli("status", "--json").splitlines()[-1]).get("workers", [])

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, as an operator's Ctrl-C: the router and every worker stop; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitserve.deploy.sim_cluster", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="ROLE:UNITS",
        help="a worker node with UNITS of splitserve_ROLE (repeat; ROLE prefill or decode)",
    )
    p.add_argument("--head-cpus", type=int, default=1)
    args = p.parse_args(argv)
    specs = []
    for spec in args.node:
        role, _, units = spec.partition(":")
        if role not in ("prefill", "decode") or not units.isdigit():
            p.error(f"--node: expected prefill:N or decode:N, got {spec!r}")
        specs.append((role, int(units)))
    return _serve(specs, args.head_cpus)


if __name__ == "__main__":
    sys.exit(main())
