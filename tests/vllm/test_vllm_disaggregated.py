"""Disaggregated serving on the vllm backend: a vLLM prefill worker and a vLLM decode worker, the KV moved
between vLLM's paged caches by splitserve's KV sender and receiver through splitserve's KV connector
(kv_transfer/vllm_connector.py). The same checks as the splitserve engine's: output equal to vLLM's own offline
engine and to transformers, cancel at every phase (the workers' own status shows the phase), bad input refused by
the router before any engine sees it, nothing left holding a block, and each fault drill (a worker killed
mid-prefill, mid-transfer on either side, mid-decode) retried or migrated exactly with the worker back.

One slowed deployment for the module, as tests/serving/test_cancel.py's: every prefill step waits 1 s, a
``hold-`` request's transfer pauses 3 s after its first layer, decode steps wait 20 ms."""

from __future__ import annotations

import grpc
import pytest

from splitserve.client.grpc_client import Client, make_request
from splitserve.engine.kv_cache.block_hash import block_hashes
from tests.harness.drill import DRILLS, reference_outputs, run_drill
from tests.serving.conftest import start_deployment, wait_for
from tests.serving.streams import stream_all
from tests.serving.test_cancel import (
    SLOWED,
    assert_everything_freed,
    blocks_in_use,
    cancel_after,
    drain_until_cancelled,
    tokens_in,
    worker_status,
)
from tests.serving.test_faults import assert_drill
from tests.threads import Background
from tests.vllm.conftest import GREEDY, PROMPTS, router_view, run_in_own_process

MAX_PAUSE_S = 10.0  # the splitserve engine's drills hold 5 s; a restarted vLLM worker takes longer to start
MAX_BACK_S = 60.0


@pytest.fixture(scope="module")
def pd(ray_session, serving_model):
    deployment = start_deployment(
        serving_model,
        engine={"backend": "vllm", "kv_cache_bytes": 64 << 20},
        **SLOWED,
    )
    yield deployment
    deployment.stop()


@pytest.fixture(autouse=True)
def idle(pd):
    wait_for(lambda: not pd.router.inflight and blocks_in_use(pd) == [0, 0], timeout_s=15)


def test_greedy_1p1d_equals_vllm_offline_and_transformers(pd, vllm_offline, transformers_greedy):
    roles = sorted(w.role for w in Client(pd.address).status().workers)
    assert roles == ["decode", "prefill"]
    results = [f.result(timeout=120) for f in stream_all(pd.address, PROMPTS, GREEDY)]
    served = [r[0] for r in results]
    assert served == vllm_offline
    assert served == transformers_greedy
    with Client(pd.address) as client:
        done = client.generate(token_ids=PROMPTS[0], **GREEDY)
    assert done.token_ids == vllm_offline[0]
    assert done.timing["prefill_worker"] != done.timing["decode_worker"]  # two workers, the KV moved
    assert_everything_freed(pd)
    # The prefill worker's prefix cache reaches the router: PROMPTS[4]'s first vLLM block (128 tokens), as hashes.
    (prefill,) = pd.router.pool.prefill
    first_block = set(block_hashes(PROMPTS[4], pd.router.config.block_size)[: 128 // pd.router.config.block_size])
    wait_for(lambda: first_block <= router_view(pd)[prefill.view.worker_id], 10)


def test_logprobs_across_the_hand_off_equal_the_splitserve_engines(pd, serving_model):
    """The prompt's and the first token's from the vLLM prefill worker, the rest from the vLLM decode worker."""
    from splitserve.engine import LLM, SamplingParams

    prompt = PROMPTS[2]
    ours = LLM(serving_model, dtype="float32", num_blocks=64).generate(
        [prompt], SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, prompt_logprobs=1)
    )[0]
    with Client(pd.address) as client:
        served = client.generate(token_ids=prompt, max_tokens=5, temperature=0.0, logprobs=2, prompt_logprobs=1)
    assert served.token_ids == ours.token_ids
    pairs = [
        *zip(served.logprobs, ours.logprobs, strict=True),
        *zip(served.prompt_logprobs, ours.prompt_logprobs[1:], strict=True),
    ]
    for got, want in pairs:
        assert (got.token_id, got.rank) == (want.token_id, want.rank) and abs(got.logprob - want.logprob) < 1e-4
        assert [t.token_id for t in got.top] == [t for t, _ in want.top]
    assert_everything_freed(pd)


def test_cancel_during_prefill(pd):
    with Client(pd.address) as client:
        call = client.stub.Generate(
            make_request(token_ids=list(range(1, 60)), max_tokens=50, temperature=0.0), timeout=30
        )
        reader = Background(drain_until_cancelled, call)
        wait_for(lambda: worker_status(pd, "prefill").running == 1, 5, 0.02)  # inside its 1 s step
        assert not reader.done()
        call.cancel()
        messages, code = reader.result(10)
    assert code == grpc.StatusCode.CANCELLED and tokens_in(messages) == 0
    assert_everything_freed(pd)


def test_cancel_during_transfer_frees_both_sides(pd):
    seen = {}

    def first_token_out(messages) -> bool:
        if tokens_in(messages) < 1:
            return False
        seen["decode"], seen["prefill"] = worker_status(pd, "decode"), worker_status(pd, "prefill")
        return True

    messages = cancel_after(pd, first_token_out, max_tokens=100, request_id="hold-vllm-cancel-transfer")
    assert tokens_in(messages) == 1  # decoding never started
    assert (seen["decode"].waiting, seen["decode"].running) == (1, 0), "the decode worker still waits for the KV"
    assert seen["decode"].kv_blocks_in_use > 0, "vLLM's scheduler holds the lease's blocks"
    assert seen["prefill"].kv_blocks_in_use > 0, "the prefill worker holds the blocks its sender reads"
    assert_everything_freed(pd)


def test_cancel_during_decode(pd):
    seen = {}

    def decoding(messages) -> bool:
        if tokens_in(messages) < 6:
            return False
        seen["decode"] = worker_status(pd, "decode")
        return True

    messages = cancel_after(pd, decoding, max_tokens=400)
    assert tokens_in(messages) >= 6 and messages[-1].finish_reason == 0
    assert (seen["decode"].running, seen["decode"].waiting) == (1, 0)
    assert_everything_freed(pd)


def test_bad_input_is_refused_before_any_engine(pd):
    with Client(pd.address) as client:
        for fields, name in (
            (dict(token_ids=[1, 2, 10**9], max_tokens=4), "token_ids"),
            (dict(token_ids=[1, 2, 3], max_tokens=4, top_p=2.0), "top_p"),
            (dict(token_ids=[1, 2, 3], max_tokens=0), "max_tokens"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                client.generate(**fields)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in err.value.details()
        samples = make_request(token_ids=[1, 2, 3], max_tokens=4)
        samples.n = 2  # a vLLM decode worker cannot fork samples: its lease refuses them
        with pytest.raises(grpc.RpcError) as err:
            list(client.stub.Generate(samples, timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n:" in err.value.details()
        assert len(client.generate(token_ids=PROMPTS[2], max_tokens=5, temperature=0.0).token_ids) == 5
    assert worker_status(pd, "prefill").running == 0
    assert_everything_freed(pd)


@pytest.fixture(scope="module")
def drill_reference(serving_model):
    return reference_outputs(serving_model)  # greedy: vLLM's equals it (the first test)


@pytest.mark.parametrize("drill", list(DRILLS))
def test_a_vllm_worker_killed_at_its_fault_point(ray_session, serving_model, drill_reference, drill):
    assert_drill(run_drill(serving_model, drill, backend="vllm"), drill, drill_reference, MAX_PAUSE_S, MAX_BACK_S)


def test_a_vllm_prefill_streams_each_layer_as_the_forward_writes_it(serving_model):
    """The connector's ``save_kv_layer`` hands the KV sender each layer while the forward goes on: every
    ``on_layer_done(n)`` of the prompt's step comes when vLLM has reported n layers saved (not after the step,
    when the engine would report the layers it did not see)."""
    probe = run_in_own_process("tests.vllm.layer_stream_probe", str(serving_model))
    layers = probe["layers"]
    assert probe["tokens"] == 1  # the prefill's first token, then the hand-off
    assert probe["calls"] == [[n, n] for n in range(1, layers + 1)]
