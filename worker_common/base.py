"""The skeleton every worker shares: one engine, one loop thread, one gRPC server.

Threads and who owns what::

    gRPC handler threads ──submit(Command)──▶ inbox ──▶ loop thread: schedule ▸ run model ▸ apply
           ▲                                                        │
           └───── stream_events ◀── per-request queue of Event ◀────┘

Commands and events are the dataclasses of ``worker_common.messages``; protobuf is made and read only
at the edges (the servicers, and ``stream_events``).

The loop thread is the only one that runs the model, and the one that built the engine
(``worker_common.model_thread``); the others run their torch work on one OpenMP thread. The engine
(``self.engine``, the interface of ``worker_common.engine_api``) is shared with handler threads and
transfer callbacks under ``self.lock``, which it holds only while it schedules or applies results, never
while the model runs. Nothing is done while holding the lock that could call back into code taking it.
Every second of the loop thread is booked to one phase (``worker_common.loop_clock``), its waits for the
lock included.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import torch
from google.protobuf.message import Message

from splitserve.common.errors import ServingError
from splitserve.engine.threads import serial_torch
from splitserve.observability.exporter import MetricsServer
from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc.auth import server_interceptors
from splitserve.rpc.options import SERVER_OPTIONS
from splitserve.rpc.status import abort
from splitserve.v1 import splitserve_pb2 as pb
from splitserve.worker_common.affinity import format_cpu_list, pin, usable_cpus
from splitserve.worker_common.config import WorkerConfig
from splitserve.worker_common.engine_api import Engine
from splitserve.worker_common.layout import layout_fingerprint
from splitserve.worker_common.local_engine import LocalEngine
from splitserve.worker_common.loop_clock import TimedLock
from splitserve.worker_common.messages import Command, Drain, Emit, End, Event, Fail, unknown_event
from splitserve.worker_common.metrics import WorkerMetrics
from splitserve.worker_common.model_thread import ModelThread
from splitserve.worker_common.registration import Registration
from splitserve.worker_common.tp.rank_link import GROUP_FAILED_EXIT, Ranks

log = logging.getLogger("splitserve.worker")

# Handler threads beyond the request calls and the KV pairs' streams: the router's Status polls and its
# CacheEvents stream, a few at a time whatever the load; 16 leaves room to spare.
SPARE_RPC_THREADS = 16
# How long the idle loop sleeps. submit(), wake() and stop() end the sleep at once, so this only bounds
# how late an idle loop steps anyway: a tensor-parallel rank 0's keep-alive tick (due every quarter of the
# group's timeout, seconds) and anything that changed without a wake. 50 ms costs nothing while idle.
IDLE_WAIT_S = 0.05
# How long stop() waits for the loop thread, which ends after the step in progress. Past it, stop() goes on
# without it (a tensor-parallel worker then cannot stop its other ranks, which fail by themselves).
LOOP_JOIN_S = 5.0


class WorkerBase:
    # The scheduler's mode of this role (``EngineCore.make_scheduler``'s keywords, for the local engine).
    scheduler_mode: dict[str, object] = {}

    def __init__(self, config: WorkerConfig, ranks: Ranks | None = None, engine: Engine | None = None) -> None:
        """``ranks``: this process is rank 0 of a tensor-parallel worker (``engine.tensor_parallel_size`` > 1)
        whose other ranks have joined the group and run ``splitserve.worker_common.tp.follower``.
        ``engine``: the engine to drive, built on ``self.lock`` and timing its steps into ``self.metrics``
        (default: a ``LocalEngine`` of ``config.engine`` in this role's ``scheduler_mode``)."""
        self.config = config
        if config.cpus is not None:  # before the engine: its torch threads start on these cores
            pin(config.cpus)
        self.cpus = format_cpu_list(usable_cpus())  # where this process runs, pinned or not
        self.threads = 0  # torch threads of the loop thread, which runs the model (set as it starts)
        self.ranks = ranks
        self.metrics = WorkerMetrics(config.worker_id, config.role)
        self.lock = TimedLock(self.metrics.loop)  # reentrant; the loop thread's waits for it are timed
        # One thread builds the engine and then runs the loop (worker_common.model_thread says why).
        self.model_thread = ModelThread(f"{config.role}-loop", config.engine.num_threads)
        if engine is None:
            try:
                engine = self.model_thread.call(lambda: self._build_engine(ranks))
            except BaseException:
                self.model_thread.close()  # the failed build's thread ends with it
                raise
        self.engine: Engine = engine
        self.fingerprint = layout_fingerprint(config, engine.model)
        # A tensor-parallel worker fails as a whole when one of its ranks does: the process ends (Ray
        # restarts it, with new followers) and the router retries or migrates what it held.
        self.exit_process: Callable[[int], object] = os._exit
        if ranks is not None:
            ranks.on_lost = self.group_failed
        self.address = ""
        self._inbox: queue.Queue[Command] = queue.Queue()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._server: grpc.Server | None = None
        self._thread: threading.Thread | None = None
        self.registration: Registration | None = None
        self.draining = False
        # Fault hooks (tests); their delays on the loop thread are booked to its clock's "other".
        self.faults = config.faults.arm(f"{config.role} worker {config.worker_id}", sleep=self._fault_sleep)
        self.metrics.watch(self)
        self.metrics_server = MetricsServer(self.metrics.registry)
        self.metrics_address = ""  # "" when metrics are off

    def _build_engine(self, ranks: Ranks | None) -> Engine:
        """This role's engine, built on the model thread: the vLLM backend's or the local one."""
        config = self.config
        if config.engine.backend == "vllm":
            from splitserve.worker_common.vllm_engine import VllmEngine  # imports vllm: only on this backend

            return VllmEngine(
                config.engine, self.lock, self.metrics, config.cpus, role=config.role, wake=self.wake, ranks=ranks
            )
        return LocalEngine.build(
            config.engine,
            self.lock,
            self.metrics,
            record_block_events=config.role == "prefill",
            tp_group=ranks.group if ranks else None,
            **self.scheduler_mode,
        )

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> str:
        """Serve on the configured address and start the loop; returns "host:port"."""
        cfg = self.config
        # Every open call holds a handler thread. The pool is sized for the most calls this worker
        # admits, and calls past it are refused at once (RESOURCE_EXHAUSTED) instead of queueing
        # without a deadline behind busy threads.
        threads = self.max_request_calls() + cfg.transfer.max_pairs + SPARE_RPC_THREADS
        self._server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=threads, thread_name_prefix=f"{cfg.role}-rpc", initializer=serial_torch
            ),
            options=SERVER_OPTIONS,
            maximum_concurrent_rpcs=threads,
            interceptors=server_interceptors(cfg.security.policy(), aio=False),
        )
        self.add_services(self._server)
        port = cfg.security.add_port(self._server, f"{cfg.host}:{cfg.port}")
        if port == 0:
            raise OSError(f"could not bind {cfg.role} worker {cfg.worker_id} to {cfg.host}:{cfg.port}")
        self._server.start()
        self.address = f"{cfg.host}:{port}"
        if cfg.metrics_port is not None:
            self.metrics_address = self.metrics_server.start(cfg.host, cfg.metrics_port)
        self._thread = self.model_thread.run(self._loop)
        log.info("%s worker %s serving on %s", cfg.role, cfg.worker_id, self.address)
        if cfg.router_address:
            self.registration = Registration(cfg.router_address, self.worker_info, self.drain, cfg.security)
            self.registration.start()
        return self.address

    def worker_info(self) -> wpb.WorkerInfo:
        return wpb.WorkerInfo(
            role=self.config.role,
            worker_id=self.config.worker_id,
            address=self.address,
            node=self.config.node or socket.gethostname(),
            incarnation=self.incarnation,
            max_inflight=self.config.max_inflight,
            block_size=self.config.engine.block_size,
            metrics_address=self.metrics_address,
        )

    def drain(self) -> None:
        """Take no new request; finish or hand back the ones held (from the registration thread)."""
        self.draining = True
        self.submit(Drain())

    def stop(self, grace_s: float = 1.0) -> None:
        if self.registration is not None:
            self.registration.stop()
        self._stopped.set()
        self._wake.set()
        self.model_thread.close()  # a worker stopped before it started: its model thread ends
        if self._server is not None:
            self._server.stop(grace_s).wait(grace_s + 1)
        if self._thread is not None:
            self._thread.join(LOOP_JOIN_S)
        if self.ranks is not None:
            if not (self._thread is not None and self._thread.is_alive()):
                try:  # the loop has ended: this thread may use the plan channel now
                    self.engine.close()  # Stop: the followers' loops end
                except Exception as e:  # a group broken already: its followers are failing by themselves
                    log.warning("%s: could not stop the other ranks: %s", self.config.worker_id, e)
            self.ranks.close()
        self.metrics_server.stop()

    def add_services(self, server: grpc.Server) -> None:
        raise NotImplementedError

    def max_request_calls(self) -> int:
        """The most request calls (Prefill or Decode streams) this worker holds open at once."""
        raise NotImplementedError

    # ---- the loop -------------------------------------------------------------------------------

    def submit(self, command: Command) -> None:
        """Hand a command to the loop thread (from any thread)."""
        self._inbox.put(command)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        # Every second of this thread from here on is booked to one phase (worker_common.loop_clock): the
        # commands, the worker's step (stream) with the engine's schedule, run and apply inside it, the idle wait.
        clock = self.metrics.loop
        clock.start()
        # The model thread set its torch threads as it started (worker_common.model_thread).
        self.threads = torch.get_num_threads()
        log.info(
            "%s worker %s: cpus %s%s, %d torch threads",
            self.config.role,
            self.config.worker_id,
            self.cpus,
            "" if self.config.cpus is not None else " (not pinned)",
            self.threads,
        )
        while not self._stopped.is_set():
            try:
                clock.enter("commands")
                while True:
                    try:
                        self.handle_command(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                clock.enter("stream")  # the engine's calls in the step book schedule, run and apply themselves
                busy = self.step()
                if not busy:
                    clock.enter("other")
                    self._keep_alive()
            except Exception as e:  # a bug must surface, fail the requests in flight, and not kill the loop
                clock.enter("other")
                if self._group_broken(e):
                    self.group_failed(f"{type(e).__name__}: {e}")
                    return
                log.error("%s loop failed: %s", self.config.role, traceback.format_exc())
                self.fail_all(f"internal error in the {self.config.role} worker: {type(e).__name__}: {e}")
                busy = False
            if not busy:
                clock.enter("idle")
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()

    def _fault_sleep(self, seconds: float) -> None:
        previous = self.metrics.loop.enter("other")
        time.sleep(seconds)
        self.metrics.loop.enter(previous)

    def _keep_alive(self) -> None:
        """Rank 0 of a tensor-parallel worker, idle: tick the other ranks before their wait for the next
        plan runs out (a quarter of the group's timeout); a dead or stalled rank makes this raise."""
        self.engine.keep_alive()

    def _group_broken(self, error: Exception) -> bool:
        return self.engine.group_broken(error)

    def group_failed(self, reason: str) -> None:
        """A rank of this tensor-parallel worker died or stalled (any thread): the worker fails as a whole.
        The process ends at once, as a crash would: its calls break, so the router takes the worker out of
        its pool and retries or migrates its requests, and Ray restarts it with a new group."""
        log.error("%s worker %s: tensor-parallel group failed: %s", self.config.role, self.config.worker_id, reason)
        logging.shutdown()
        self.exit_process(GROUP_FAILED_EXIT)

    def handle_command(self, command: Command) -> None:
        """Act on one command (loop thread); raises TypeError (``unknown_command``) on one it has no case for."""
        raise NotImplementedError

    def step(self) -> bool:
        """One iteration; returns False when there was nothing to do."""
        raise NotImplementedError

    def fail_all(self, message: str) -> None:
        raise NotImplementedError

    def kv_pairs(self) -> int:
        """Open KV-transfer pair groups (metrics)."""
        return 0

    def kv_transfers(self) -> int:
        """KV transfers registered at this process's own endpoint, live or ended but not released (with
        tensor parallelism: rank 0's parts, not the hand-offs; each follower counts its own). A worker at
        rest holds none."""
        return 0

    # ---- shared helpers -------------------------------------------------------------------------

    def check_request(self, token_ids: list[int], sampling) -> None:
        if not token_ids:
            raise ServingError("INVALID_ARGUMENT", "prompt_token_ids: must not be empty")
        try:
            self.engine.check_request(token_ids, sampling)
        except ValueError as e:
            raise ServingError("INVALID_ARGUMENT", str(e)) from None
        if len(token_ids) >= self.engine.max_model_len:
            raise ServingError("INVALID_ARGUMENT", f"prompt: {len(token_ids)} tokens exceed the context length")

    def kv_figures(self) -> tuple[int, int, int]:
        """(total, in use, cached) blocks, read from the allocator."""
        return self.engine.kv_figures()

    def status(self, running: int, waiting: int) -> pb.WorkerStatus:
        total, in_use, cached = self.kv_figures()
        return pb.WorkerStatus(
            role=self.config.role,
            worker_id=self.config.worker_id,
            node_id=self.config.node or socket.gethostname(),
            address=self.address,
            healthy=not self._stopped.is_set(),
            running=running,
            waiting=waiting,
            kv_blocks_total=total,
            kv_blocks_in_use=in_use,
            kv_blocks_cached=cached,
            incarnation=self.incarnation,
            metrics_address=self.metrics_address,
            cpus=self.cpus,
            threads=self.threads,
            decode_graphs=self.engine.decode_graphs,
            # Not part of the Engine protocol: LocalEngine's compute dtype and kernels, "" for another engine.
            linear_kernels=getattr(self.engine, "linear_kernels", ""),
            tensor_parallel_size=self.config.engine.tensor_parallel_size,
        )

    @property
    def incarnation(self) -> str:
        raise NotImplementedError


def stream_events(
    events: queue.Queue[Event],
    context: grpc.ServicerContext,
    merge: Callable[[Message, queue.Queue[Event]], Message] | None = None,
) -> Iterator[Message]:
    """Yield a request's events to its gRPC call: each Emit's message until End; Fail ends the call with
    its error's status. ``merge`` may fold the events queued behind a message into it (decode tokens)."""
    while True:
        match events.get():
            case Emit(message):
                yield message if merge is None else merge(message, events)
            case End():
                return
            case Fail(error):
                abort(context, error)
                return  # abort raises; nothing is read past a Fail
            case other:
                raise unknown_event(other)


def ms_since(start: float) -> float:
    return (time.monotonic() - start) * 1e3
