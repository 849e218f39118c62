"""The router's one queue, prefill credit, and decode leases.

A request waits in a bounded FIFO until a prefill worker with credit can take it (the head of the
queue is placed first: no overtaking). It then holds that credit until its first token arrives.
Right after dispatch it leases blocks on a decode worker: no prefill starts without a lease, and the
lease is taken only now, so decode memory does not sit idle through the prefill queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import grpc

from splitserve.common.arith import ceil_div
from splitserve.common.errors import ServingError
from splitserve.router.config import RouterConfig
from splitserve.router.policy import choose_decode, choose_prefill, prefill_on_decode
from splitserve.router.workers import DecodeHandle, PrefillHandle, WorkerPool, read_call, start_call
from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc.status import from_status

log = logging.getLogger("splitserve.router")

# Every decode worker refused the lease (or none is in the pool): how long to wait before asking them all
# again, until the lease deadline. Short, since blocks free as requests finish; long enough that a full
# pool is not asked in a tight loop on the router's event loop.
LEASE_RETRY_S = 0.02


@dataclass(eq=False)
class Ticket:
    request_id: str
    num_tokens: int  # tokens to prefill (prompt + output so far)
    prompt_hashes: list[int]
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    queued_tokens: int = 0  # charged to the chosen prefill worker until the first token


class Dispatcher:
    def __init__(self, pool: WorkerPool, config: RouterConfig, block_size: int) -> None:
        self.pool, self.config, self.block_size = pool, config, block_size
        self.waiting: deque[Ticket] = deque()
        self._turn = 0
        self._watcher: asyncio.Task | None = None
        self.tokens_relayed = 0
        self.faults = config.faults.arm("router")  # the router's kill point (tests)

    def relayed(self, count: int) -> None:
        """Tokens go to clients; the router's kill point (tests) fires instead of token ``after + 1``."""
        self.tokens_relayed += count
        self.faults.tokens_relayed(self.tokens_relayed)

    def start(self) -> None:
        self._watcher = asyncio.create_task(self._watch())

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)

    async def _watch(self) -> None:
        while True:
            await self.pool.changed.wait()
            self.pool.changed.clear()
            self._place()

    # ---- prefill credit -------------------------------------------------------------------------

    async def dispatch(self, ticket: Ticket) -> PrefillHandle:
        """Wait in the queue for a prefill worker with room; raises ServingError when the queue is full."""
        if len(self.waiting) >= self.config.max_queue:
            raise ServingError("RESOURCE_EXHAUSTED", f"the router's queue is full ({self.config.max_queue} requests)")
        self.waiting.append(ticket)
        self._place()
        try:
            return await ticket.future
        except asyncio.CancelledError:
            if ticket in self.waiting:
                self.waiting.remove(ticket)
            elif ticket.future.done() and not ticket.future.cancelled():
                self.release(ticket.future.result(), ticket)
            raise

    def prefilled(self, worker: PrefillHandle, ticket: Ticket) -> None:
        """The request's first token arrived on a worker that keeps it (colocated): its prompt no
        longer counts as queued there, though it holds the credit until it ends."""
        worker.view.queued_tokens -= ticket.queued_tokens
        ticket.queued_tokens = 0

    def release(self, worker: PrefillHandle, ticket: Ticket) -> None:
        """The request's prefill ended (first token, or failure): give the credit back."""
        worker.view.credit += 1
        worker.view.inflight -= 1
        worker.view.queued_tokens -= ticket.queued_tokens
        ticket.queued_tokens = 0
        self._place()

    def _place(self) -> None:
        while self.waiting:
            ticket = self.waiting[0]
            views = [p.view for p in self.pool.prefill]
            view = choose_prefill(
                views,
                self.config.routing_policy,
                ticket.prompt_hashes,
                self.block_size,
                self.config.overlap_weight,
                self._turn,
            )
            if view is None:
                return
            self._turn += 1
            worker = self.pool.prefill[views.index(view)]
            cached = view.cached_prefix_blocks(ticket.prompt_hashes) * self.block_size
            ticket.queued_tokens = max(0, ticket.num_tokens - cached)
            view.credit -= 1
            view.inflight += 1
            view.queued_tokens += ticket.queued_tokens
            self.waiting.popleft()
            ticket.future.set_result(worker)

    def prefill_locally(self, ticket: Ticket, tokens_left: int) -> bool:
        """Conditional disaggregation: whether this request's decode worker prefills it instead
        (``policy.prefill_on_decode``, the rule the simulator calls too); ``tokens_left``: the tokens it may
        still generate."""
        return prefill_on_decode(
            self.config,
            [p.view for p in self.pool.prefill],
            ticket.prompt_hashes,
            self.block_size,
            num_tokens=ticket.num_tokens,
            tokens_left=tokens_left,
            waiting_tokens=sum(t.num_tokens for t in self.waiting),
            decode_workers=len(self.pool.decode),
        )

    # ---- decode leases --------------------------------------------------------------------------

    async def lease(self, request: wpb.DecodeRequest, num_tokens: int, deadline: float):
        """Open ``Decode`` on a decode worker with room; returns (worker, call, grant). Workers that
        refuse are skipped, then all are retried until ``deadline`` (monotonic), then UNAVAILABLE."""
        needed = ceil_div(num_tokens + 1, self.block_size)
        refused: set[str] = set()
        while True:
            view = choose_decode([d.view for d in self.pool.decode], needed, exclude=refused)
            if view is None:
                if time.monotonic() > deadline:
                    if not self.pool.decode:
                        raise ServingError(
                            "UNAVAILABLE",
                            "no decode worker is in the pool (lost or not started) within lease_timeout_s",
                        )
                    raise ServingError(
                        "UNAVAILABLE", f"no decode worker had room for {needed} KV blocks within lease_timeout_s"
                    )
                refused.clear()
                await asyncio.sleep(LEASE_RETRY_S)
                continue
            worker = next(d for d in self.pool.decode if d.view is view)
            # Counted from the moment it is asked, so that concurrent requests spread over the workers
            # instead of all choosing the same one while their leases are in flight.
            view.requests += 1
            view.free_blocks -= needed
            granted, reserved, call = False, True, None
            try:
                call = start_call(worker.stub.Decode, request, timeout=None)
                first = await asyncio.wait_for(read_call(call), self.config.worker_timeout_s)
                if first.WhichOneof("kind") == "lease":
                    view.free_blocks += needed - first.lease.blocks
                    granted = True
                    return worker, call, first.lease
                view.free_blocks, reserved = first.refused.free_blocks, False  # the worker's own count
                refused.add(view.worker_id)
            except (TimeoutError, grpc.aio.AioRpcError) as e:
                if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise from_status(e.code(), e.details()) from None
                view.healthy = False
                refused.add(view.worker_id)
            finally:
                if not granted:  # refused, failed, or this request was cancelled meanwhile
                    if call is not None:
                        call.cancel()
                    view.requests -= 1
                    view.free_blocks += needed if reserved else 0

    @staticmethod
    def lease_ended(worker: DecodeHandle) -> None:
        worker.view.requests = max(0, worker.view.requests - 1)
