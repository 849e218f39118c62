"""Tensor parallelism on the vllm backend: a worker of TP size t is t Ray actors in one placement group, each
running vLLM's engine for its shard (vLLM's external-launcher executor, its process group formed on the worker's
own rendezvous store); rank 0's vLLM scheduler schedules and every other rank runs its steps, sent on the ranks'
own gloo group. The KV moves head by head between workers of different sizes, from and into each rank's part
of vLLM's paged cache, as between splitserve engines.

Two deployments, one after the other: a vLLM prefill worker at TP 2 feeding a vLLM decode worker at TP 1 (over
gloo, each prefill rank sending its KV head), then TP 1 feeding TP 2 (the prefill rank sending each decode rank
its head, the decode follower receiving into its own part of vLLM's cache). Greedy output equals vLLM's offline
``LLM`` (TP 1) and transformers token for token, nothing is left holding a block or a transfer part on any rank,
and a rank killed makes its worker fail as a whole and come back as a new group."""

from __future__ import annotations

import os
import signal

import pytest

from splitserve.client.grpc_client import Client
from tests.serving.conftest import start_deployment, wait_for
from tests.serving.streams import stream_all
from tests.vllm.conftest import GREEDY, PROMPTS


def start_vllm(serving_model, prefill_tp: int, decode_tp: int):
    """1P+1D on the vllm backend at these TP sizes, one thread per rank."""
    return start_deployment(
        serving_model,
        engine={"backend": "vllm", "kv_cache_bytes": 64 << 20, "tensor_parallel_timeout_s": 10.0},
        prefill={"tensor_parallel_size": prefill_tp, "threads": 1},
        decode={"tensor_parallel_size": decode_tp, "threads": 1},
    )


@pytest.fixture(scope="module")
def p2_d1(ray_session, serving_model):
    deployment = start_vllm(serving_model, 2, 1)
    yield deployment
    deployment.stop()


def at_rest(deployment) -> bool:
    ranks = {w: deployment.rank_status(w) for w in deployment.actors}
    busy = {w: r for w, r in ranks.items() if r[0]["blocks_in_use"] or any(rank["parts"] for rank in r)}
    return not busy and not deployment.router.inflight


def test_prefill_tp2_to_decode_tp1_equals_vllm_offline_and_transformers(p2_d1, vllm_offline, transformers_greedy):
    workers = {w.worker_id: w.tensor_parallel_size for w in Client(p2_d1.address).status().workers}
    assert workers == {"prefill-0": 2, "decode-0": 1}
    prefill_ranks = p2_d1.rank_status("prefill-0")
    assert len({rank["pid"] for rank in prefill_ranks}) == 2, "two ranks, two processes"
    results = [f.result(timeout=180) for f in stream_all(p2_d1.address, PROMPTS, GREEDY)]
    served = [r[0] for r in results]
    assert served == vllm_offline
    assert served == transformers_greedy
    # Both prefill ranks ran every step: rank 1's steps are rank 0's scheduler outputs.
    assert p2_d1.rank_status("prefill-0")[1]["steps"] > 0
    wait_for(lambda: at_rest(p2_d1), 15)


def test_a_killed_rank_fails_its_worker_which_comes_back_as_a_new_group(p2_d1, vllm_offline):
    before = [rank["pid"] for rank in p2_d1.rank_status("prefill-0")]
    os.kill(before[1], signal.SIGKILL)  # rank 1: rank 0 loses its events stream, the worker fails as a whole

    def new_group() -> bool:
        try:
            pids = [rank["pid"] for rank in p2_d1.rank_status("prefill-0")]
        except Exception:  # the actor is restarting
            return False
        return len(pids) == 2 and not set(pids) & set(before)

    wait_for(new_group, 120, 0.5)
    wait_for(lambda: any(w.healthy for w in p2_d1.router.pool.prefill), 60, 0.5)
    with Client(p2_d1.address) as client:
        again = client.generate(token_ids=PROMPTS[0], timeout_s=120, **GREEDY)
    assert again.token_ids == vllm_offline[0]
    wait_for(lambda: at_rest(p2_d1), 15)


@pytest.fixture(scope="module")
def p1_d2(ray_session, serving_model, p2_d1):
    p2_d1.stop()  # one deployment at a time on two cores
    deployment = start_vllm(serving_model, 1, 2)
    yield deployment
    deployment.stop()


def test_prefill_tp1_to_decode_tp2_equals_vllm_offline_and_transformers(p1_d2, vllm_offline, transformers_greedy):
    workers = {w.worker_id: w.tensor_parallel_size for w in Client(p1_d2.address).status().workers}
    assert workers == {"prefill-0": 1, "decode-0": 2}
    results = [f.result(timeout=180) for f in stream_all(p1_d2.address, PROMPTS, GREEDY)]
    served = [r[0] for r in results]
    assert served == vllm_offline
    assert served == transformers_greedy
    assert p1_d2.rank_status("decode-0")[1]["steps"] > 0
    wait_for(lambda: at_rest(p1_d2), 15)
