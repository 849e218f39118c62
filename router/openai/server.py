"""The OpenAI-compatible HTTP API, served by the router process on the router's own event loop.

    POST /v1/completions, /v1/chat/completions   (stream: server-sent events)
    GET  /v1/models, /v1/models/{model}, /health

A request takes the router's own path in-process: each prompt becomes a ``GenerateRequest`` admitted
by ``Router.admitted`` (the same validation, ids, queue and ``RequestRun`` as a gRPC call), and its
messages are relayed as OpenAI objects. When the HTTP client goes away, aiohttp cancels the handler
(``handler_cancellation``); closing the request's streams then cancels its worker calls, and the
workers free its blocks, in whatever phase it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from typing import Protocol

from aiohttp import web

from splitserve.common.errors import ServingError
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.router.config import RouterConfig
from splitserve.router.generate import RequestRun
from splitserve.router.openai.chat_template import ChatTemplate, ChatTemplateError
from splitserve.router.openai.errors import OpenAIError, dumps
from splitserve.router.openai.parse import Job, ServedModel, parse_chat, parse_completion
from splitserve.router.openai.respond import Responder
from splitserve.rpc.auth import AUTH_HEADER, Credential
from splitserve.v1 import splitserve_pb2 as pb

log = logging.getLogger("splitserve.openai")
REQUEST_ID_HEADER = "X-Request-Id"


class Admitting(Protocol):
    """What the API needs of the router it runs in (``splitserve.router.server.Router`` is the one): its
    settings and model, and its two steps for every request, ``admitted`` then ``observed``. A protocol,
    so that this module does not import the server module that imports it."""

    config: RouterConfig
    model_config: ModelConfig
    tokenizer: Tokenizer

    @property
    def model_name(self) -> str: ...

    def admitted(self, request: pb.GenerateRequest) -> AbstractContextManager[RequestRun]: ...

    def observed(self, run: RequestRun) -> AsyncIterator[pb.GenerateResponse]: ...


class OpenAIServer:
    def __init__(self, router: Admitting) -> None:
        self.router = router
        cfg = router.config
        self.api_keys = Credential("an API key", cfg.public_security.keys())
        self.model = ServedModel(
            router.model_name,
            router.tokenizer,
            router.model_config.max_position_embeddings,
            *_template(router.tokenizer),
            max_prompts=cfg.max_queue,
        )
        self.created = int(time.time())
        self.runner: web.AppRunner | None = None
        self.address = ""

    async def start(self, host: str, port: int) -> str:
        """Serve on host:port (0: a free port), with TLS when the public port has it; returns "host:port"."""
        cfg = self.router.config
        # Bodies up to twice the router's message limit are read, so that admission refuses them
        # naming the field; past that aiohttp answers 413 unread (as the gRPC transport does).
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=2 * cfg.max_message_bytes)
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model:.+}", self.model_info),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
            ]
        )
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, ssl_context=cfg.public_security.ssl_context())
        await site.start()
        self.address = f"{host}:{self.runner.addresses[0][1]}"
        return self.address

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    # ---- middlewares ----------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except OpenAIError as e:
            return e.response()
        except web.HTTPException as e:  # no such route (404), method (405), a body too large (413)
            if e.status < 400:
                raise
            code = e.reason.lower().replace(" ", "_")
            return OpenAIError(e.status, f"{request.method} {request.path}: {e.reason}", code=code).response()
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as e:
            log.exception("%s %s failed", request.method, request.path)
            return OpenAIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error").response()

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        """API keys as on the gRPC port (``Authorization: Bearer <key>``); /health stays open."""
        if self.api_keys.tokens and request.path != "/health":
            value = request.headers.get(AUTH_HEADER)
            scheme, _, key = (value or "").strip().partition(" ")
            if value is None:
                problem = "an API key is required: send the header 'Authorization: Bearer <key>'"
            elif scheme.lower() != "bearer" or not key.strip():
                problem = "the Authorization header must be 'Bearer <key>'"
            elif not self.api_keys.accepts(key.strip()):
                problem = "the API key presented is not valid"
            else:
                problem = None
            if problem is not None:
                raise OpenAIError(401, problem, code="invalid_api_key")
        return await handler(request)

    # ---- routes ---------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def _model_object(self) -> dict:
        return {
            "id": self.model.name,
            "object": "model",
            "created": self.created,
            "owned_by": "splitserve",
            "max_model_len": self.model.max_model_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_object()]}, dumps=dumps)

    async def model_info(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.model.name:
            raise OpenAIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
        return web.json_response(self._model_object(), dumps=dumps)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        request_id = _request_id(request)
        return await self._serve(request, parse_completion(await _json(request), self.model, request_id), request_id)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        request_id = _request_id(request)
        return await self._serve(request, parse_chat(await _json(request), self.model, request_id), request_id)

    # ---- one request ------------------------------------------------------------------------------

    async def _serve(self, request: web.Request, job: Job, request_id: str) -> web.StreamResponse:
        responder = Responder(job, self.model.name, request_id, self.model.tokenizer)
        try:
            with contextlib.ExitStack() as admitted:
                runs = [admitted.enter_context(self.router.admitted(r)) for r in job.requests]
                async with contextlib.aclosing(_merged([self.router.observed(run) for run in runs])) as messages:
                    if job.stream:
                        return await self._stream(request, job, responder, messages, request_id)
                    texts, finals = [[] for _ in range(len(runs) * job.n)], [None] * (len(runs) * job.n)
                    async for prompt, message in messages:
                        index = prompt * job.n + message.choice
                        texts[index].append(responder.gather(index, message))
                        if message.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                            finals[index] = message
                    body = responder.response(["".join(t) for t in texts], finals)
                    return web.json_response(body, dumps=dumps, headers={REQUEST_ID_HEADER: request_id})
        except ServingError as e:
            raise job.error(e) from None

    async def _stream(
        self, request: web.Request, job: Job, responder: Responder, messages, request_id: str
    ) -> web.StreamResponse:
        """Server-sent events as OpenAI sends them: ``data: {chunk}``, a usage chunk when asked, then
        ``data: [DONE]``. Nothing is sent before the first message, so an error before any output
        (a full queue, no worker) still has its HTTP status; one after it is sent as an error event."""
        item = await anext(messages, None)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", REQUEST_ID_HEADER: request_id}
        )
        await response.prepare(request)

        async def send(obj: dict | str) -> None:
            await response.write(f"data: {obj if isinstance(obj, str) else dumps(obj)}\n\n".encode())

        finals: list[pb.GenerateResponse] = []
        try:
            if job.kind == "chat":
                for index in range(len(job.requests) * job.n):
                    await send(responder.role_chunk(index))
            while item is not None:
                prompt, message = item
                index = prompt * job.n + message.choice
                if message.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    finals.append(message)
                chunk = responder.chunk(index, message)
                if chunk is not None:
                    await send(chunk)
                item = await anext(messages, None)
            if job.include_usage:
                await send(responder.usage_chunk(finals))
        except ServingError as e:
            await send(job.error(e).body())
        await send("[DONE]")
        await response.write_eof()
        return response


def _template(tokenizer: Tokenizer) -> tuple[ChatTemplate | None, str]:
    """The model's chat template and, without one, why not (for the 400 that chat requests get)."""
    try:
        template = ChatTemplate.from_tokenizer(tokenizer)
    except ChatTemplateError as e:
        log.error("chat completions are refused: %s", e)
        return None, str(e)
    reason = (
        ""
        if template
        else "the model has no chat template (tokenizer_config.json's chat_template or chat_template.jinja)"
    )
    return template, reason


def _request_id(request: web.Request) -> str:
    """The client's X-Request-Id (as vLLM takes it), else a fresh one; the router checks it."""
    return request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex


async def _json(request: web.Request) -> object:
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


async def _merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(index, item) from several streams as they come. The first error ends it; ending it (closed,
    cancelled, an error) cancels every stream still running, which cancels their worker calls."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=8 * len(streams))
    done = object()

    async def pump(index: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((index, item, None))
            await queue.put((index, done, None))
        except Exception as e:  # noqa: BLE001 -- handed to the reader, which raises it
            await queue.put((index, done, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                running -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
