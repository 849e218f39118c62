"""Tensor parallelism on the vllm backend: a worker of TP size t is t Ray actors in one placement group, each
running vLLM's engine for its shard (vLLM's external-launcher executor, its process group formed on the worker's
own rendezvous store); rank 0's vLLM scheduler schedules and every other rank runs its steps, sent on the ranks'
own gloo group. The KV moves head by head between workers of different sizes, from and into each rank's part
of vLLM's paged cache, as between splitserve engines.

One deployment for the module: a vLLM prefill worker at TP 2 feeding a vLLM decode worker at TP 1 (over gloo,
each rank its own KV sender). Greedy output equals vLLM's offline ``LLM`` (TP 1) and transformers token for
token, and nothing is left holding a block or a transfer part on any rank."""

from __future__ import annotations

import pytest

from splitserve.client.grpc_client import Client
from tests.serving.conftest import start_deployment, wait_for
from tests.serving.streams import stream_all
from tests.vllm.conftest import GREEDY, PROMPTS


@pytest.fixture(scope="module")
def p2_d1(ray_session, serving_model):
    deployment = start_deployment(
        serving_model,
        engine={"backend": "vllm", "kv_cache_bytes": 64 << 20, "tensor_parallel_timeout_s": 10.0},
        prefill={"tensor_parallel_size": 2, "threads": 1},
        decode={"threads": 1},
    )
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
