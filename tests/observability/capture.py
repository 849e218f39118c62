"""Capture what a logger writes through splitserve's JSON handler."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def json_log_lines(logger_name: str = "splitserve") -> Iterator[callable]:
    """Yields a function returning the JSON objects logged (at INFO or above) so far."""
    from splitserve.observability.logs import make_handler

    stream = io.StringIO()
    handler = make_handler("json", stream=stream)
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel, not assignment: it clears the loggers' cached levels
    logger.addHandler(handler)
    try:
        yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
