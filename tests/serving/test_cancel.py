"""Cancellation in every phase (queued, prefill, transfer, decode), the router's view of a prefill worker's cache,
duplicate ids.

The deployment here is slowed on purpose by its config-gated fault points: every prefill step waits
1 s, the KV transfer of every request whose id starts with ``hold-`` pauses for 3 s after its first
layer (per request, so each test that needs the pause gets it, in any order), every decode step waits
20 ms. That holds requests in each phase long enough to cancel them there; each test asserts, from the
workers' own status, which phase its request was in.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from splitserve.client.grpc_client import Client, make_request
from tests.serving.conftest import start_deployment, wait_for
from tests.threads import Background

HOLD_S = 3.0  # the pause of a ``hold-`` request's transfer
# The slowing above, as deployment settings (the vllm backend's cancel tests slow theirs the same way).
SLOWED = {
    "transfer": {"whole_request_bytes": 0, "layer_group_size": 1},
    "faults": {
        "prefill_delay_s": 1.0,
        "decode_step_delay_s": 0.02,
        "transfer": [
            {"role": "sender", "action": "pause", "after_messages": 1, "seconds": HOLD_S, "request_id_prefix": "hold-"}
        ],
    },
}


@pytest.fixture(scope="module")
def slow(ray_session, serving_model):
    deployment = start_deployment(
        serving_model,
        engine={"num_blocks": 48},
        prefill={"threads": 1, "max_inflight": 1},  # one request at a time in prefill; see the credit test
        **SLOWED,
    )
    yield deployment
    deployment.stop()


@pytest.fixture(autouse=True)
def idle(slow):
    """Each test starts on an idle deployment, whatever the one before it left running."""
    wait_for(lambda: not slow.router.inflight and blocks_in_use(slow) == [0, 0], timeout_s=15)


def blocks_in_use(deployment) -> list[int]:
    return [w.kv_blocks_in_use for w in Client(deployment.address).status().workers]


def assert_everything_freed(deployment) -> None:
    wait_for(lambda: blocks_in_use(deployment) == [0, 0], timeout_s=10)


def worker_status(deployment, role: str):
    """The worker's own status (not the router's last poll): ``running``/``waiting`` as it sees them.
    On a decode worker ``waiting`` counts leases whose KV has not landed yet."""
    from splitserve.rpc import workers_pb2 as wpb
    from splitserve.rpc import workers_pb2_grpc as wpb_grpc

    handle = getattr(deployment.router.pool, role)[0]
    stub = wpb_grpc.PrefillWorkerStub if role == "prefill" else wpb_grpc.DecodeWorkerStub
    with grpc.insecure_channel(handle.spec.address) as channel:
        return stub(channel).Status(wpb.StatusRequest(), timeout=5)


def tokens_in(messages) -> int:
    return sum(len(m.token_ids) for m in messages)


def drain_until_cancelled(call) -> tuple[list, grpc.StatusCode | None]:
    """Read a call to its end; returns the messages and the status code it ended with (None: OK)."""
    messages = []
    try:
        for message in call:
            messages.append(message)
    except grpc.RpcError as e:
        return messages, e.code()
    return messages, None


def cancel_after(deployment, predicate, **sampling):
    """Stream a request and cancel it once ``predicate(messages so far)`` holds; returns the messages."""
    messages = []
    with Client(deployment.address) as client:
        stream = client.stream(token_ids=list(range(1, 60)), ignore_eos=True, temperature=0.0, **sampling)
        for message in stream:
            messages.append(message)
            if predicate(messages):
                break
        stream.close()  # cancels the call
    return messages


def test_cancel_during_transfer(slow):
    # The first token is back and this request's KV is held mid-transfer (paused after its first
    # layer): cancel now, having read the decode worker's own view of the request.
    seen = {}

    def first_token_out(messages) -> bool:
        if tokens_in(messages) < 1:
            return False
        seen["decode"] = worker_status(slow, "decode")
        return True

    messages = cancel_after(slow, first_token_out, max_tokens=100, request_id="hold-cancel-during-transfer")
    assert tokens_in(messages) == 1  # decoding never started
    decode = seen["decode"]
    assert (decode.waiting, decode.running) == (1, 0), "the decode worker must still wait for the KV"
    assert decode.kv_blocks_in_use > 0, "the request's lease is held while its KV moves"
    assert_everything_freed(slow)


def test_cancel_during_prefill(slow):
    with Client(slow.address) as client:
        call = client.stub.Generate(
            make_request(token_ids=list(range(1, 60)), max_tokens=50, temperature=0.0), timeout=30
        )
        reader = Background(drain_until_cancelled, call)
        # Scheduled on the prefill worker, inside its 1 s step: no token can be out yet.
        wait_for(lambda: worker_status(slow, "prefill").running == 1, 5, 0.02)
        assert not reader.done()
        call.cancel()
        messages, code = reader.result(10)
    assert code == grpc.StatusCode.CANCELLED
    assert tokens_in(messages) == 0
    assert_everything_freed(slow)


def test_cancel_while_queued(slow):
    """max_inflight 1 and a 1 s prefill: the second request waits in the router's queue; cancelled
    there, it leaves the queue at once and never reaches a worker."""
    dispatcher = slow.router.dispatcher
    with Client(slow.address) as client, ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.generate, token_ids=list(range(200, 240)), max_tokens=3, temperature=0.0)
        wait_for(lambda: not dispatcher.waiting and slow.router.pool.prefill[0].view.inflight == 1, 5, 0.02)
        queued = client.stub.Generate(make_request(token_ids=list(range(300, 340)), max_tokens=50))
        wait_for(lambda: len(dispatcher.waiting) == 1, 5, 0.02)
        queued.cancel()
        wait_for(lambda: not dispatcher.waiting, 2, 0.02)
        assert not first.done(), "the first request is still in its prefill: the cancelled one was queued"
        assert len(first.result(timeout=30).token_ids) == 3
        with pytest.raises(grpc.RpcError) as e:
            list(queued)
        assert e.value.code() == grpc.StatusCode.CANCELLED
    assert_everything_freed(slow)


def test_cancel_during_decode(slow):
    seen = {}

    def decoding(messages) -> bool:
        if tokens_in(messages) < 6:
            return False
        seen["decode"] = worker_status(slow, "decode")
        return True

    messages = cancel_after(slow, decoding, max_tokens=400)
    assert tokens_in(messages) >= 6
    assert messages[-1].finish_reason == 0  # not finished: cancelled mid-decode
    assert (seen["decode"].running, seen["decode"].waiting) == (1, 0), "the request was in the decode batch"
    assert_everything_freed(slow)


def test_duplicate_inflight_request_id_is_refused(slow):
    with Client(slow.address) as client:
        first = Background(client.generate, token_ids=[7, 8, 9], max_tokens=3, request_id="dup-1")
        wait_for(lambda: "dup-1" in slow.router.inflight, 5, 0.02)  # in its 1 s prefill from here on
        with pytest.raises(grpc.RpcError) as e:
            client.generate(token_ids=[7, 8, 9], max_tokens=3, request_id="dup-1")
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "dup-1" in e.value.details()
        assert len(first.result(30).token_ids) == 3, "the first request is unharmed"
        again = client.generate(token_ids=[7, 8, 9], max_tokens=3, request_id="dup-1")  # free again once done
        assert len(again.token_ids) == 3
    assert_everything_freed(slow)


def test_router_view_of_prefix_cache_converges_after_evictions(slow):
    from splitserve.rpc import workers_pb2 as wpb
    from splitserve.rpc import workers_pb2_grpc as wpb_grpc

    # 7 full blocks each, all distinct: 56 full blocks cannot all stay in the 48-block cache. Each prompt is one
    # prefill step (1 s here, one at a time), so few long prompts rather than many short ones.
    prompts = [[100 + 131 * i + j for j in range(120)] for i in range(8)]
    with Client(slow.address) as client, ThreadPoolExecutor(len(prompts)) as pool:
        assert all(r.token_ids for r in pool.map(lambda p: client.generate(token_ids=p, max_tokens=1), prompts))
    prefill = slow.router.pool.prefill[0]

    def router_view() -> set[int]:
        async def copy():
            return set(prefill.view.cached_hashes)

        return asyncio.run_coroutine_threadsafe(copy(), slow.router_host.loop).result(5)

    with grpc.insecure_channel(prefill.spec.address) as channel:
        snapshot = next(iter(wpb_grpc.PrefillWorkerStub(channel).CacheEvents(wpb.CacheEventsRequest(), timeout=10)))
    truth = set(snapshot.block_hashes)
    assert snapshot.kind == wpb.CacheEvent.SNAPSHOT
    assert 0 < len(truth) < 7 * len(prompts)  # 48 blocks cannot hold all 56 full blocks: evictions
    wait_for(lambda: router_view() == truth, timeout_s=5)
    # A prompt sharing a cached prefix is routed as a hit.
    cached_prompt = next(p for p in reversed(prompts) if _hashes(p)[0] in truth)
    with Client(slow.address) as client:
        assert client.generate(token_ids=cached_prompt + [1], max_tokens=1).cached_tokens >= 16


def _hashes(tokens: list[int]) -> list[int]:
    from splitserve.engine.kv_cache.block_hash import block_hashes

    return block_hashes(tokens, 16)


def test_client_deadline_cancels_the_request_everywhere(slow):
    with Client(slow.address) as client, pytest.raises(grpc.RpcError) as e:
        client.generate(token_ids=list(range(1, 60)), max_tokens=50, timeout_s=0.5)  # inside the 1 s prefill
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_everything_freed(slow)


def test_credit_comes_back_at_the_first_token_while_the_kv_still_moves(slow):
    """max_inflight 1: the second request is dispatched as soon as the first has its first token, while
    the first's KV is held mid-transfer (3 s pause) on the same prefill worker. The worker counts
    only requests before their first token against max_inflight, as the router does, so it takes it:
    the second has its first token (1 s of prefill) while the first is still waiting for its KV."""
    with Client(slow.address) as client:
        held = Background(client.generate, token_ids=[5] * 20, max_tokens=3, temperature=0.0, request_id="hold-credit")
        wait_for(lambda: slow.router.pool.prefill[0].view.inflight == 1, 5, 0.02)  # the first holds the credit
        stream = client.stream(token_ids=[6] * 20, max_tokens=3, temperature=0.0, timeout_s=60)
        messages = [next(stream)]
        while not messages[-1].token_ids:
            messages.append(next(stream))
        assert not held.done(), "the second request's first token came only after the first request ended"
        messages.extend(stream)
        first = held.result(60)
    assert len(first.token_ids) == 3 and tokens_in(messages) == 3
    assert first.timing["transfer_ms"] >= HOLD_S * 1e3 * 2 / 3, "the first request's transfer was held"
    assert_everything_freed(slow)
