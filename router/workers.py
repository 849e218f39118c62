"""The router's view of its workers: channels, status polls, prefix-cache events, credit and leases.

Everything here runs on the router's event loop; nothing blocks it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from splitserve.rpc.options import CLIENT_OPTIONS
from router.policy import DecodeView, PrefillView
from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc import workers_pb2_grpc as wpb_grpc
from splitserve.v1 import splitserve_pb2 as pb

log = logging.getLogger("splitserve.router")


@dataclass(frozen=True)
class WorkerAddress:
    role: str  # "prefill" | "decode"
    address: str  # host:port of its gRPC server
    node: str = ""


@dataclass(eq=False)
class WorkerHandle:
    spec: WorkerAddress
    channel: grpc.aio.Channel
    stub: object
    status: pb.WorkerStatus = field(default_factory=pb.WorkerStatus)
    healthy: bool = False

    @property
    def worker_id(self) -> str:
        return self.status.worker_id or self.spec.address


@dataclass(eq=False)
class PrefillHandle(WorkerHandle):
    view: PrefillView = field(default_factory=lambda: PrefillView("", 0))


@dataclass(eq=False)
class DecodeHandle(WorkerHandle):
    leases: int = 0  # granted by this router, KV not landed yet
    view: DecodeView = field(default_factory=lambda: DecodeView("", 0, 0))


class WorkerPool:
    def __init__(self, addresses: list[WorkerAddress], credit: int, status_interval_s: float, timeout_s: float) -> None:
        self.prefill: list[PrefillHandle] = []
        self.decode: list[DecodeHandle] = []
        self.credit, self.interval, self.timeout = credit, status_interval_s, timeout_s
        for spec in addresses:
            channel = grpc.aio.insecure_channel(spec.address, options=CLIENT_OPTIONS)
            if spec.role == "prefill":
                handle = PrefillHandle(spec, channel, wpb_grpc.PrefillWorkerStub(channel))
                handle.view = PrefillView(spec.address, credit)
                self.prefill.append(handle)
            else:
                handle = DecodeHandle(spec, channel, wpb_grpc.DecodeWorkerStub(channel))
                handle.view = DecodeView(spec.address, 0, 0)
                self.decode.append(handle)
        self._tasks: list[asyncio.Task] = []
        self.changed = asyncio.Event()  # set when credit or room may have appeared

    async def start(self) -> None:
        """Poll every worker once (all must answer), then keep polling and follow prefix caches."""
        await asyncio.gather(*(self._poll(w, must_answer=True) for w in self.prefill + self.decode))
        self._tasks = [asyncio.create_task(self._poll_forever())]
        self._tasks += [asyncio.create_task(self._follow_cache(p)) for p in self.prefill]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.channel.close() for w in self.prefill + self.decode), return_exceptions=True)

    @property
    def workers(self) -> list[WorkerHandle]:
        return [*self.prefill, *self.decode]

    # ---- status --------------------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await asyncio.gather(*(self._poll(w) for w in self.workers))

    async def _poll(self, worker: WorkerHandle, must_answer: bool = False) -> None:
        try:
            status = await worker.stub.Status(wpb.StatusRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            if must_answer:
                raise RuntimeError(f"{worker.spec.role} worker at {worker.spec.address} did not answer: {e.details()}") from None
            if worker.healthy:
                log.warning("%s worker %s stopped answering: %s", worker.spec.role, worker.worker_id, e.code().name)
            worker.healthy = False
            worker.view.healthy = False
            return
        worker.status, worker.healthy = status, True
        worker.view.healthy = True
        worker.view.worker_id = status.worker_id
        if isinstance(worker, DecodeHandle):
            # The worker's own figure, less the leases it granted since (they are in its count next poll).
            worker.view.free_blocks = status.kv_blocks_total - status.kv_blocks_in_use
            worker.view.requests = status.running + status.waiting
        self.changed.set()

    # ---- prefix caches -------------------------------------------------------------------------

    async def _follow_cache(self, worker: PrefillHandle) -> None:
        """Mirror a prefill worker's prefix cache from its event stream, reconnecting when it breaks."""
        while True:
            try:
                async for event in worker.stub.CacheEvents(wpb.CacheEventsRequest()):
                    hashes = worker.view.cached_hashes
                    if event.kind == wpb.CacheEvent.SNAPSHOT:
                        hashes.clear()
                        hashes.update(event.block_hashes)
                    elif event.kind == wpb.CacheEvent.STORED:
                        hashes.update(event.block_hashes)
                    elif event.kind == wpb.CacheEvent.REMOVED:
                        hashes.difference_update(event.block_hashes)
            except grpc.aio.AioRpcError:
                pass
            worker.view.cached_hashes.clear()  # unknown until the next snapshot
            await asyncio.sleep(self.interval)
