"""``n`` > 1 samples of one prompt, disaggregated and colocated: one prefill (the workers' computed-token
counters), samples equal to single requests with seed + i, choices 0..n-1 interleaved as they stream,
usage per sample, each sample's log-probabilities, a cancel that frees every sample's blocks, and ``n`` out of
range refused by name."""

from __future__ import annotations

import grpc
import pytest

from splitserve.client.grpc_client import Client, make_request
from splitserve.v1 import splitserve_pb2 as pb
from splitserve.v1 import splitserve_pb2_grpc as pb_grpc
from tests.observability.scrape import Scrape
from tests.serving.conftest import start_deployment, wait_for

BLOCK = 16  # the engine's default block size


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def served(request, ray_session, serving_model):
    layout = {"mode": "colocated", "colocated": {"replicas": 1, "threads": 1}} if request.param == "colocated" else {}
    deployment = start_deployment(serving_model, metrics_port=0, faults={"decode_step_delay_s": 0.01}, **layout)
    deployment.layout = request.param
    yield deployment
    deployment.stop()


def workers(deployment):
    with Client(deployment.address) as client:
        return client.status().workers


def computed_tokens(deployment) -> dict[str, float]:
    """Tokens each worker's model has computed (the sum of its steps' batch tokens)."""
    return {
        w.role: Scrape.http(w.metrics_address).value("splitserve_engine_batch_tokens_sum") for w in workers(deployment)
    }


def assert_no_blocks_in_use(deployment) -> None:
    wait_for(lambda: all(w.kv_blocks_in_use == 0 for w in workers(deployment)), 15)


def generate(deployment, prompt: list[int], n: int, **sampling) -> list[pb.GenerateResponse]:
    message = make_request(token_ids=prompt, **sampling)
    if n is not None:
        message.n = n
    with grpc.insecure_channel(deployment.address) as channel:
        return list(pb_grpc.SplitServeStub(channel).Generate(message, timeout=60))


def by_choice(messages: list[pb.GenerateResponse], n: int) -> tuple[list[list[int]], list[pb.GenerateResponse]]:
    tokens, finals = [[] for _ in range(n)], [None] * n
    for m in messages:
        tokens[m.choice].extend(m.token_ids)
        if m.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            assert finals[m.choice] is None
            finals[m.choice] = m
    assert all(finals)
    return tokens, finals


def test_greedy_samples_are_equal_and_share_one_prefill(served):
    prompt = list(range(200, 237))  # 37 tokens: 2 full blocks shared, 5 computed again by each fork
    greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    single = by_choice(generate(served, list(range(600, 637)), None, **greedy), 1)  # warms nothing of prompt
    assert len(single[0][0]) == 12
    before = computed_tokens(served)
    messages = generate(served, prompt, 3, **greedy)
    after = computed_tokens(served)
    tokens, finals = by_choice(messages, 3)
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 12
    assert {m.request_id for m in messages} == {messages[0].request_id}
    assert [f.usage.completion_tokens for f in finals] == [12, 12, 12]
    assert all(f.usage.prompt_tokens == len(prompt) for f in finals)
    tail = len(prompt) - (len(prompt) - 1) // BLOCK * BLOCK
    if served.layout == "disaggregated":
        assert after["prefill"] - before["prefill"] == len(prompt)  # one prefill of the prompt
        # the decode worker: each fork's prompt tail (for its first token), then each sample's 11 decodes
        assert after["decode"] - before["decode"] == 2 * tail + 3 * 11
    else:
        assert after["colocated"] - before["colocated"] == len(prompt) + 2 * tail + 3 * 11
    with Client(served.address) as client:
        assert client.generate(token_ids=prompt, **greedy).token_ids == tokens[0]
    assert_no_blocks_in_use(served)


def test_seeded_samples_equal_single_requests_with_seed_plus_index(served):
    prompt = list(range(300, 341))
    sampling = dict(max_tokens=10, temperature=1.0, seed=41, ignore_eos=True)
    tokens, _ = by_choice(generate(served, prompt, 3, **sampling), 3)
    with Client(served.address) as client:
        singles = [client.generate(token_ids=prompt, **{**sampling, "seed": 41 + i}).token_ids for i in range(3)]
    assert tokens == singles
    assert len({tuple(t) for t in tokens}) == 3
    assert_no_blocks_in_use(served)


def test_each_sample_carries_its_own_logprobs_and_the_prompts(served):
    prompt = list(range(320, 357))
    sampling = dict(max_tokens=8, temperature=1.0, seed=17, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    messages = generate(served, prompt, 3, **sampling)
    with Client(served.address) as client:
        singles = [client.generate(token_ids=prompt, **{**sampling, "seed": 17 + i}) for i in range(3)]
    for i, single in enumerate(singles):
        mine = [m for m in messages if m.choice == i]
        logprobs = [e for m in mine for e in m.logprobs]
        prompt_logprobs = [e for m in mine for e in m.prompt_logprobs]
        assert [t for m in mine for t in m.token_ids] == single.token_ids
        assert len(logprobs) == len(single.token_ids) and len(prompt_logprobs) == len(prompt) - 1
        assert mine[0].prompt_logprobs and not any(m.prompt_logprobs for m in mine[1:])  # the first message's
        for got, ref in zip([*prompt_logprobs, *logprobs], [*single.prompt_logprobs, *single.logprobs]):
            assert (got.token_id, got.rank) == (ref.token_id, ref.rank)
            assert got.logprob == pytest.approx(ref.logprob, abs=1e-4)
            assert [t.token_id for t in got.top] == [t.token_id for t in ref.top]
    assert_no_blocks_in_use(served)


def test_streams_interleave_choices(served):
    messages = generate(served, list(range(400, 430)), 3, max_tokens=20, temperature=0.0, ignore_eos=True)
    choices = [m.choice for m in messages]
    assert set(choices) == {0, 1, 2}
    last_of_0 = max(i for i, c in enumerate(choices) if c == 0)
    assert any(c != 0 for c in choices[:last_of_0])  # not one sample after the other
    assert_no_blocks_in_use(served)


def test_cancel_frees_every_samples_blocks(served):
    message = make_request(token_ids=list(range(500, 545)), max_tokens=1000, temperature=0.0, ignore_eos=True)
    message.n = 4
    with grpc.insecure_channel(served.address) as channel:
        call = pb_grpc.SplitServeStub(channel).Generate(message, timeout=60)
        seen = set()
        for m in call:
            seen.add(m.choice)
            if len(seen) == 4:
                break
        wait_for(lambda: sum(w.kv_blocks_in_use for w in workers(served)) > 0, 5, 0.05)
        call.cancel()
    assert_no_blocks_in_use(served)


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_refused_naming_it(served, n):
    with pytest.raises(grpc.RpcError) as e:
        generate(served, [1, 2, 3], n, max_tokens=4)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("n: must be 1 to 16")
    with Client(served.address) as client:
        assert len(client.generate(token_ids=[1, 2, 3], max_tokens=4, temperature=0.0).token_ids) == 4
    assert_no_blocks_in_use(served)


def test_a_stop_string_ends_each_sample_as_a_single_request(served):
    prompt = list(range(700, 733))
    sampling = dict(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    with Client(served.address) as client:
        text = client.generate(token_ids=prompt, **sampling).text
        stop = text[6:9]
        singles = [client.generate(token_ids=prompt, stop=[stop], **{**sampling, "seed": 3 + i}) for i in range(3)]
    assert singles[0].finish_reason == "stop"
    messages = generate(served, prompt, 3, stop=[stop], **sampling)
    _, finals = by_choice(messages, 3)
    texts = ["".join(m.text for m in messages if m.choice == i) for i in range(3)]
    assert texts == [s.text for s in singles]
    assert [f.finish_reason for f in finals] == [
        pb.FINISH_REASON_STOP if s.finish_reason == "stop" else pb.FINISH_REASON_LENGTH for s in singles
    ]
    assert_no_blocks_in_use(served)


def test_samples_handed_back_by_a_full_decode_worker_go_on_alone(ray_session, serving_model):
    """A decode worker with room for fewer than the 3 samples: some are handed back, re-prefilled with their
    output so far, and every sample still equals a single request with its seed."""
    tight = start_deployment(serving_model, decode={"num_blocks": 20, "threads": 1})
    try:
        prompt = list(range(1, 31))
        sampling = dict(max_tokens=150, temperature=1.0, seed=9, ignore_eos=True)
        tokens, finals = by_choice(generate(tight, prompt, 3, **sampling), 3)
        assert sum(f.timing.reprefills for f in finals) >= 1
        with Client(tight.address) as client:
            assert tokens == [
                client.generate(token_ids=prompt, **{**sampling, "seed": 9 + i}).token_ids for i in range(3)
            ]
        assert_no_blocks_in_use(tight)
    finally:
        tight.stop()
