"""The colocated baseline (``mode: colocated``): workers that run both phases in one continuous batch,
behind the same router. Same outputs as the offline engine, the same guarantees (cancel frees every
block, a lost worker's streams migrate, scaling drains), and the same gRPC API."""

from __future__ import annotations

import threading
import time

import pytest

from splitserve.client.grpc_client import Client
from tests.serving.conftest import assert_logprobs_as_offline, start_deployment, wait_for
from tests.serving.crash import kill_worker
from tests.serving.streams import stream_all

PROMPTS = [list(range(1, 30)), list(range(100, 140)), list(range(300, 320)), list(range(500, 545)), [7] * 70]
SAMPLING = dict(max_tokens=60, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(serving_model):
    from splitserve.engine import LLM, SamplingParams

    llm = LLM(serving_model, dtype="float32", num_blocks=256)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**SAMPLING))]


@pytest.fixture(scope="module")
def colocated(ray_session, serving_model):
    # Small budget and chunks, so prompts are prefilled in several chunks mixed with other decodes.
    deployment = start_deployment(
        serving_model,
        mode="colocated",
        colocated={"replicas": 2, "threads": 1},
        engine={"max_num_batched_tokens": 32, "prefill_chunk_size": 16},
        router={"routing_policy": "round_robin"},
        faults={"decode_step_delay_s": 0.01},
    )
    yield deployment
    deployment.stop()


def workers(deployment):
    return Client(deployment.address).status().workers


def assert_no_blocks_in_use(deployment) -> None:
    wait_for(lambda: all(w.kv_blocks_in_use == 0 for w in workers(deployment)), 15)


def test_only_colocated_workers_run_and_output_equals_the_offline_engine(colocated, reference):
    assert sorted((w.role, w.worker_id) for w in workers(colocated)) == [
        ("colocated", "colocated-0"),
        ("colocated", "colocated-1"),
    ]
    results = [f.result(timeout=120) for f in stream_all(colocated.address, PROMPTS, SAMPLING)]
    assert [r[0] for r in results] == reference
    with Client(colocated.address) as client:
        done = client.generate(token_ids=PROMPTS[0], **SAMPLING)
        assert done.token_ids == reference[0] and done.finish_reason == "length"
        assert done.timing["prefill_worker"] == done.timing["decode_worker"]  # one worker did both phases
        assert done.cached_tokens > 0 or client.generate(token_ids=PROMPTS[0], **SAMPLING).cached_tokens > 0
        one = client.generate(token_ids=PROMPTS[1], max_tokens=1, temperature=0.0)
        assert one.token_ids == reference[1][:1] and one.finish_reason == "length"
        text = client.generate(token_ids=PROMPTS[2], **SAMPLING).text
        stop = text[10:13]
        stopped = client.generate(token_ids=PROMPTS[2], stop=[stop], **SAMPLING)
        assert stopped.finish_reason == "stop" and stopped.text == text[: text.index(stop)]
    assert_no_blocks_in_use(colocated)


def test_logprobs_of_a_chunked_prompt_and_its_output(colocated, serving_model):
    """Prompt log-probabilities over several chunks (16 tokens each here), a prefix-cache hit declined for
    them, and the output's, streamed by the colocated worker."""
    with Client(colocated.address) as client:
        client.generate(token_ids=PROMPTS[1], max_tokens=1)  # its prefix is cached now
        done = client.generate(
            token_ids=PROMPTS[1], max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2
        )
    assert done.cached_tokens == 0
    assert_logprobs_as_offline(serving_model, PROMPTS[1], done)
    assert_no_blocks_in_use(colocated)


def test_cancel_mid_stream_frees_every_block(colocated):
    with Client(colocated.address) as client:
        stream = client.stream(token_ids=PROMPTS[3], max_tokens=500, temperature=0.0, ignore_eos=True)
        assert [next(stream) for _ in range(3)]
        wait_for(lambda: sum(w.kv_blocks_in_use for w in workers(colocated)) > 0, 5, 0.05)  # polled every 0.5 s
        stream.close()  # cancels the call
    assert_no_blocks_in_use(colocated)


def test_a_lost_worker_s_streams_migrate_and_scaling_drains(colocated, reference):
    started = threading.Event()
    futures = stream_all(colocated.address, PROMPTS, SAMPLING, started, min_tokens=3)
    assert started.wait(30)
    busiest = max((w for w in workers(colocated)), key=lambda w: w.running).worker_id
    kill_worker(colocated, busiest)  # Ray restarts it; it registers again
    results = [f.result(timeout=120) for f in futures]
    assert [r[0] for r in results] == reference
    assert sum(r[2] for r in results) >= 1, "the lost worker's streams must have migrated"
    wait_for(lambda: sorted(w.worker_id for w in workers(colocated) if w.healthy) == ["colocated-0", "colocated-1"], 60)
    # Scale down under load: the removed worker hands its streams back, and they continue elsewhere.
    started = threading.Event()
    futures = stream_all(colocated.address, PROMPTS, SAMPLING, started, min_tokens=3)
    assert started.wait(30)
    start = time.monotonic()
    reply = colocated.router_host.run(colocated.scale({"colocated": 1}), 120)
    assert reply == {"colocated": 1} and time.monotonic() - start < 60
    assert [f.result(timeout=120)[0] for f in futures] == reference
    assert [w.worker_id for w in workers(colocated)] == ["colocated-0"]
    with pytest.raises(ValueError, match="decode: not a role of this deployment"):
        colocated.router_host.run(colocated.scale({"decode": 2}), 30)
    assert_no_blocks_in_use(colocated)
