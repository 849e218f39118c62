"""Bearer tokens on gRPC calls: which credential each method needs, the server interceptors (sync
and grpc.aio) that refuse a call without it (``UNAUTHENTICATED``, before any handler runs), and the
client side that adds a token to every call of a channel. Tokens are compared with
``hmac.compare_digest``. Torch-free; ``splitserve.rpc.security`` says which tokens each port takes.
"""

from __future__ import annotations

import collections
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import grpc

AUTH_HEADER = "authorization"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries a token (none for no token)."""
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


# ---- who may call what (server side) --------------------------------------------------------------


@dataclass(frozen=True)
class Credential:
    """Tokens one kind of caller presents; ``name`` says which in error messages."""

    name: str  # "an API key", "the cluster token"
    tokens: tuple[str, ...]

    def accepts(self, presented: str) -> bool:
        ok = False
        for token in self.tokens:  # no early exit: the time taken does not depend on which token matched
            ok |= hmac.compare_digest(presented.encode(), token.encode())
        return ok


class AccessPolicy:
    """Which credential each method needs: the first rule whose prefix starts the full method name
    ("/package.Service/Method") decides; a rule with no credential (or one without tokens) is open."""

    def __init__(self, rules: Sequence[tuple[str, Credential | None]]) -> None:
        self.rules = [(prefix, c if c is not None and c.tokens else None) for prefix, c in rules]

    @property
    def enabled(self) -> bool:
        return any(c is not None for _, c in self.rules)

    def check(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """None when the call may proceed, else why not (for UNAUTHENTICATED)."""
        credential = next((c for prefix, c in self.rules if method.startswith(prefix)), None)
        if credential is None:
            return None
        values = [v for k, v in (metadata or ()) if k.lower() == AUTH_HEADER]
        if not values:
            return f"{method} needs {credential.name}: send the metadata '{AUTH_HEADER}: Bearer <token>'"
        value = values[0] if isinstance(values[0], str) else values[0].decode("utf-8", "replace")
        scheme, _, presented = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            return f"{method}: the {AUTH_HEADER} metadata must be 'Bearer <token>'"
        if not credential.accepts(presented.strip()):
            return f"{method}: {credential.name} presented is not valid"
        return None


def _denying(handler: grpc.RpcMethodHandler, message: str, aio: bool) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with UNAUTHENTICATED."""
    if aio:

        async def deny(request, context):
            await context.abort(UNAUTHENTICATED, message)

    else:

        def deny(request, context):
            context.abort(UNAUTHENTICATED, message)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


class AuthInterceptor(grpc.ServerInterceptor):
    """Checks every call of a sync server against an AccessPolicy."""

    def __init__(self, policy: AccessPolicy) -> None:
        self.policy = policy

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        problem = self.policy.check(handler_call_details.method, handler_call_details.invocation_metadata)
        return handler if handler is None or problem is None else _denying(handler, problem, aio=False)


class AioAuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call of a grpc.aio server against an AccessPolicy."""

    def __init__(self, policy: AccessPolicy) -> None:
        self.policy = policy

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        problem = self.policy.check(handler_call_details.method, handler_call_details.invocation_metadata)
        return handler if handler is None or problem is None else _denying(handler, problem, aio=True)


def server_interceptors(policy: AccessPolicy, aio: bool) -> list:
    if not policy.enabled:
        return []
    return [AioAuthInterceptor(policy) if aio else AuthInterceptor(policy)]


# ---- tokens on every call of a channel (client side) ----------------------------------------------

_SyncDetails = collections.namedtuple(
    "_SyncDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
)


class _CallDetails(_SyncDetails, grpc.ClientCallDetails):
    pass


def _with(metadata: tuple, extra: tuple) -> tuple:
    return tuple(metadata or ()) + extra


class _AddMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fixed metadata (the bearer token) to every call of a sync channel."""

    def __init__(self, metadata: tuple) -> None:
        self.metadata = metadata

    def _details(self, d):
        return _CallDetails(
            d.method,
            d.timeout,
            _with(d.metadata, self.metadata),
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    intercept_unary_stream = intercept_unary_unary
    intercept_stream_unary = intercept_unary_unary
    intercept_stream_stream = intercept_unary_unary


class _AioAddMetadata:
    """Adds fixed metadata (the bearer token) to every call of a grpc.aio channel. A grpc.aio channel
    files each interceptor under the first call kind it implements, so there is one class per kind."""

    def __init__(self, metadata: tuple) -> None:
        self.metadata = metadata

    async def _intercept(self, continuation, details, request):
        metadata = grpc.aio.Metadata(*_with(tuple(details.metadata or ()), self.metadata))
        try:
            return await continuation(details._replace(metadata=metadata), request)
        except grpc.aio.UsageError:  # the channel closed before the call started (later than without
            # interceptors): fail as a call cancelled by the closing channel does, with a status
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), "the channel was closed"
            ) from None


class _AioUnaryUnary(_AioAddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _AioAddMetadata._intercept


class _AioUnaryStream(_AioAddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _AioAddMetadata._intercept


class _AioStreamUnary(_AioAddMetadata, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _AioAddMetadata._intercept


class _AioStreamStream(_AioAddMetadata, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _AioAddMetadata._intercept


def open_channel(
    target: str,
    options: Sequence = (),
    credentials: grpc.ChannelCredentials | None = None,
    token: str | None = None,
    aio: bool = False,
):
    """A sync or grpc.aio channel: TLS when ``credentials`` are given, the token on every call."""
    options = list(options)
    if aio:
        kinds = (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)
        interceptors = [kind(bearer(token)) for kind in kinds] if token else None
        if credentials is None:
            return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)
    channel = (
        grpc.insecure_channel(target, options)
        if credentials is None
        else grpc.secure_channel(target, credentials, options)
    )
    return grpc.intercept_channel(channel, _AddMetadata(bearer(token))) if token else channel
