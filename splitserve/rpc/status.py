"""ServingError <-> gRPC status: the one place a request's error becomes its call's status, and back.

Servicers end a call with ``abort`` (sync servers) or ``await abort_async`` (grpc.aio servers); a
client that relays a peer's failure rebuilds the error with ``from_status``.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from splitserve.common.errors import ServingError


def status_code(error: ServingError) -> grpc.StatusCode:
    return grpc.StatusCode[error.code]


def from_status(code: grpc.StatusCode, details: str | None) -> ServingError:
    """The error a call ended with (``code`` must not be OK)."""
    return ServingError(code.name, details or "")


def abort(context: grpc.ServicerContext, error: ServingError) -> NoReturn:
    """End a sync server's call with the error's status (raises, as ``context.abort`` does)."""
    context.abort(status_code(error), error.message)


async def abort_async(context: grpc.aio.ServicerContext, error: ServingError) -> NoReturn:
    """End a grpc.aio server's call with the error's status (raises, as ``context.abort`` does)."""
    await context.abort(status_code(error), error.message)
