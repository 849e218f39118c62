"""The router's view of its workers: channels, status polls, prefix-cache events, credit and leases.

Everything here runs on the router's event loop; nothing blocks it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from splitserve.router.policy import DecodeView, PrefillView
from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc import workers_pb2_grpc as wpb_grpc
from splitserve.rpc.options import CLIENT_OPTIONS
from splitserve.rpc.security import InternalSecurity
from splitserve.v1 import splitserve_pb2 as pb

log = logging.getLogger("splitserve.router")

REGISTER_POLL_S = 0.05  # how often wait_for looks at the pool while workers register (start-up, scaling)


def _left_the_pool() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), "the worker left the pool"
    )


def start_call(method, request, **kwargs):
    """``method(request, **kwargs)`` on a worker's stub. A worker can leave the pool (its channel is
    closed) between being chosen and being called; that call then fails like one the closing channel
    cancelled (an AioRpcError), not with grpc's UsageError, which nothing would handle."""
    try:
        return method(request, **kwargs)
    except grpc.aio.UsageError:
        raise _left_the_pool() from None


async def read_call(call):
    """``call.read()``, settled like ``settle``."""
    return await settle(call.read())


async def settle(awaitable):
    """Await a gRPC call; one cancelled under us (its worker left the pool, so its channel closed)
    fails like any transport error instead of looking like our own task's cancellation."""
    try:
        return await awaitable
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise _left_the_pool() from None


@dataclass(frozen=True)
class WorkerAddress:
    role: str  # "prefill" | "decode" | "colocated"
    address: str  # host:port of its gRPC server
    node: str = ""


@dataclass(eq=False)
class WorkerHandle:
    spec: WorkerAddress
    channel: grpc.aio.Channel
    stub: object
    status: pb.WorkerStatus = field(default_factory=pb.WorkerStatus)
    healthy: bool = False
    draining: bool = False
    commands: asyncio.Queue | None = None  # to a registered worker, down its registration call

    @property
    def worker_id(self) -> str:
        return self.status.worker_id or self.spec.address


@dataclass(eq=False)
class PrefillHandle(WorkerHandle):
    view: PrefillView = field(default_factory=lambda: PrefillView("", 0))


@dataclass(eq=False)
class DecodeHandle(WorkerHandle):
    view: DecodeView = field(default_factory=lambda: DecodeView("", 0, 0))


class WorkerPool:
    """Workers come from a static list (started with the router) or register themselves; a
    registered worker stays in the pool exactly as long as its registration call is open."""

    def __init__(
        self, credit: int, status_interval_s: float, timeout_s: float, security: InternalSecurity | None = None
    ) -> None:
        self.prefill: list[PrefillHandle] = []
        self.decode: list[DecodeHandle] = []
        self.credit, self.interval, self.timeout = credit, status_interval_s, timeout_s
        self.security = security or InternalSecurity()
        self._poller: asyncio.Task | None = None
        self._followers: dict[int, asyncio.Task] = {}
        self.changed = asyncio.Event()  # set when credit or room may have appeared

    async def start(self, static: list[WorkerAddress]) -> None:
        """Add the static workers (each must answer a first poll), then keep polling everyone."""
        handles = [self.add(spec) for spec in static]
        await asyncio.gather(*(self._poll(w, must_answer=True) for w in handles))
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        tasks = [t for t in [self._poller, *self._followers.values()] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(w.channel.close() for w in self.workers), return_exceptions=True)

    @property
    def workers(self) -> list[WorkerHandle]:
        return [*self.prefill, *self.decode]

    def add(self, spec: WorkerAddress, credit: int | None = None) -> WorkerHandle:
        channel = self.security.channel(spec.address, CLIENT_OPTIONS, aio=True)
        if spec.role in ("prefill", "colocated"):  # a colocated worker is queued and credited like one
            handle = PrefillHandle(spec, channel, wpb_grpc.PrefillWorkerStub(channel))
            handle.view = PrefillView(spec.address, credit or self.credit)
            self.prefill.append(handle)
            self._followers[id(handle)] = asyncio.create_task(self._follow_cache(handle))
        else:
            handle = DecodeHandle(spec, channel, wpb_grpc.DecodeWorkerStub(channel))
            handle.view = DecodeView(spec.address, 0, 0)
            self.decode.append(handle)
        return handle

    async def register(self, info: wpb.WorkerInfo) -> WorkerHandle:
        """A worker announced itself: replace any earlier incarnation of it, poll it, route to it."""
        for old in [w for w in self.workers if w.status.worker_id == info.worker_id]:
            await self.remove(old)
        handle = self.add(WorkerAddress(info.role, info.address, info.node), credit=info.max_inflight or None)
        handle.commands = asyncio.Queue()
        await self._poll(handle)
        log.info(
            "%s worker %s joined (%s, incarnation %s)", info.role, info.worker_id, info.address, info.incarnation[:8]
        )
        return handle

    async def remove(self, handle: WorkerHandle) -> None:
        """Take a worker out of the pool (its registration ended, or it was replaced)."""
        group = self.prefill if isinstance(handle, PrefillHandle) else self.decode
        if handle not in group:
            return
        group.remove(handle)
        handle.healthy = handle.view.healthy = False
        follower = self._followers.pop(id(handle), None)
        if follower is not None:
            follower.cancel()
        await handle.channel.close()
        log.warning("%s worker %s left the pool", handle.spec.role, handle.worker_id)
        self.changed.set()

    async def drain(self, handle: WorkerHandle) -> None:
        """Route nothing new to it and ask it to finish or hand back what it holds."""
        handle.draining = True
        handle.view.healthy = False
        if handle.commands is not None:
            await handle.commands.put(wpb.RegistryCommand(kind=wpb.RegistryCommand.DRAIN))

    async def wait_for(self, prefill: int, decode: int, timeout_s: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while sum(w.healthy for w in self.prefill) < prefill or sum(w.healthy for w in self.decode) < decode:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{prefill} prefill and {decode} decode workers did not register in {timeout_s}s")
            await asyncio.sleep(REGISTER_POLL_S)

    def lost(self, handle: WorkerHandle) -> None:
        """A call to this worker failed at the transport: route around it until a poll succeeds."""
        handle.healthy = handle.view.healthy = False

    # ---- status --------------------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            results = await asyncio.gather(*(self._poll(w) for w in self.workers), return_exceptions=True)
            for error in (r for r in results if isinstance(r, Exception)):
                log.error("status poll failed: %r", error)  # never ends the poller

    async def _poll(self, worker: WorkerHandle, must_answer: bool = False) -> None:
        try:
            status = await settle(worker.stub.Status(wpb.StatusRequest(), timeout=self.timeout))
        except grpc.aio.AioRpcError as e:
            if must_answer:
                raise RuntimeError(
                    f"{worker.spec.role} worker at {worker.spec.address} did not answer: {e.details()}"
                ) from None
            if worker.healthy:
                log.warning("%s worker %s stopped answering: %s", worker.spec.role, worker.worker_id, e.code().name)
            self.lost(worker)
            return
        worker.status, worker.healthy = status, not worker.draining
        worker.view.healthy = worker.healthy
        worker.view.worker_id = status.worker_id
        if isinstance(worker, DecodeHandle):
            worker.view.free_blocks = status.kv_blocks_total - status.kv_blocks_in_use
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
