"""The one error a request's handling raises to end its call: a gRPC status name and a message.

Every layer raises it (the router refusing a request, a worker that cannot run one, a KV receiver
refusing a pair); ``splitserve.rpc.status`` turns it into the call's gRPC status in one place, and
the OpenAI front end maps the same names to HTTP. Torch-free and gRPC-free: the code is the status's
name, checked here against gRPC's list, so this module can sit below everything.
"""

from __future__ import annotations

from typing import Literal, get_args

# grpc.StatusCode's names, less OK (an error never ends a call successfully). A test checks the two agree.
StatusName = Literal[
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
]
STATUS_NAMES: frozenset[str] = frozenset(get_args(StatusName))


class ServingError(Exception):
    """Ends a call with ``code`` (a gRPC status name) and ``message`` (which names the bad field or id).

    ``str(error)`` is the message alone, as the client sees it in the status details."""

    def __init__(self, code: StatusName, message: str) -> None:
        if code not in STATUS_NAMES:
            raise ValueError(f"code: {code!r} is not a gRPC status name (one of {', '.join(sorted(STATUS_NAMES))})")
        super().__init__(message)
        self.code, self.message = code, message

    def __reduce__(self):
        # Exception pickles only ``args`` (the message): keep the code across processes.
        return type(self), (self.code, self.message)

    def __repr__(self) -> str:
        return f"ServingError({self.code!r}, {self.message!r})"
