"""Overload: every queue is bounded and past it a request is refused at once with RESOURCE_EXHAUSTED,
never left hanging; a burst far above capacity leaves the server healthy, with no block held."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from splitserve.client.grpc_client import Client, make_request
from splitserve.rpc.options import CLIENT_OPTIONS
from splitserve.v1 import splitserve_pb2_grpc as pb_grpc
from tests.serving.conftest import start_deployment, wait_for

MAX_QUEUE = 8
DECODE_MAX_INFLIGHT = 4


@pytest.fixture(scope="module")
def small(ray_session, serving_model):
    deployment = start_deployment(
        serving_model,
        router={"max_queue": MAX_QUEUE},
        prefill={"threads": 1, "max_inflight": 2},
        decode={"threads": 1, "max_inflight": DECODE_MAX_INFLIGHT},
    )
    yield deployment
    deployment.stop()


def blocks_in_use(deployment) -> list[int]:
    return [w.kv_blocks_in_use for w in Client(deployment.address).status().workers]


async def burst(address: str, count: int) -> list[dict]:
    """``count`` requests sent at once on one channel; each one's status, tokens and seconds to end."""
    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        stub = pb_grpc.SplitServeStub(channel)

        async def one(i: int) -> dict:
            sent, tokens, code, details = time.monotonic(), 0, grpc.StatusCode.OK, ""
            try:
                request = make_request(
                    token_ids=[(7 * i + j) % 1000 + 1 for j in range(30)],
                    max_tokens=8,
                    ignore_eos=True,
                    temperature=0.0,
                )
                async for message in stub.Generate(request, timeout=120):
                    tokens += len(message.token_ids)
            except grpc.aio.AioRpcError as e:
                code, details = e.code(), e.details()
            return {"code": code, "details": details, "tokens": tokens, "seconds": time.monotonic() - sent}

        return await asyncio.gather(*(one(i) for i in range(count)))


def test_a_burst_far_above_capacity_is_refused_quickly_and_leaves_the_server_healthy(small):
    results = asyncio.run(burst(small.address, 200))
    refused = [r for r in results if r["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    served = [r for r in results if r["code"] == grpc.StatusCode.OK]
    assert len(refused) + len(served) == len(results), {r["code"] for r in results}
    assert len(refused) >= 50, "200 at once into a queue of 8 must refuse many"
    assert len(served) >= MAX_QUEUE
    assert all(r["tokens"] == 8 for r in served)
    assert all("queue is full" in r["details"] for r in refused)
    # Refused at once, not after waiting: well under a second each, even on a loaded 2-core machine.
    assert max(r["seconds"] for r in refused) < 3.0, sorted(r["seconds"] for r in refused)[-5:]
    # Healthy afterwards: the queue is empty, nothing is held, a new request is served.
    wait_for(lambda: blocks_in_use(small) == [0, 0], 15)
    with Client(small.address) as client:
        assert len(client.generate(token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True).token_ids) == 4
        assert all(w.healthy for w in client.status().workers)
    assert not small.router.dispatcher.waiting


def test_a_decode_worker_refuses_leases_past_its_max_inflight(small):
    """Raw leases on the decode worker: it grants max_inflight, refuses the next one by name, and frees
    every lease when its call ends."""
    from splitserve.engine.sampling.params import SamplingParams
    from splitserve.engine.wire import sampling_to_pb
    from splitserve.rpc import workers_pb2 as wpb
    from splitserve.rpc import workers_pb2_grpc as wpb_grpc

    decode = next(w for w in small.workers if w["role"] == "decode")
    sampling = sampling_to_pb(SamplingParams(max_tokens=4, seed=1))
    with grpc.insecure_channel(decode["address"]) as channel:
        stub = wpb_grpc.DecodeWorkerStub(channel)
        calls = [
            stub.Decode(
                wpb.DecodeRequest(request_id=f"lease-{i}", prompt_token_ids=[1, 2, 3], sampling=sampling), timeout=30
            )
            for i in range(DECODE_MAX_INFLIGHT + 1)
        ]
        try:
            firsts = [next(call) for call in calls]
            kinds = sorted(f.WhichOneof("kind") for f in firsts)  # the calls race: any one may be the refused
            assert kinds == ["lease"] * DECODE_MAX_INFLIGHT + ["refused"], kinds
            refused = next(f.refused for f in firsts if f.WhichOneof("kind") == "refused")
            assert "at capacity" in refused.reason and "max_inflight" in refused.reason
            wait_for(lambda: max(blocks_in_use(small)) >= DECODE_MAX_INFLIGHT, 5)  # the router polls status
        finally:
            for call in calls:
                call.cancel()
    wait_for(lambda: blocks_in_use(small) == [0, 0], 15)
