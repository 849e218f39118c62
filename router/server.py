"""The router: splitserve's public gRPC front door (``splitserve.v1.SplitServe``), plus the standard
health service and server reflection. No torch here: it tokenizes, validates, queues, routes,
detokenizes and relays; the workers compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitserve.common.errors import ServingError
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.sampling.params import SamplingParamsError
from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.engine.wire import sampling_from_pb
from splitserve.observability.exporter import MetricsServer
from splitserve.observability.logs import request_context
from splitserve.router.config import RouterConfig
from splitserve.router.dispatcher import Dispatcher
from splitserve.router.generate import RequestRun
from splitserve.router.load import LoadWindow
from splitserve.router.metrics import RequestSummary, RouterMetrics, log_request
from splitserve.router.samples import SAMPLE_ID_SEPARATOR, SampleGroup, sample_sampling
from splitserve.router.workers import WorkerAddress, WorkerPool
from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc import workers_pb2_grpc as wpb_grpc
from splitserve.rpc.auth import server_interceptors
from splitserve.rpc.options import SERVER_OPTIONS
from splitserve.rpc.status import abort_async
from splitserve.v1 import splitserve_pb2 as pb
from splitserve.v1 import splitserve_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from splitserve.router.openai.server import OpenAIServer

log = logging.getLogger("splitserve.router")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SplitServe"].full_name
# A call cancelled this close to its deadline counts as DEADLINE_EXCEEDED: the client's copy of the
# deadline fires first (ours started when its headers arrived) and its cancel reaches us early.
DEADLINE_SLACK_S = 0.5


class Router(pb_grpc.SplitServeServicer):
    def __init__(self, config: RouterConfig, workers: list[WorkerAddress] = (), scaler=None) -> None:
        self.config = config
        self.model_config = ModelConfig.from_model_dir(config.model_dir)
        self.tokenizer = Tokenizer.from_model_dir(config.model_dir)
        self.block_size = config.block_size
        self.workers = list(workers)
        self.scaler = scaler  # async scale({role: target}) -> {role: count}, from the launcher
        self.pool: WorkerPool | None = None
        self.dispatcher: Dispatcher | None = None
        self.inflight: set[str] = set()
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self.server: grpc.aio.Server | None = None  # the public port: SplitServe, Admin, health, reflection
        self.internal_server: grpc.aio.Server | None = None  # the internal port: Registry (workers)
        self.internal_address = ""
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.address = ""
        self.metrics = RouterMetrics()
        self.metrics.watch(self)
        self.load = LoadWindow()  # recent arrivals, lengths and latencies (a live planner reads them)
        self.planner_status = ""  # a live planner's last decision, shown by GetStatus
        self.pending_workers: list[str] = []  # started workers waiting for resources (the launcher sets it)
        self.metrics_server = MetricsServer(self.metrics.registry)
        self.metrics_address = ""  # "" when metrics are off
        self.openai: OpenAIServer | None = None  # the OpenAI-compatible HTTP API, when openai_port is set
        self.openai_address = ""

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> str:
        """Connect to the static workers (if any), then serve; returns the public "host:port". Other
        workers join by registering (``Registry.Register``) on the internal port (``internal_address``),
        which clients never need: each port has its own credentials (docs/security.md)."""
        cfg = self.config
        public, internal = cfg.public_security, cfg.internal_security
        self.pool = WorkerPool(cfg.prefill_credit, cfg.status_interval_s, cfg.worker_timeout_s, internal)
        await self.pool.start(self.workers)
        self.dispatcher = Dispatcher(self.pool, cfg, self.block_size)
        self.dispatcher.start()
        # Requests up to twice the limit reach _admit, which refuses them naming the field; past that
        # the transport refuses them (RESOURCE_EXHAUSTED) without reading them.
        options = [("grpc.max_receive_message_length", 2 * cfg.max_message_bytes), *SERVER_OPTIONS]
        interceptors = server_interceptors(public.policy(internal.cluster_token()), aio=True)
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        pb_grpc.add_SplitServeServicer_to_server(self, self.server)
        wpb_grpc.add_AdminServicer_to_server(_Admin(self), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        port = public.add_port(self.server, f"{cfg.host}:{cfg.port}")
        if port == 0:
            raise OSError(f"could not bind the router to {cfg.host}:{cfg.port}")
        self.internal_server = grpc.aio.server(
            options=SERVER_OPTIONS, interceptors=server_interceptors(internal.policy(), aio=True)
        )
        wpb_grpc.add_RegistryServicer_to_server(_Registry(self.pool), self.internal_server)
        internal_port = internal.add_port(self.internal_server, f"{cfg.host}:{cfg.internal_port}")
        if internal_port == 0:
            raise OSError(f"could not bind the router's internal port to {cfg.host}:{cfg.internal_port}")
        if cfg.metrics_port is not None:
            self.metrics_address = self.metrics_server.start(cfg.metrics_host or cfg.host, cfg.metrics_port)
        await self.server.start()
        await self.internal_server.start()
        for name in ("", SERVICE_NAME):
            await _maybe_await(self.health.set(name, health_pb2.HealthCheckResponse.SERVING))
        self.address = f"{cfg.host}:{port}"
        self.internal_address = f"{cfg.host}:{internal_port}"
        if cfg.openai_port is not None:
            from splitserve.router.openai.server import OpenAIServer  # aiohttp and jinja2 load only when it is on

            self.openai = OpenAIServer(self)
            self.openai_address = await self.openai.start(cfg.host, cfg.openai_port)
            log.info(
                "router serving the OpenAI API on %s://%s/v1",
                "https" if public.tls_cert else "http",
                self.openai_address,
            )
        log.info(
            "router serving clients on %s (%s), workers on %s (%s)",
            self.address,
            "TLS" if public.tls_cert else "plaintext",
            self.internal_address,
            "mTLS" if internal.tls else "plaintext",
        )
        return self.address

    async def stop(self, grace_s: float = 1.0) -> None:
        """The public port and the OpenAI API stop together: new calls are refused at once, calls in
        flight get ``grace_s`` to end, then they are cancelled (a gRPC client sees UNAVAILABLE). The
        internal port then closes without a grace (it holds only the workers' registrations), and the
        queue and the pool follow."""
        public = []
        if self.openai is not None:
            public.append(self.openai.stop())
        if self.server is not None:
            for name in ("", SERVICE_NAME):
                await _maybe_await(self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING))
            public.append(self.server.stop(grace_s))
        await asyncio.gather(*public)
        if self.internal_server is not None:
            await self.internal_server.stop(0)
        if self.dispatcher is not None:
            await self.dispatcher.close()
        if self.pool is not None:
            await self.pool.close()
        self.metrics_server.stop()

    # ---- the public API ---------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context):  # noqa: N802
        try:
            with self.admitted(request) as run:
                async with contextlib.aclosing(self.observed(run, context.time_remaining)) as messages:
                    async for message in messages:
                        yield message
        except ServingError as e:
            await abort_async(context, e)

    @contextlib.contextmanager
    def admitted(self, request: pb.GenerateRequest) -> Iterator[RequestRun | SampleGroup]:
        """The request validated, tokenized and in flight (its id taken) until the block ends; raises
        ServingError naming the bad field (and counts the refusal). Every front end admits requests
        this way, then runs them through ``observed``."""
        try:
            run = self._admit(request)
        except ServingError as e:
            self._ended(RequestSummary(request.request_id or "-", "error", e.code, e.message, "", 0, 0, 0, None))
            raise
        self.load.arrived()
        try:
            yield run
        finally:
            self.inflight.discard(run.request_id)

    async def observed(
        self, run: RequestRun | SampleGroup, time_remaining=lambda: None
    ) -> AsyncIterator[pb.GenerateResponse]:
        """An admitted request's messages; however it ends, it is counted in the metrics and logged
        (its line carries the timeline). Raises ServingError as ``RequestRun.run`` does.
        ``time_remaining``: the caller's deadline, to tell a deadline from a cancel."""
        # Unless it finishes or fails, the call was cancelled (the client's cancel, or its deadline).
        outcome, status, message = "cancelled", "CANCELLED", ""
        responses = run.run()
        with request_context(run.request_id):
            try:
                async for response in responses:
                    yield response
                outcome, status = "finished", "OK"
            except ServingError as e:
                outcome, status, message = "error", e.code, e.message
                raise
            except Exception as e:  # a bug: the call ends UNKNOWN
                outcome, status, message = "error", "UNKNOWN", f"{type(e).__name__}: {e}"
                raise
            finally:
                # A call cancelled while this generator waited at its yield leaves ``responses``
                # suspended: close it now, so its legs close their worker calls before the summary.
                await responses.aclose()
                remaining = time_remaining()
                if outcome == "cancelled" and remaining is not None and remaining < DEADLINE_SLACK_S:
                    status = "DEADLINE_EXCEEDED"  # the client gives up at its deadline, a moment before ours
                self._ended(run.summary(outcome, status, message))

    def _ended(self, summary: RequestSummary) -> None:
        self.metrics.ended(summary)
        self.load.ended(summary)
        log_request(summary)

    @property
    def model_name(self) -> str:
        return self.config.model_name or Path(self.config.model_dir).name

    def _admit(self, request: pb.GenerateRequest) -> RequestRun | SampleGroup:
        """Validate and tokenize; raises ServingError naming the bad field."""
        cfg = self.config
        has_prompt, has_ids = request.HasField("prompt"), len(request.token_ids) > 0
        size = request.ByteSize()
        if size > cfg.max_message_bytes:
            raise ServingError(
                "INVALID_ARGUMENT",
                f"{'prompt' if has_prompt else 'token_ids'}: the request is {size} "
                f"bytes, over the limit of {cfg.max_message_bytes}",
            )
        if has_prompt == has_ids:
            raise ServingError("INVALID_ARGUMENT", "prompt, token_ids: give exactly one of them")
        if has_prompt:
            if not request.prompt:
                raise ServingError("INVALID_ARGUMENT", "prompt: must not be empty")
            try:
                tokens = self.tokenizer.encode(request.prompt)
            except ValueError as e:
                raise ServingError("INVALID_ARGUMENT", f"prompt: {e}") from None
            if not tokens:
                raise ServingError("INVALID_ARGUMENT", "prompt: encodes to no tokens")
        else:
            tokens = list(request.token_ids)
            vocab = self.model_config.vocab_size
            bad = next((t for t in tokens if t >= vocab), None)
            if bad is not None:
                raise ServingError("INVALID_ARGUMENT", f"token_ids: {bad} is outside the vocabulary [0, {vocab})")
        try:
            sampling = sampling_from_pb(request.sampling)
            sampling.validate(self.model_config.vocab_size)
        except SamplingParamsError as e:
            field = e.field if e.field.startswith("sampling.") else f"sampling.{e.field}"
            raise ServingError("INVALID_ARGUMENT", f"{field}: {str(e).split(': ', 1)[1]}") from None
        max_len = self.model_config.max_position_embeddings
        if len(tokens) + sampling.max_tokens > max_len:
            raise ServingError(
                "INVALID_ARGUMENT",
                f"sampling.max_tokens: prompt ({len(tokens)} tokens) + max_tokens "
                f"({sampling.max_tokens}) exceeds the context length {max_len}",
            )
        n = request.n if request.HasField("n") else 1
        if not 1 <= n <= cfg.max_n:
            raise ServingError("INVALID_ARGUMENT", f"n: must be 1 to {cfg.max_n} (the router's max_n), got {n}")
        if request.HasField("request_id"):
            request_id = request.request_id
            if not 0 < len(request_id) <= cfg.max_request_id_chars or not request_id.isprintable():
                raise ServingError(
                    "INVALID_ARGUMENT", f"request_id: must be 1 to {cfg.max_request_id_chars} printable characters"
                )
        else:
            request_id = f"{self._prefix}-{next(self._ids)}"
        if request_id in self.inflight:
            raise ServingError("ALREADY_EXISTS", f"request_id: {request_id!r} is already in flight")
        self.inflight.add(request_id)
        if n == 1:
            return RequestRun(request_id, tokens, sampling, self.tokenizer, self.dispatcher, cfg, self.metrics)
        runs = [
            RequestRun(
                request_id if i == 0 else f"{request_id}{SAMPLE_ID_SEPARATOR}{i}",
                tokens,
                sample_sampling(sampling, i),
                self.tokenizer,
                self.dispatcher,
                cfg,
                self.metrics,
            )
            for i in range(n)
        ]
        return SampleGroup(runs)

    async def GetStatus(self, request, context):  # noqa: N802
        workers = []
        for w in self.pool.workers:
            status = pb.WorkerStatus()
            status.CopyFrom(w.status)
            status.healthy = w.healthy
            status.address = status.address or w.spec.address
            status.node_id = w.spec.node or status.node_id
            workers.append(status)
        return pb.GetStatusResponse(
            workers=workers,
            queued_requests=len(self.dispatcher.waiting),
            running_requests=len(self.inflight) - len(self.dispatcher.waiting),
            model=self.model_name,
            vocab_size=self.tokenizer.vocab_size,
            max_model_len=self.model_config.max_position_embeddings,
            metrics_address=self.metrics_address,
            planner=self.planner_status,
            pending_workers=self.pending_workers,
        )


async def _maybe_await(result) -> None:
    if asyncio.iscoroutine(result):
        await result


class _Registry(wpb_grpc.RegistryServicer):
    """Workers register here and stay in the pool exactly as long as their call is open."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    async def Register(self, info: wpb.WorkerInfo, context):  # noqa: N802
        if info.role not in ("prefill", "decode", "colocated") or not info.address or not info.worker_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "role (prefill, decode or colocated), worker_id and address are required",
            )
        handle = await self.pool.register(info)
        try:
            yield wpb.RegistryCommand(kind=wpb.RegistryCommand.ACCEPTED)
            while True:
                yield await handle.commands.get()
        finally:
            await self.pool.remove(handle)


class _Admin(wpb_grpc.AdminServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Scale(self, request: wpb.ScaleRequest, context):  # noqa: N802
        if self.router.scaler is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this router was not started by splitserve serve")
        targets = {
            role: getattr(request, role) for role in ("prefill", "decode", "colocated") if request.HasField(role)
        }
        zero = [role for role, n in targets.items() if n == 0]
        if zero:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{', '.join(zero)}: at least one worker of each role"
            )
        try:
            counts = await self.router.scaler(targets)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"scaling failed: {e}")
        return wpb.ScaleReply(**counts)
