"""Cancellation in every phase (queued, prefill, transfer, decode), the router's view of a prefill worker's cache, duplicate ids.

The deployment here is slowed on purpose by its config-gated fault points: every prefill step waits
1 s, the first KV transfer pauses for 3 s after its first layer, every decode step waits 20 ms. That
holds requests in each phase long enough to cancel them there, deterministically.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from splitserve.client import Client
from tests.serving.conftest import start_deployment, wait_for


@pytest.fixture(scope="module")
def slow(ray_session, serving_model):
    deployment = start_deployment(
        serving_model,
        engine={"num_blocks": 48},
        prefill={"threads": 1, "max_inflight": 1},  # one request at a time in prefill; see the credit test
        transfer={"whole_request_bytes": 0, "layer_group_size": 1},
        faults={"prefill_delay_s": 1.0, "decode_step_delay_s": 0.02,
                "transfer": [{"role": "sender", "action": "pause", "after_messages": 1, "seconds": 3.0}]},
    )  # fmt: skip
    yield deployment
    deployment.stop()


def blocks_in_use(deployment) -> list[int]:
    return [w.kv_blocks_in_use for w in Client(deployment.address).status().workers]


def assert_everything_freed(deployment) -> None:
    wait_for(lambda: blocks_in_use(deployment) == [0, 0], timeout_s=10)


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
    # The first token is back and the KV is mid-transfer (paused after its first layer): cancel now.
    messages = cancel_after(slow, lambda m: sum(len(x.token_ids) for x in m) >= 1, max_tokens=100)
    assert sum(len(m.token_ids) for m in messages) == 1  # decoding never started
    assert max(blocks_in_use(slow)) >= 0
    assert_everything_freed(slow)


def test_cancel_during_prefill(slow):
    from splitserve.client import make_request

    with Client(slow.address) as client:
        call = client.stub.Generate(make_request(token_ids=list(range(1, 60)), max_tokens=50, temperature=0.0))
        got = []
        reader = threading.Thread(target=lambda: got.extend(_drain(call)), daemon=True)
        reader.start()
        time.sleep(0.4)  # well inside the 1 s prefill
        assert not got
        call.cancel()
        reader.join(5)
    assert not any(m.token_ids for m in got)
    assert_everything_freed(slow)


def test_cancel_while_queued(slow):
    """max_inflight 1 and a 1 s prefill: the second request waits in the router's queue; cancelled
    there, it leaves the queue at once and never reaches a worker."""
    from splitserve.client import make_request

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


def _drain(call):
    try:
        yield from call
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.CANCELLED


def test_cancel_during_decode(slow):
    messages = cancel_after(slow, lambda m: sum(len(x.token_ids) for x in m) >= 6, max_tokens=400)
    assert sum(len(m.token_ids) for m in messages) >= 6
    assert messages[-1].finish_reason == 0  # not finished: cancelled mid-decode
    assert_everything_freed(slow)


def test_duplicate_inflight_request_id_is_refused(slow):
    with Client(slow.address) as client:
        first = threading.Thread(target=client.generate, kwargs={"token_ids": [7, 8, 9], "max_tokens": 3,
                                                                 "request_id": "dup-1"})  # fmt: skip
        first.start()
        time.sleep(0.3)
        with pytest.raises(grpc.RpcError) as e:
            client.generate(token_ids=[7, 8, 9], max_tokens=3, request_id="dup-1")
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "dup-1" in e.value.details()
        first.join(10)
        again = client.generate(token_ids=[7, 8, 9], max_tokens=3, request_id="dup-1")  # free again once done
        assert len(again.token_ids) == 3
    assert_everything_freed(slow)


def test_router_view_of_prefix_cache_converges_after_evictions(slow):
    from splitserve.rpc import workers_pb2 as wpb
    from splitserve.rpc import workers_pb2_grpc as wpb_grpc

    from concurrent.futures import ThreadPoolExecutor

    # 2 full blocks each, all distinct: 60 full blocks cannot all stay in the 48-block cache.
    prompts = [[100 + 41 * i + j for j in range(40)] for i in range(30)]
    with Client(slow.address) as client, ThreadPoolExecutor(30) as pool:
        assert all(r.token_ids for r in pool.map(lambda p: client.generate(token_ids=p, max_tokens=1), prompts))
    prefill = slow.router.pool.prefill[0]

    def router_view() -> set[int]:
        async def copy():
            return set(prefill.view.cached_hashes)

        return asyncio.run_coroutine_threadsafe(copy(), slow._loop).result(5)

    with grpc.insecure_channel(prefill.spec.address) as channel:
        snapshot = next(iter(wpb_grpc.PrefillWorkerStub(channel).CacheEvents(wpb.CacheEventsRequest(), timeout=10)))
    truth = set(snapshot.block_hashes)
    assert snapshot.kind == wpb.CacheEvent.SNAPSHOT
    assert 0 < len(truth) < 2 * len(prompts)  # 48 blocks cannot hold all 32 full blocks plus the rest: evictions
    wait_for(lambda: router_view() == truth, timeout_s=5)
    # A prompt sharing a cached prefix is routed as a hit.
    cached_prompt = next(p for p in reversed(prompts) if _hashes(p)[0] in truth)
    with Client(slow.address) as client:
        assert client.generate(token_ids=cached_prompt + [1], max_tokens=1).cached_tokens >= 16


def _hashes(tokens: list[int]) -> list[int]:
    from engine.block_hash import block_hashes

    return block_hashes(tokens, 16)


def test_client_deadline_cancels_the_request_everywhere(slow):
    with Client(slow.address) as client, pytest.raises(grpc.RpcError) as e:
        client.generate(token_ids=list(range(1, 60)), max_tokens=50, timeout_s=0.5)  # inside the 1 s prefill
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_everything_freed(slow)


def test_credit_comes_back_at_the_first_token_while_the_kv_still_moves(slow):
    """max_inflight 1: the second request is dispatched as soon as the first has its first token, while
    the first's KV is held mid-transfer (3 s pause) on the same prefill worker. The worker counts
    only requests before their first token against max_inflight, as the router does, so it takes it."""
    with Client(slow.address) as client, ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(client.generate, token_ids=[5 + i] * 20, max_tokens=3, temperature=0.0) for i in range(2)]
        results = [f.result(timeout=60) for f in futures]
    assert [len(r.token_ids) for r in results] == [3, 3]
    assert_everything_freed(slow)
