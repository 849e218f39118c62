"""Fault drills: a deployment whose worker ends itself at a kill point (``faults.kill``) while
concurrent streams run, and what that did to them. tests/serving/test_faults.py asserts on these
figures; ``make fault-drill`` (scripts/fault_drill.py) measures them for docs/reliability.md.

Each drill: 1 prefill + 2 decode workers (or 2 + 1 where a prefill worker dies), KV moved one layer
per message (so "after 1 message" is mid-transfer), decode steps slowed to >= 20 ms (so streams are
mid-way). Four greedy streams run concurrently; then the same four again once the worker is back.
The victim's death is read from its process (``DeathWatch``), so "back within" counts from the kill.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from splitserve.client.grpc_client import Client

PROMPTS = [list(range(1, 30)), list(range(100, 140)), list(range(300, 320)), list(range(500, 545))]
SAMPLING = dict(max_tokens=40, temperature=0.0, ignore_eos=True)

# name: (deployment overrides, the kill point)
DRILLS = {
    "prefill_mid_prefill": (
        {"prefill": {"replicas": 2, "threads": 1}},
        {"target": "prefill-0", "at": "prefill", "after": 0},
    ),
    "prefill_mid_transfer": (
        {"prefill": {"replicas": 2, "threads": 1}},
        {"target": "prefill-0", "at": "transfer", "after": 1},
    ),
    "decode_mid_transfer": (
        {"decode": {"replicas": 2, "threads": 1}},
        {"target": "decode-0", "at": "transfer", "after": 1},
    ),
    "decode_mid_stream": (
        {"decode": {"replicas": 2, "threads": 1}},
        {"target": "decode-0", "at": "decode", "after": 8},
    ),
}


def deployment_config(model_dir: str, drill: str, backend: str = "splitserve") -> dict:
    overrides, kill = DRILLS[drill]
    return {
        "model": str(model_dir),
        # vLLM's worker takes its KV cache at start: a small one keeps its start quick.
        "engine": {"backend": backend, **({"kv_cache_bytes": 64 << 20} if backend == "vllm" else {})},
        # These prompts are shorter than one of vLLM's 128-token blocks, so vLLM's prefix cache (and the events
        # its workers publish) holds none of them; prefix-aware routing has only load to go by and may send every
        # stream to one prefill worker: round robin gives the victim its share.
        **({"router": {"routing_policy": "round_robin"}} if backend == "vllm" else {}),
        "dtype": "float32",
        "port": 0,
        "prefill": {"threads": 1},
        "decode": {"threads": 1},
        **overrides,
        "transfer": {"whole_request_bytes": 0, "layer_group_size": 1},
        "faults": {"decode_step_delay_s": 0.02, "kill": [kill]},
    }


def timed_stream(address: str, prompt: list[int], timeout_s: float = 60.0) -> dict:
    """One stream: its tokens, finish reason, re-prefills, and the longest pause between messages."""
    tokens, finish, reprefills, longest = [], 0, 0, 0.0
    with Client(address) as client:
        last = time.monotonic()
        for message in client.stream(token_ids=prompt, timeout_s=timeout_s, **SAMPLING):
            now = time.monotonic()
            longest, last = max(longest, now - last), now
            tokens.extend(message.token_ids)
            if message.finish_reason:
                finish, reprefills = message.finish_reason, message.timing.reprefills
    return {"tokens": tokens, "finish": finish, "reprefills": reprefills, "longest_pause_s": longest}


def _workers(address: str) -> dict:
    return {w.worker_id: w for w in Client(address).status().workers}


def _wait(predicate, timeout_s: float) -> float:
    """Seconds until ``predicate()`` held; raises TimeoutError past ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"not within {timeout_s}s")
        time.sleep(0.05)
    return time.monotonic() - start


class DeathWatch:
    """Notes when a process on this machine ends (gone from /proc, or a zombie not yet reaped): the
    moment of a kill point firing, to 10 ms, read while the drill's streams run."""

    def __init__(self, pid: int, timeout_s: float) -> None:
        self.pid, self.died_at = pid, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(timeout_s,), name=f"death-watch-{pid}", daemon=True)
        self._thread.start()

    def _alive(self) -> bool:
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state not in ("Z", "X")

    def _watch(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            if not self._alive():
                self.died_at = time.monotonic()
                return
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def run_drill(model_dir: str, drill: str, backend: str = "splitserve") -> dict:
    """Run one drill on an embedded Ray (or the one this process has), on this engine backend; returns what
    happened."""
    from splitserve.deploy.config import DeploymentConfig
    from splitserve.deploy.deployment import Deployment

    victim = DRILLS[drill][1]["target"]
    deployment = Deployment(DeploymentConfig.from_dict(deployment_config(model_dir, drill, backend)))
    deployment.start()
    try:
        first = _workers(deployment.address)[victim].incarnation
        death = DeathWatch(deployment.worker_pid(victim), timeout_s=120)
        try:
            started = time.monotonic()
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                streams = list(pool.map(lambda p: timed_stream(deployment.address, p), PROMPTS))
            streams_s = time.monotonic() - started

            def back() -> bool:
                w = _workers(deployment.address).get(victim)
                return w is not None and w.healthy and w.incarnation != first

            _wait(back, 60)
            back_at = time.monotonic()
        finally:
            death.stop()
        if death.died_at is None:
            raise RuntimeError(f"{drill}: {victim} (pid {death.pid}) came back without its process having ended")
        blocks_zero_s = _wait(lambda: all(w.kv_blocks_in_use == 0 for w in _workers(deployment.address).values()), 15)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            again = list(pool.map(lambda p: timed_stream(deployment.address, p), PROMPTS))
        return {
            "drill": drill,
            "streams": streams,
            "again": again,
            "streams_s": streams_s,
            "longest_pause_s": max(s["longest_pause_s"] for s in streams),
            "moved": sum(s["reprefills"] > 0 for s in streams),
            "killed_after_s": death.died_at - started,
            "worker_back_within_s": back_at - death.died_at,
            "blocks_zero_after_s": blocks_zero_s,
            "incarnation_changed": _workers(deployment.address)[victim].incarnation != first,
        }
    finally:
        deployment.stop()


def reference_outputs(model_dir: str) -> list[list[int]]:
    """The offline engine's greedy outputs for PROMPTS: what every drilled stream must equal."""
    from splitserve.engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", num_blocks=256)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**SAMPLING))]


# ---- the router ------------------------------------------------------------------------------------


def _until_it_ends(address: str, prompt: list[int]) -> dict:
    """Stream; the tokens, the status the stream ended with, and when its last token and its end came."""
    import grpc

    tokens, code, last = [], grpc.StatusCode.OK, time.monotonic()
    try:
        with Client(address) as client:
            for message in client.stream(token_ids=prompt, timeout_s=60, **SAMPLING):
                tokens.extend(message.token_ids)
                last = time.monotonic()
    except grpc.RpcError as e:
        code = e.code()
    return {"tokens": tokens, "code": code, "last_token": last, "ended": time.monotonic()}


def accepts(address: str) -> bool:
    """Whether something listens on host:port."""
    import socket

    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


ROUTER_KILL_AFTER_TOKENS = 60


def run_router_drill(model_dir: str, folder) -> dict:
    """``serve`` joined to a simulated cluster (1 prefill + 1 decode node); its router dies after
    relaying ROUTER_KILL_AFTER_TOKENS tokens of four concurrent streams; then ``serve`` again on the
    same cluster and port, as a supervisor would, and the four streams once more."""
    from pathlib import Path

    from splitserve.deploy.sim_cluster import ServeProcess, SimCluster

    folder = Path(folder)
    config = {
        "model": str(model_dir),
        "dtype": "float32",
        "port": 0,
        "prefill": {"threads": 1},
        "decode": {"threads": 1},
        "faults": {"decode_step_delay_s": 0.02},
    }
    kill = {"target": "router", "at": "decode", "after": ROUTER_KILL_AFTER_TOKENS}
    with SimCluster([("prefill", 1), ("decode", 1)]) as cluster:
        config["ray_address"] = cluster.address
        doomed = ServeProcess({**config, "faults": {**config["faults"], "kill": [kill]}}, folder / "doomed.yaml")
        try:
            workers = [w["address"] for w in doomed.workers()]
            listening_before = all(accepts(a) for a in workers)
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                streams = list(pool.map(lambda p: _until_it_ends(doomed.address, p), PROMPTS))
            exit_code = doomed.proc.wait(10)
            died_at = max(s["last_token"] for s in streams)
            _wait(lambda: not any(accepts(a) for a in workers), 60)
            workers_gone_s = time.monotonic() - died_at  # from the router's death (its last token relayed)
        finally:
            doomed.stop()
        config["port"] = int(doomed.address.rsplit(":", 1)[1])
        again = ServeProcess(config, folder / "again.yaml")
        try:
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                after = list(pool.map(lambda p: _until_it_ends(again.address, p), PROMPTS))
            blocks_zero_s = _wait(lambda: all(w["kv_blocks_in_use"] == 0 for w in again.workers()), 15)
            same_port = again.address == doomed.address
        finally:
            again_exit = again.stop()
    return {
        "streams": streams,
        "exit_code": exit_code,
        "listening_before": listening_before,
        "workers": workers,
        "streams_ended_within_s": max(s["ended"] for s in streams) - died_at,
        "workers_gone_within_s": workers_gone_s,
        "restart_ready_s": again.ready_s,
        "same_port": same_port,
        "after": after,
        "blocks_zero_after_s": blocks_zero_s,
        "again_exit": again_exit,
    }
