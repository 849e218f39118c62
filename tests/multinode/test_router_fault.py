"""The router dies (its kill point: the ``serve`` process exits at once, as a crash would) while streams
run. Clients get UNAVAILABLE within 5 s, not a hang; Ray ends the dead deployment's workers (their
owner is gone), so nothing is left holding KV memory on the cluster; and ``serve`` started again (as a
supervisor would) on the same cluster and port serves again, exactly."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from splitserve.client import Client
from splitserve.sim_cluster import ServeProcess, SimCluster
from tests.serving.conftest import wait_for

PROMPTS = [list(range(1, 30)), list(range(100, 140)), list(range(300, 320)), list(range(500, 545))]
SAMPLING = dict(max_tokens=100, temperature=0.0, ignore_eos=True)


def stream_until_it_ends(address: str, prompt: list[int]) -> dict:
    """Stream; return the tokens, the status the stream ended with, and when it ended."""
    tokens, code = [], grpc.StatusCode.OK
    try:
        with Client(address) as client:
            for message in client.stream(token_ids=prompt, timeout_s=60, **SAMPLING):
                tokens.extend(message.token_ids)
    except grpc.RpcError as e:
        code = e.code()
    return {"tokens": tokens, "code": code, "ended": time.monotonic()}


def accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(serving_model):
    from engine import LLM, SamplingParams

    llm = LLM(serving_model, dtype="float32", num_blocks=256)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**SAMPLING))]


def test_router_killed_mid_stream_then_restarted(serving_model, reference, tmp_path):
    port = free_port()
    config = {"model": str(serving_model), "dtype": "float32", "port": port, "prefill": {"threads": 1},
              "decode": {"threads": 1}, "faults": {"decode_step_delay_s": 0.02}}  # fmt: skip
    with SimCluster([("prefill", 1), ("decode", 1)]) as cluster:
        config["ray_address"] = cluster.address
        doomed = ServeProcess({**config, "faults": {**config["faults"], "kill": [
            {"target": "router", "at": "decode", "after": 60}]}}, tmp_path / "doomed.yaml")  # fmt: skip
        try:
            workers = [w["address"] for w in doomed.workers()]
            assert len(workers) == 2 and all(accepts(a) for a in workers)
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                results = list(pool.map(lambda p: stream_until_it_ends(doomed.address, p), PROMPTS))
            died = doomed.proc.wait(10)
            assert died != 0
            # At most 60 tokens were relayed in all, then the router was gone: every stream ends UNAVAILABLE.
            assert 40 < sum(len(r["tokens"]) for r in results) <= 60
            assert all(r["code"] == grpc.StatusCode.UNAVAILABLE for r in results), [r["code"] for r in results]
            assert max(r["ended"] for r in results) - min(r["ended"] for r in results) < 5
            for result, want in zip(results, reference):
                assert result["tokens"] == want[: len(result["tokens"])]
            # Ray ends the workers of the dead driver: their servers stop listening.
            wait_for(lambda: not any(accepts(a) for a in workers), 30, 0.2)
        finally:
            doomed.stop()
        # A supervisor starts serve again: same cluster, same port, exact output.
        again = ServeProcess(config, tmp_path / "again.yaml")
        try:
            assert again.address.endswith(f":{port}")
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                results = list(pool.map(lambda p: stream_until_it_ends(again.address, p), PROMPTS))
            assert [r["tokens"] for r in results] == reference
            wait_for(lambda: all(w["kv_blocks_in_use"] == 0 for w in again.workers()), 15)
        finally:
            assert again.stop() == 0
