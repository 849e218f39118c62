"""A worker chosen for a request can leave the pool (its channel closed) before it is called: the
call must fail as a lost worker, which the router retries elsewhere, not as grpc's UsageError, which
reached the client as UNKNOWN."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from splitserve.router.generate import WorkerLost, _start
from splitserve.router.workers import start_call
from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc import workers_pb2_grpc as wpb_grpc


async def _closed_stub() -> wpb_grpc.PrefillWorkerStub:
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # never dialled: the call is refused at once
    await channel.close()
    return wpb_grpc.PrefillWorkerStub(channel)


def test_a_call_on_a_closed_channel_fails_with_a_status():
    async def run():
        stub = await _closed_stub()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            start_call(stub.Prefill, wpb.PrefillRequest(request_id="r"))
        return e.value

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.CANCELLED
    assert "left the pool" in error.details()


def test_a_prefill_worker_that_left_the_pool_is_a_lost_worker():
    worker = SimpleNamespace(worker_id="prefill-0")

    async def run():
        stub = await _closed_stub()
        with pytest.raises(WorkerLost) as e:
            _start(stub.Prefill, wpb.PrefillRequest(request_id="r"), "prefill", worker)
        return e.value

    lost = asyncio.run(run())
    assert lost.role == "prefill" and lost.worker is worker
    assert "prefill-0" in lost.message and "CANCELLED" in lost.message
