"""Log lines as text (the default) or as JSON objects, one a line, each carrying the request id when it
concerns a request.

The id travels in a context variable: the router sets it for the life of each ``Generate`` call (one
asyncio task per call, so tasks it starts inherit it), workers around the handling of each call.
``RequestContextFilter`` copies it onto every record, unless the call passed its own
(``extra={"request_id": ...}``), as the workers' loop thread does: it serves many requests at once.

    {"time": "2026-12-01T10:00:00.123Z", "level": "INFO", "logger": "splitserve.requests",
     "message": "request 1f2e-3 finished ...", "request_id": "1f2e-3", "outcome": "finished", ...}

Fields passed with ``extra=`` become fields of the JSON object; in text they are left out (the
message carries what a reader needs).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Literal

LogFormat = Literal["text", "json"]
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

REQUEST_ID: ContextVar[str | None] = ContextVar("splitserve_request_id", default=None)

# Attributes every LogRecord has; anything else on a record came with ``extra=`` (or a filter).
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Log lines made inside carry ``request_id``."""
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        try:
            REQUEST_ID.reset(token)
        except ValueError:  # closed from another context (a generator finalized elsewhere): nothing to undo here
            pass


class RequestContextFilter(logging.Filter):
    """Adds ``request_id`` (from the context) and fixed fields (a worker's id and role) to records."""

    def __init__(self, static: dict[str, str] | None = None) -> None:
        super().__init__()
        self.static = dict(static or {})

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            request_id = REQUEST_ID.get()
            if request_id is not None:
                record.request_id = request_id
        for key, value in self.static.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update((k, v) for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_"))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


def make_handler(log_format: LogFormat = "text", static: dict[str, str] | None = None, stream=None) -> logging.Handler:
    """A stream handler (stderr by default) writing ``log_format`` with the request context filled in."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format: {log_format!r} is not text or json")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RequestContextFilter(static))
    return handler


def configure_logging(
    log_format: LogFormat = "text", static: dict[str, str] | None = None, level: int = logging.INFO
) -> None:
    """The process's root handler (replacing one installed here before; other handlers are kept)."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_splitserve", False)]:
        root.removeHandler(old)
    handler = make_handler(log_format, static)
    handler._splitserve = True
    root.addHandler(handler)
    root.setLevel(level)
