"""``engine.backend: vllm``: vLLM's engine core inside a colocated worker (worker_common/vllm_engine.py), behind
the same router, gRPC API and worker contract as the splitserve engine. One deployment for the module (vLLM
starts in about 10 s in eager mode); real worker processes on the session's embedded Ray."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from splitserve.client.grpc_client import Client, make_request
from splitserve.deploy import processes
from splitserve.engine.kv_cache.block_hash import block_hashes
from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc import workers_pb2_grpc as wpb_grpc
from splitserve.v1 import splitserve_pb2 as pb
from tests.conftest import EOS_PROMPT
from tests.observability.scrape import loop_phases, timed_worker_scrapes
from tests.serving.conftest import start_deployment, wait_for
from tests.serving.crash import kill_worker
from tests.serving.streams import stream_all
from tests.vllm.conftest import GREEDY, MAX_TOKENS, PROMPTS, router_view


@pytest.fixture(scope="module")
def deployment(ray_session, serving_model):
    deployment = start_deployment(
        serving_model,
        mode="colocated",
        engine={"backend": "vllm", "kv_cache_bytes": 64 << 20, "max_num_batched_tokens": 256},
        colocated={"replicas": 1, "threads": 1, "max_restarts": 2},
        metrics_port=0,  # the loop phases' test
    )
    yield deployment
    deployment.stop()


def status(deployment):
    return Client(deployment.address).status().workers


def assert_no_blocks_in_use(deployment) -> None:
    wait_for(lambda: all(w.kv_blocks_in_use == 0 for w in status(deployment)), 15)


def test_greedy_equals_vllm_offline_and_transformers(deployment, vllm_offline, transformers_greedy):
    results = [f.result(timeout=120) for f in stream_all(deployment.address, PROMPTS, GREEDY)]
    served = [r[0] for r in results]
    assert served == vllm_offline
    assert served == transformers_greedy
    assert [r[1] for r in results] == [pb.FINISH_REASON_LENGTH] * len(PROMPTS)
    assert_no_blocks_in_use(deployment)


def test_finish_reasons_and_stop_rules_mean_the_same(deployment, serving_model):
    from splitserve.engine import LLM, SamplingParams

    ours = LLM(serving_model, dtype="float32", num_blocks=64)
    with Client(deployment.address) as client:
        # EOS (an extra id in the checkpoint's generation_config) ends the request on both backends.
        eos = client.generate(token_ids=EOS_PROMPT, max_tokens=10, temperature=0.0)
        expected = ours.generate([EOS_PROMPT], SamplingParams(max_tokens=10, temperature=0.0))[0]
        assert eos.token_ids == expected.token_ids and len(eos.token_ids) == 4
        assert eos.finish_reason == expected.finish_reason == "stop"
        # A stop token id: the id that ended it is the stop reason.
        full = client.generate(token_ids=PROMPTS[0], **GREEDY)
        stop_id = full.token_ids[5]
        stopped = client.generate(token_ids=PROMPTS[0], stop_token_ids=[stop_id], **GREEDY)
        assert stopped.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
        assert stopped.finish_reason == "stop"
        # A stop string (matched by the router on both backends).
        stop = full.text[8:11]
        by_text = client.generate(token_ids=PROMPTS[0], stop=[stop], **GREEDY)
        assert by_text.finish_reason == "stop" and by_text.text == full.text[: full.text.index(stop)]
        # max_tokens and min_tokens.
        one = client.generate(token_ids=PROMPTS[1], max_tokens=1, temperature=0.0)
        assert len(one.token_ids) == 1 and one.finish_reason == "length"
        longer = client.generate(token_ids=EOS_PROMPT, max_tokens=10, min_tokens=6, temperature=0.0)
        assert len(longer.token_ids) >= 6
    assert_no_blocks_in_use(deployment)


def test_a_seed_repeats_and_sampling_varies_without_one(deployment):
    sampling = dict(max_tokens=16, temperature=1.0, top_p=0.9, ignore_eos=True)
    with Client(deployment.address) as client:
        a = client.generate(token_ids=PROMPTS[2], seed=1234, **sampling).token_ids
        b = client.generate(token_ids=PROMPTS[2], seed=1234, **sampling).token_ids
        c = client.generate(token_ids=PROMPTS[2], seed=4321, **sampling).token_ids
    assert a == b and len(a) == 16
    assert a != c


def test_a_sampled_request_whose_prompt_is_chunked(deployment, caplog):
    """A prompt longer than the step's token budget (256) is prefilled in chunks; a seeded sampled request's draws
    at its partial chunks are rewound on CPU as vLLM rewinds CUDA generators (a CPU generator has no offset), so
    it neither fails nor depends on how its prompt was chunked: the same seed repeats, alone or beside another."""
    long_prompt = [3 + (13 * j) % 2000 for j in range(600)]
    sampled = dict(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    with Client(deployment.address) as client:
        alone = client.generate(token_ids=long_prompt, **sampled)
        assert len(alone.token_ids) == 8 and alone.finish_reason == "length"
        with ThreadPoolExecutor(2) as pool:  # another prompt beside it shifts its chunks
            beside = pool.submit(client.generate, token_ids=PROMPTS[4] * 2, **sampled)
            again = client.generate(token_ids=long_prompt, **sampled)
            assert len(beside.result(timeout=120).token_ids) == 8
    assert again.token_ids == alone.token_ids
    assert "failed" not in caplog.text  # no step failed and no prefill was retried (the router logs both)
    assert_no_blocks_in_use(deployment)


def test_bad_input_is_refused_by_the_router_and_others_go_on(deployment):
    with Client(deployment.address) as client:
        stream = client.stream(token_ids=PROMPTS[3], max_tokens=40, temperature=0.0, ignore_eos=True)
        first = next(stream)
        with pytest.raises(grpc.RpcError) as err:
            client.generate(token_ids=[1, 2, 10**9], max_tokens=4)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            client.generate(token_ids=[1, 2, 3], max_tokens=4, temperature=-1.0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()
        samples = make_request(token_ids=[1, 2, 3], max_tokens=4)
        samples.n = 2
        with pytest.raises(grpc.RpcError) as err:  # this backend cannot fork samples of one prefill
            list(client.stub.Generate(samples, timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n:" in err.value.details()
        rest = [t for m in stream for t in m.token_ids]
        assert len(first.token_ids) + len(rest) == 40
    assert_no_blocks_in_use(deployment)


def test_cancel_mid_stream_frees_every_block(deployment):
    with Client(deployment.address) as client:
        stream = client.stream(token_ids=PROMPTS[3] * 3, max_tokens=400, temperature=0.0, ignore_eos=True)
        assert [next(stream) for _ in range(3)]
        wait_for(lambda: sum(w.kv_blocks_in_use for w in status(deployment)) > 0, 5, 0.05)
        stream.close()  # cancels the call
    assert_no_blocks_in_use(deployment)
    with Client(deployment.address) as client:  # the worker goes on serving
        assert len(client.generate(token_ids=PROMPTS[0], max_tokens=3, temperature=0.0).token_ids) == 3


def test_the_loop_phases_add_up_to_the_wall_clock(deployment):
    """vLLM's schedule, model and update are booked to the worker loop's phases as the splitserve engine's are
    (tests/serving/test_metrics.py): they add up to the wall clock between two scrapes."""
    first = timed_worker_scrapes(deployment.address)
    with Client(deployment.address) as client:
        for prompt in PROMPTS[:2]:
            assert len(client.generate(token_ids=prompt, **GREEDY).token_ids) == MAX_TOKENS
    time.sleep(0.5)  # idle, so that the window is long against a scrape's own time
    (worker_id,) = last = timed_worker_scrapes(deployment.address)
    wall, phases = loop_phases(first[worker_id], last[worker_id])
    assert sum(phases.values()) == pytest.approx(wall, rel=0.05), (wall, phases)
    assert phases["run"] > 0 and phases["schedule"] > 0 and phases["apply"] > 0 and phases["idle"] > 0, phases
    assert min(phases.values()) >= 0, phases


def model_process(deployment, worker_id: str) -> processes.Process:
    """The colocated CPU worker's model process: vLLM's model runner in a process of its own, as `vllm serve`
    runs it (worker_common/vllm_engine.py, model_process), below the worker's process."""
    found = []
    for p in processes.descendants([processes.process(deployment.worker_pid(worker_id))]):
        try:
            if processes.is_running(p) and "VLLM" in Path(f"/proc/{p.pid}/cmdline").read_text():
                found.append(p)
        except OSError:  # gone since the scan
            pass
    assert len(found) == 1, found
    return found[0]


def test_a_killed_vllm_worker_is_restarted_and_rejoins(deployment, vllm_offline):
    """Its model process goes with it (vLLM's workers watch their parent), and the new worker has its own."""
    (worker,) = status(deployment)
    old_model = model_process(deployment, worker.worker_id)
    kill_worker(deployment, worker.worker_id)
    wait_for(lambda: not processes.is_running(old_model), 30, 0.2)
    wait_for(lambda: [w for w in status(deployment) if w.address != worker.address], 120, 0.5)
    with Client(deployment.address) as client:
        again = client.generate(token_ids=PROMPTS[0], **GREEDY)
    assert again.token_ids == vllm_offline[0]
    assert model_process(deployment, worker.worker_id) != old_model


def test_logprobs_equal_the_splitserve_engines(deployment, serving_model):
    """Of the raw logits on both backends: the chosen and the top tokens' log-probabilities, generated and prompt,
    equal the splitserve engine's (which equal transformers' log_softmax: tests/engine), to 1e-4."""
    from splitserve.engine import LLM, SamplingParams

    prompt = PROMPTS[1]
    ours = LLM(serving_model, dtype="float32", num_blocks=64).generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=2)
    )[0]
    with Client(deployment.address) as client:
        served = client.generate(token_ids=prompt, max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=2)
    assert served.token_ids == ours.token_ids
    assert len(served.logprobs) == 6 and len(served.prompt_logprobs) == len(prompt) - 1
    for got, want in [*zip(served.logprobs, ours.logprobs), *zip(served.prompt_logprobs, ours.prompt_logprobs[1:])]:
        assert got.token_id == want.token_id and got.rank == want.rank
        assert abs(got.logprob - want.logprob) < 1e-4
        assert [t.token_id for t in got.top] == [t for t, _ in want.top]
        assert all(abs(t.logprob - v) < 1e-4 for t, (_, v) in zip(got.top, want.top, strict=True))
    assert all(e.rank == 1 for e in served.logprobs)  # greedy: the chosen token is the top-1 entry


VLLM_CPU_BLOCK = 128  # vLLM's KV page on CPU (the router hashes prompts at engine.block_size, 16)


def test_the_router_follows_vllms_prefix_cache_and_routes_by_it(deployment):
    """vLLM's cached blocks reach the router as its own block hashes (worker_common/vllm_prefix_events.py): the
    router's view equals the worker's snapshot and holds the prompt's full vLLM blocks. With a second worker,
    prompts spread by load come back, each on the worker that caches it (routed by the hashes: on idle workers
    load alone sends every repeat to the same one)."""
    (handle,) = deployment.router.pool.prefill
    vllm_block, router_block = VLLM_CPU_BLOCK, deployment.router.config.block_size
    prompts = [[100 + (41 * i + 7 * j) % 1900 for j in range(vllm_block * 2 + 40)] for i in range(4)]
    full = [block_hashes(p, router_block)[: 2 * vllm_block // router_block] for p in prompts]
    with Client(deployment.address) as client:
        assert client.generate(token_ids=prompts[0], max_tokens=1).token_ids
    wait_for(lambda: set(full[0]) <= router_view(deployment)[handle.view.worker_id], 10)
    with grpc.insecure_channel(handle.spec.address) as channel:
        snapshot = next(iter(wpb_grpc.PrefillWorkerStub(channel).CacheEvents(wpb.CacheEventsRequest(), timeout=10)))
    assert snapshot.kind == wpb.CacheEvent.SNAPSHOT and snapshot.block_size == router_block
    assert set(snapshot.block_hashes) == router_view(deployment)[handle.view.worker_id]
    assert deployment.router_host.run(deployment.scale({"colocated": 2}), 180) == {"colocated": 2}
    try:
        wait_for(lambda: sum(w.healthy for w in deployment.router.pool.prefill) == 2, 120, 0.5)
        with Client(deployment.address) as client, ThreadPoolExecutor(3) as pool:
            assert all(r.token_ids for r in pool.map(lambda p: client.generate(token_ids=p, max_tokens=1), prompts[1:]))

        # The workers' cache events reach the router after the replies: wait until each prompt's blocks are held.
        def holders() -> list[list[str]] | None:
            views = router_view(deployment)
            held = [[w for w, hashes in views.items() if set(f) <= hashes] for f in full]
            return held if all(held) else None

        held = wait_for(holders, 10)
        assert len({h[0] for h in held}) == 2, held  # spread over both workers
        with Client(deployment.address) as client:
            for prompt in prompts:
                assert client.generate(token_ids=[*prompt, 5], max_tokens=1).cached_tokens >= 2 * vllm_block
    finally:
        assert deployment.router_host.run(deployment.scale({"colocated": 1}), 180) == {"colocated": 1}
    assert_no_blocks_in_use(deployment)
