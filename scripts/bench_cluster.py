#!/usr/bin/env python3
"""Cluster timings: start-up, noticing a lost worker, and getting back to full capacity.

All on the tiny checkpoint (fp32), so that the figures are about the system, not the model:

1. ``splitserve serve`` to ready, on the embedded Ray (1 prefill + 1 decode worker);
2. the same on a simulated 3-node cluster (head, a prefill node, a decode node; real Ray nodes on
   127.0.0.1), joined with ``--ray-address`` (cluster start-up reported apart);
3. scaling up: a second decode node joins and ``splitserve scale --decode 2`` returns;
4. a decode node lost with 4 streams running: time until the router drops the worker, the longest
   pause any stream saw (re-prefill on another worker included), and time until a replacement node
   brings the deployment back to 2 healthy decode workers (Ray restarts the lost worker there);
5. on the embedded Ray: a worker process killed (SIGKILL: the socket resets) and a worker process
   stopped (SIGSTOP: nothing resets, as behind a lost node): time to notice each, and for the
   killed one the time until Ray's restart has registered again.

Ratios are against the cold serve-to-ready time of the same run. ``--json`` prints one JSON object
as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.deploy.embedded_ray import use_loopback_ray  # noqa: E402

use_loopback_ray()  # before Ray is imported; children inherit it

from splitserve.client.grpc_client import Client  # noqa: E402
from splitserve.deploy.sim_cluster import ServeProcess, SimCluster  # noqa: E402
from splitserve.engine.hardware import print_header  # noqa: E402

PROMPTS = [list(range(1, 30)), list(range(100, 140)), list(range(300, 320)), list(range(500, 545))]
SAMPLING = dict(max_tokens=150, temperature=0.0, ignore_eos=True)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def until(predicate, timeout_s: float, interval_s: float = 0.02) -> float:
    """Seconds until ``predicate()`` holds; TimeoutError past the deadline."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"not within {timeout_s}s")
        time.sleep(interval_s)
    return time.monotonic() - start


class Streams:
    """The prompts streamed concurrently; records when each token message arrived."""

    def __init__(self, address: str) -> None:
        self.arrivals: list[list[float]] = [[] for _ in PROMPTS]
        self.reprefills = [0] * len(PROMPTS)
        self.pool = ThreadPoolExecutor(len(PROMPTS))
        self.futures = [self.pool.submit(self._one, address, i) for i in range(len(PROMPTS))]
        until(lambda: min(len(a) for a in self.arrivals) >= 5, 60)

    def _one(self, address: str, i: int) -> int:
        tokens = 0
        with Client(address) as client:
            for message in client.stream(token_ids=PROMPTS[i], **SAMPLING):
                if message.token_ids:
                    self.arrivals[i].append(time.monotonic())
                    tokens += len(message.token_ids)
                if message.finish_reason:
                    self.reprefills[i] = message.timing.reprefills
        return tokens

    def finish(self) -> dict:
        counts = [f.result(timeout=300) for f in self.futures]
        assert counts == [SAMPLING["max_tokens"]] * len(PROMPTS), counts
        gaps = [max(b - a for a, b in zip(arr, arr[1:])) for arr in self.arrivals]
        return {"longest_pause_s": max(gaps), "migrated_streams": sum(r > 0 for r in self.reprefills)}


def decode_healthy(served: ServeProcess) -> list[dict]:
    return [w for w in served.workers() if w["role"] == "decode" and w["healthy"]]


def measure_local(model: str, tmp: Path) -> dict:
    served = ServeProcess(
        {"model": model, "dtype": "float32", "port": 0},
        tmp / "local.yaml",
        env={"TMPDIR": tempfile.mkdtemp(prefix="ssb")},
    )
    ready = served.ready_s
    assert served.stop() == 0
    return {"local_ready_s": ready}


def measure_cluster(model: str, tmp: Path) -> dict:
    out: dict = {}
    started = time.monotonic()
    with SimCluster([("prefill", 1), ("decode", 1)]) as sim:
        out["sim_cluster_start_s"] = time.monotonic() - started
        config = {
            "model": model,
            "dtype": "float32",
            "port": 0,
            "ray_address": sim.address,
            "prefill": {"threads": 1},
            "decode": {"threads": 1},
            "faults": {"decode_step_delay_s": 0.02},
        }
        served = ServeProcess(config, tmp / "cluster.yaml")
        try:
            out["cluster_ready_s"] = served.ready_s
            sim.add("decode", 1)
            t = time.monotonic()
            served.cli("scale", "--decode", "2")
            out["scale_up_one_decode_s"] = time.monotonic() - t
            streams = Streams(served.address)
            busy = busiest(lambda: [w for w in decode_healthy(served)])
            lost_at = time.monotonic()
            sim.remove(next(name for name, node in sim.nodes.items() if node == busy["node_id"]))
            out["node_lost_noticed_s"] = until(
                lambda: busy["worker_id"] not in [w["worker_id"] for w in decode_healthy(served)], 30
            )
            out.update(streams.finish())
            sim.add("decode", 1)
            out["replacement_node_to_full_capacity_s"] = until(lambda: len(decode_healthy(served)) == 2, 120, 0.1)
            out["node_lost_full_capacity_s"] = time.monotonic() - lost_at
        finally:
            served.stop()
    return out


def busiest(decode_workers) -> dict:
    """The decode worker running the most streams, once status shows any running."""
    found: list = []

    def busy():
        found[:] = [w for w in decode_workers() if w["running"]]
        return bool(found)

    until(busy, 10)
    return max(found, key=lambda w: w["running"])


def measure_process_loss(model: str) -> dict:
    from splitserve.deploy.config import DeploymentConfig
    from splitserve.deploy.deployment import Deployment

    out: dict = {}
    config = DeploymentConfig.from_dict(
        {
            "model": model,
            "dtype": "float32",
            "port": 0,
            "prefill": {"threads": 1},
            "decode": {"replicas": 2, "threads": 1},
            "faults": {"decode_step_delay_s": 0.02},
        }
    )
    with Deployment(config) as deployment:

        def healthy_decode() -> list[str]:
            return [w["worker_id"] for w in deployment.workers if w["role"] == "decode" and w["healthy"]]

        for how, signum in (("killed", signal.SIGKILL), ("stopped", signal.SIGSTOP)):
            streams = Streams(deployment.address)
            victim = busiest(
                lambda: [
                    {"worker_id": w.worker_id, "running": w.running}
                    for w in Client(deployment.address).status().workers
                    if w.role == "decode"
                ]
            )["worker_id"]
            pid = deployment.worker_pid(victim)
            lost_at = time.monotonic()
            os.kill(pid, signum)
            try:
                out[f"process_{how}_noticed_s"] = until(lambda victim=victim: victim not in healthy_decode(), 30)
                result = streams.finish()
                out[f"process_{how}_longest_pause_s"] = result["longest_pause_s"]
            finally:
                if signum == signal.SIGSTOP:
                    os.kill(pid, signal.SIGCONT)
            until(lambda: len(healthy_decode()) == 2, 120, 0.1)
            out[f"process_{how}_full_capacity_s"] = time.monotonic() - lost_at
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    threads = "torch's default for the embedded start, 1 per worker otherwise"
    machine = print_header("float32 (tiny preset)", threads, "cpu")
    from splitserve.tools.make_model import make_model

    with tempfile.TemporaryDirectory(prefix="ssbc") as tmp:
        tmp = Path(tmp)
        model = str(make_model("tiny", tmp / "tiny", dtype="float32", seed=0))
        results: dict = {}
        log("1/3 serve to ready on the embedded Ray")
        results.update(measure_local(model, tmp))
        log("2/3 simulated cluster: ready, scale up, decode node lost")
        results.update(measure_cluster(model, tmp))
        log("3/3 embedded Ray: worker process killed, worker process stopped")
        results.update(measure_process_loss(model))
    base = results["local_ready_s"]
    rows = [
        ("serve -> ready, embedded Ray (1P+1D)", "local_ready_s"),
        ("simulated 3-node cluster start (not serve)", "sim_cluster_start_s"),
        ("serve -> ready, simulated 3-node (1P+1D)", "cluster_ready_s"),
        ("scale --decode 2 (new node present)", "scale_up_one_decode_s"),
        ("decode node lost: router drops the worker", "node_lost_noticed_s"),
        ("decode node lost: longest stream pause", "longest_pause_s"),
        ("replacement node -> 2 decode workers again", "replacement_node_to_full_capacity_s"),
        ("decode worker killed: noticed", "process_killed_noticed_s"),
        ("decode worker killed: longest stream pause", "process_killed_longest_pause_s"),
        ("decode worker killed: Ray restart, full capacity", "process_killed_full_capacity_s"),
        ("decode worker stopped (no reset): noticed", "process_stopped_noticed_s"),
        ("decode worker stopped: longest stream pause", "process_stopped_longest_pause_s"),
    ]
    print(f"{'measure':52s} {'seconds':>8s} {'x serve->ready':>15s}")
    for label, key in rows:
        print(f"{label:52s} {results[key]:8.2f} {results[key] / base:15.2f}")
    print(f"streams migrated off the lost node: {results['migrated_streams']} of {len(PROMPTS)}")
    if args.json:
        print(json.dumps(results | {"machine": machine}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
