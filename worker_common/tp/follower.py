"""A rank other than 0 of a tensor-parallel worker (a follower): its shard of the model and of the KV cache,
the KV transfers of its heads, and nothing else (no scheduler, no block manager, no requests).

Threads::

    loop thread:   plan channel ─▶ Tick (answered) | Notice: start sends | StepPlan: forward | Stop
    gRPC threads:  TensorParallelRank (Expect, Release, Events) from rank 0; KVTransfer (a decode rank)
                   from the prefill ranks that send it heads

A part (one transfer of the hand-off, ``splitserve.kv_transfer.tp.parts``) lives here until it ends: its end is
queued for rank 0's ``Events`` stream and the endpoint forgets it. A ``Release`` for a part that has not
started yet (rank 0 cancelled before this rank read the notice) is remembered, and the part ends at once
as it would start.

Any failure of the group (a collective that fails or misses its deadline, a malformed message) ends the
process: the worker fails as a whole, and rank 0's actor, restarted by Ray, starts new followers.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures

import grpc

from splitserve.common.errors import ServingError
from splitserve.engine.core import EngineCore
from splitserve.engine.threads import serial_torch
from splitserve.engine.tp.distributed import TPGroup
from splitserve.engine.tp.step import Foreign, Notice, PlanChannel, StepPlan, Stop, Tick
from splitserve.kv_transfer.handles import TransferHandle, TransferState
from splitserve.kv_transfer.receiver import KVReceiver
from splitserve.kv_transfer.sender import KVSender, SendHandle
from splitserve.kv_transfer.service import GrpcConnection, KVTransferServicer
from splitserve.kv_transfer.tp.parts import rank_transfer_id, sends_for
from splitserve.rpc import kv_transfer_pb2_grpc
from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc import workers_pb2_grpc as wpb_grpc
from splitserve.rpc.auth import server_interceptors
from splitserve.rpc.options import SERVER_OPTIONS
from splitserve.rpc.status import abort
from splitserve.worker_common.affinity import pin
from splitserve.worker_common.config import WorkerConfig
from splitserve.worker_common.layout import layout_fingerprint
from splitserve.worker_common.local_engine import model_facts
from splitserve.worker_common.model_thread import ModelThread
from splitserve.worker_common.tp import rank_notices
from splitserve.worker_common.tp.rank_link import GROUP_FAILED_EXIT, RankInfo

log = logging.getLogger("splitserve.worker")

TOMBSTONE_S = 120.0  # how long a release of a part not started yet is remembered
# Handler threads beyond the KV pairs' streams: rank 0's one Events stream and its Expect and Release
# calls, which return at once. 16 leaves room to spare.
SPARE_RPC_THREADS = 16
# How often an Events stream with nothing to report checks that rank 0's call is still open: a stream
# left by a gone rank 0 frees its thread within this.
EVENTS_POLL_S = 0.5
STOP_GRACE_S = 0.5  # the gRPC server's grace at stop, for the calls in flight to end by themselves


class Follower:
    def __init__(
        self,
        config: WorkerConfig,
        group: TPGroup,
        group_id: str,
        exit: Callable[[int], object] = os._exit,
        rendezvous: tuple[str, int] | None = None,
    ) -> None:
        """``exit``: ends the process when the group fails (tests may pass another). ``rendezvous``: (host, port)
        of the store the group formed on, where a vllm-backend rank's vLLM engine meets the others'."""
        if config.cpus is not None:
            pin(config.cpus)
        self.config, self.group, self.group_id, self.rank = config, group, group_id, group.rank
        self.core: EngineCore | None = None
        self.vllm = None  # the vllm backend's rank (worker_common.vllm_engine.VllmRank)
        # One thread builds this rank's engine and then runs its loop (worker_common.model_thread says why).
        self.model_thread = ModelThread(f"rank{self.rank}-loop", config.engine.num_threads)
        try:
            if config.engine.backend == "vllm":
                from splitserve.worker_common.vllm_engine import VllmRank, VllmRanks  # imports vllm: only on it

                if rendezvous is None:
                    raise ValueError("rendezvous: a vllm-backend rank meets the others at rank 0's store")
                ranks = VllmRanks(*rendezvous, group_id)
                self.vllm = self.model_thread.call(lambda: VllmRank(config.engine, config.role, ranks, config.cpus))
                kv_cache, facts, device = self.vllm.kv_cache, self.vllm.model, self.vllm.device
            else:
                self.core = self.model_thread.call(lambda: EngineCore(config.engine, tp_group=group))
                if not self.core.is_follower:
                    raise ValueError(
                        "tensor_parallel_step: a follower rank runs rank 0's plans ('plan'), not 'lockstep'"
                    )
                kv_cache, facts, device = self.core.kv_cache, model_facts(self.core), self.core.device
        except BaseException:
            self.model_thread.close()  # a failed start's model thread ends with it
            raise
        self.kv_cache, self.num_kv_heads = kv_cache, facts.num_kv_heads
        self.name = f"{config.worker_id}.rank{self.rank}"
        self.faults = config.faults.arm(f"{config.role} worker {self.name}")
        fingerprint = layout_fingerprint(config, facts)
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        endpoint = dict(host=config.host, config=config.transfer, faults=self.faults)
        if config.role == "prefill":
            connect = lambda peer: GrpcConnection(peer.control, config.security)  # noqa: E731
            self.sender = KVSender(kv_cache, fingerprint, self.name, connect=connect, **endpoint)
        elif config.role == "decode":
            self.receiver = KVReceiver(kv_cache, fingerprint, self.name, **endpoint)
        self.channel = PlanChannel(group, device)
        self.events: queue.Queue[wpb.RankEvent] = queue.Queue()
        self.steps = 0
        self._pending: list[SendHandle] = []  # started by the last notice, streamed by the next plan
        self._released: dict[str, float] = {}  # part id -> when rank 0 released it before it started
        self._lock = threading.Lock()
        self._exit = exit
        self._server: grpc.Server | None = None
        self._thread: threading.Thread | None = None
        self.incarnation = self.receiver.incarnation if self.receiver is not None else uuid.uuid4().hex

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> RankInfo:
        """Serve TensorParallelRank (and KVTransfer, a decode rank) on the configured host; the loop waits
        for ``follow``."""
        cfg = self.config
        threads = cfg.transfer.max_pairs + SPARE_RPC_THREADS
        self._server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=threads, thread_name_prefix=f"rank{self.rank}-rpc", initializer=serial_torch
            ),
            options=SERVER_OPTIONS,
            maximum_concurrent_rpcs=threads,
            interceptors=server_interceptors(cfg.security.policy(), aio=False),
        )
        wpb_grpc.add_TensorParallelRankServicer_to_server(_Servicer(self), self._server)
        if self.receiver is not None:
            kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(self.receiver), self._server)
        port = cfg.security.add_port(self._server, f"{cfg.host}:0")
        if port == 0:
            raise OSError(f"could not bind {self.name} to {cfg.host}")
        self._server.start()
        receiver_id = self.name if self.receiver is not None else ""
        return RankInfo(self.rank, f"{cfg.host}:{port}", receiver_id, self.incarnation if receiver_id else "")

    def follow(self) -> None:
        """Start running rank 0's plans (once rank 0's engine is built: until then it sends nothing)."""
        self._thread = self.model_thread.run(self._loop)

    def status(self) -> dict[str, int]:
        """This rank's figures: its rank, the plans it ran, and the transfer parts it holds (live or ending)."""
        endpoint = self.sender or self.receiver
        parts = endpoint.num_transfers() if endpoint is not None else 0
        return {"rank": self.rank, "steps": self.steps, "parts": parts + len(self._pending)}

    def stop(self) -> None:
        self.model_thread.close()  # stopped before it followed: the model thread ends
        if self._server is not None:
            self._server.stop(STOP_GRACE_S)
        for endpoint in (self.sender, self.receiver):
            if endpoint is not None:
                endpoint.close()
        if self.vllm is not None:
            self.vllm.close()

    # ---- the loop -------------------------------------------------------------------------------

    def _loop(self) -> None:  # on the model thread, which set its torch threads as it started
        try:
            while True:
                match self.channel.receive():
                    case Stop():
                        break
                    case Tick():
                        continue
                    case Notice(payload):
                        self._start_sends(rank_notices.decode(payload))
                    case StepPlan() as plan:
                        self._run(plan)
                    case Foreign(payload) if self.vllm is not None:
                        self._run_vllm(payload)
                    case other:
                        raise TypeError(f"unknown plan channel message {other!r}")
        except Exception as e:  # the group failed (or rank 0 sent nonsense): the worker fails as a whole
            log.error("%s: tensor-parallel group failed: %s: %s", self.name, type(e).__name__, e)
            logging.shutdown()
            self._exit(GROUP_FAILED_EXIT)
            return
        log.info("%s: rank 0 stopped the group", self.name)
        self.stop()

    def _run(self, plan: StepPlan) -> None:
        self.faults.step("prefill" if len(plan.prefill_chunks) else "decode")
        sends, self._pending = self._pending, []

        def layers_ready(num_layers: int) -> None:
            for handle in sends:
                self.sender.layers_ready(handle, num_layers)

        self.core.runner.run_plan(plan, layers_ready if sends else None)
        for handle in sends:
            if not handle.terminal:
                self.sender.finish(handle)  # rank 0's parts carry the commit
        self.steps += 1

    def _run_vllm(self, payload: bytes) -> None:
        """A step of rank 0's vLLM scheduler: the KV of the requests whose sends the last notice started is
        computed in it, and each layer is sent as the forward writes it (the connector's ``save_kv_layer``)."""
        sends, self._pending = self._pending, []

        def layers_ready(num_layers: int) -> None:
            for handle in sends:
                self.sender.layers_ready(handle, num_layers)

        saved = self.vllm.run(payload, layers_ready if sends else None)
        for handle in sends:
            if saved < self.kv_cache.spec.num_layers:
                self.sender.layers_ready(handle, self.kv_cache.spec.num_layers)
            if not handle.terminal:
                self.sender.finish(handle)
        self.steps += 1

    def _start_sends(self, notice: rank_notices.StartSends) -> None:
        if self.sender is None:
            raise TypeError(f"{self.name}: a {self.config.role} rank sends no KV")
        d, p = len(notice.destinations), self.group.size
        for pair in sends_for(self.num_kv_heads, p, self.rank, d):
            part = rank_transfer_id(notice.request_id, pair.receiver_rank, d)
            with self._lock:
                released = self._released.pop(part, None) is not None
                if not released:
                    try:
                        destination = notice.destinations[pair.receiver_rank]
                        handle = self.sender.start(
                            part, destination, notice.block_ids, notice.num_tokens, heads=pair.heads
                        )
                    except ValueError as e:
                        self._report(part, TransferState.FAILED, str(e))
                        continue
            if released:
                self._report(part, TransferState.CANCELLED, "released by rank 0 before it started")
                continue
            handle.on_terminal(self._part_ended)
            self._pending.append(handle)

    # ---- parts ----------------------------------------------------------------------------------

    def expect(self, part: str, block_ids: list[int], timeout_s: float | None) -> None:
        """A decode rank: expect a part into rank 0's block ids (gRPC thread). Raises ServingError."""
        if self.receiver is None:
            raise ServingError("FAILED_PRECONDITION", f"{self.name}: a {self.config.role} rank receives no KV")
        if not block_ids or max(block_ids) >= self.kv_cache.spec.num_blocks:
            raise ServingError("INVALID_ARGUMENT", f"block_ids: not blocks of this rank's cache: {block_ids[:8]}")
        try:
            handle = self.receiver.expect(part, block_ids, timeout_s or None)
        except ValueError as e:
            raise ServingError("ALREADY_EXISTS", str(e)) from None
        handle.on_terminal(self._part_ended)

    def release(self, part: str, reason: str) -> None:
        """End a part (gRPC thread); one not started yet ends as it starts."""
        endpoint = self.sender or self.receiver
        with self._lock:
            if endpoint is None or endpoint.has_transfer(part):
                pass
            elif self.sender is not None:
                now = time.monotonic()
                self._released = {k: t for k, t in self._released.items() if now - t < TOMBSTONE_S}
                self._released[part] = now
                return
        if endpoint is not None:
            endpoint.cancel(part, reason or "released by rank 0")

    def _part_ended(self, handle: TransferHandle) -> None:
        self._report(handle.transfer_id, handle.state, handle.error, handle.nbytes)
        (self.sender or self.receiver).release(handle.transfer_id)

    def _report(self, part: str, state: TransferState, error: str = "", nbytes: int = 0) -> None:
        self.events.put(wpb.RankEvent(transfer_id=part, state=state.value, error=error, bytes=nbytes))


class _Servicer(wpb_grpc.TensorParallelRankServicer):
    def __init__(self, follower: Follower) -> None:
        self.follower = follower

    def Expect(self, request, context):  # noqa: N802
        try:
            self.follower.expect(request.transfer_id, list(request.block_ids), request.timeout_s)
        except ServingError as e:
            abort(context, e)
        return wpb.RankAck()

    def Release(self, request, context):  # noqa: N802
        self.follower.release(request.transfer_id, request.reason)
        return wpb.RankAck()

    def Events(self, request, context):  # noqa: N802
        if request.group != self.follower.group_id:
            abort(
                context, ServingError("FAILED_PRECONDITION", f"group: this rank is of group {self.follower.group_id}")
            )
        while context.is_active():
            try:
                yield self.follower.events.get(timeout=EVENTS_POLL_S)
            except queue.Empty:
                continue
