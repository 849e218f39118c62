"""The keepalive options every splitserve link uses notice a peer that stopped answering (a lost
node sends no reset) within seconds, on an open stream."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.rpc.options import CLIENT_OPTIONS, SERVER_OPTIONS

SERVER = f"""
import asyncio, grpc
from grpc_health.v1 import health, health_pb2_grpc
async def main():
    server = grpc.aio.server(options={SERVER_OPTIONS!r})
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
asyncio.run(main())
"""


async def _time_to_notice_stopped_peer(options) -> float:
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            await call.read()  # the stream is open and answered
            os.kill(proc.pid, signal.SIGSTOP)  # alive, connected, silent
            stopped = time.monotonic()
            try:
                await asyncio.wait_for(call.read(), 30)
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                return time.monotonic() - stopped
            raise AssertionError("the stream answered while its server was stopped")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def test_a_stopped_peer_is_noticed_within_seconds():
    assert asyncio.run(_time_to_notice_stopped_peer(CLIENT_OPTIONS)) < 8
