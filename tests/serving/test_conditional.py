"""Conditional disaggregation served end to end (router.local_prefill_max_tokens): a request whose uncached
prompt is short is prefilled on its decode worker, with no prefill worker and no KV transfer; a long one
takes the usual path; both equal the offline engine, and nothing is left held."""

from __future__ import annotations

import pytest

from splitserve.client.grpc_client import Client
from tests.serving.conftest import assert_logprobs_as_offline, start_deployment, wait_for
from tests.serving.test_serving import run_concurrently

SHORT, LONG = list(range(300, 312)), list(range(500, 580))  # 12 and 80 prompt tokens
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def conditional(ray_session, serving_model):
    deployment = start_deployment(serving_model, router={"local_prefill_max_tokens": 40})
    yield deployment
    deployment.stop()


def test_a_short_prompt_is_prefilled_on_its_decode_worker(conditional, serving_model):
    from splitserve.engine import LLM, SamplingParams

    offline = LLM(serving_model, dtype="float32", num_blocks=64)
    want = [o.token_ids for o in offline.generate([SHORT, LONG], SamplingParams(**GREEDY))]
    local = conditional.router.metrics.local_prefills
    before = local._value.get()
    short, long = run_concurrently(conditional.address, [SHORT, LONG], **GREEDY)
    assert [short.token_ids, long.token_ids] == want
    assert local._value.get() == before + 1, "one leg prefilled locally"
    assert short.timing["prefill_worker"] == short.timing["decode_worker"] == "decode-0"
    assert short.timing["transfer_ms"] == 0 and short.timing["first_token_ms"] > 0
    assert (long.timing["prefill_worker"], long.timing["decode_worker"]) == ("prefill-0", "decode-0")
    assert long.timing["transfer_ms"] > 0

    def at_rest():
        status = Client(conditional.address).status()
        return all(w.kv_blocks_in_use == 0 for w in status.workers) and status.running_requests == 0

    wait_for(at_rest, timeout_s=10)


def test_logprobs_of_a_prompt_prefilled_on_its_decode_worker(conditional, serving_model):
    local = conditional.router.metrics.local_prefills
    before = local._value.get()
    with Client(conditional.address) as client:
        done = client.generate(token_ids=SHORT, **GREEDY, logprobs=2, prompt_logprobs=2)
    assert local._value.get() == before + 1 and done.timing["prefill_worker"] == "decode-0"
    assert_logprobs_as_offline(serving_model, SHORT, done)


def test_a_cancelled_local_prefill_frees_its_lease(conditional):
    with Client(conditional.address) as client:
        stream = client.stream(token_ids=SHORT, **{**GREEDY, "max_tokens": 400})
        next(iter(stream))  # the first token: the request runs on the decode worker
        stream.close()
    wait_for(lambda: all(w.kv_blocks_in_use == 0 for w in Client(conditional.address).status().workers), 10)
