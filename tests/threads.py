"""Side work of a test on a thread, without losing what it raised.

An ``assert`` on a plain thread fails only that thread: the test passes on. ``Background`` keeps the
thread's return value or exception, and ``result(timeout_s)`` joins it with a deadline, fails the test
if it is still running, re-raises what it raised, and returns what it returned.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Background:
    def __init__(self, fn: Callable[..., Any], *args: Any, name: str | None = None, **kwargs: Any) -> None:
        self.name = name or getattr(fn, "__name__", "background")
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args, kwargs), name=self.name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            self._value = fn(*args, **kwargs)
        except BaseException as e:  # kept for result(), which raises it in the test's own thread
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout_s: float) -> Any:
        """Join within ``timeout_s`` (failing the test past it); re-raise the thread's exception."""
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"{self.name} still running after {timeout_s}s"
        if self._error is not None:
            raise self._error
        return self._value
