"""Errors in OpenAI's shape, and the router's ServingErrors (gRPC status names) mapped to HTTP statuses.

{"error": {"message": "temperature: must be >= 0.0, got -1.0", "type": "invalid_request_error",
           "param": "temperature", "code": "invalid_value"}}
"""

from __future__ import annotations

import json

from aiohttp import web

from splitserve.common.errors import ServingError, StatusName

# A ServingError's code (a gRPC status name) -> HTTP status, error type, code; any other code is a 500.
_FROM_STATUS: dict[StatusName, tuple[int, str, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", "invalid_value"),
    "UNAUTHENTICATED": (401, "invalid_request_error", "invalid_api_key"),
    "NOT_FOUND": (404, "invalid_request_error", "not_found"),
    "ALREADY_EXISTS": (409, "invalid_request_error", "conflict"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", "rate_limit_exceeded"),
    "UNAVAILABLE": (503, "server_error", "service_unavailable"),
}
_INTERNAL = (500, "server_error", "internal_error")
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class OpenAIError(Exception):
    """Ends an HTTP request with ``status`` and OpenAI's error object."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, type_: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _TYPES.get(status, "server_error")

    @classmethod
    def from_error(cls, error: ServingError, message: str | None = None, param: str | None = None) -> OpenAIError:
        """The HTTP error for the router's ``error``; ``message`` replaces its message when given."""
        status, type_, code = _FROM_STATUS.get(error.code, _INTERNAL)
        return cls(status, error.message if message is None else message, param, code, type_)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        # The openai client retries a 409 unless told not to: a duplicate request id stays one.
        headers = {"x-should-retry": "false"} if self.status == 409 else None
        return web.json_response(self.body(), status=self.status, dumps=dumps, headers=headers)


def invalid(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    """A 400 whose message starts with the parameter's name, as the router's messages do."""
    return OpenAIError(400, f"{param}: {message}", param, code)


def unsupported(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param, "unsupported_parameter")


def dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
