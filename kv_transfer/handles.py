"""Transfer handles: the poll-able status a worker's loop reads instead of blocking on the network.

States::

    WAITING ──first payload──▶ TRANSFERRING ──all landed / acknowledged──▶ DONE
       │                             │
       └───────────┬─────────────────┘
                   ▼
          FAILED (error says why) | CANCELLED

Terminal states never change again. The handle's lock is held by whoever writes into the KV cache on
its behalf, so once ``cancel``/``fail`` returns, nothing touches the request's blocks any more and the
owner may free them.
"""

from __future__ import annotations

import enum
import threading
import time


class TransferState(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED, TransferState.CANCELLED)


class TransferHandle:
    def __init__(self, transfer_id: str, block_ids: tuple[int, ...], timeout_s: float) -> None:
        self.transfer_id = transfer_id
        self.block_ids = block_ids
        self.created = time.monotonic()
        self.deadline = self.created + timeout_s
        self.lock = threading.RLock()
        self._state = TransferState.WAITING
        self._error = ""
        self._terminal = threading.Event()
        self._callbacks: list = []
        self.started_at: float | None = None  # the first payload was posted (sender) or landed (receiver)
        self.finished_at: float | None = None
        self.nbytes = 0  # payload bytes posted (sender) or landed (receiver) so far
        self.messages_moved = 0  # payload messages sent or received for it, counted for fault points

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def error(self) -> str:
        return self._error

    @property
    def terminal(self) -> bool:
        return self._state.terminal

    def wait(self, timeout_s: float | None = None) -> TransferState:
        """Block until terminal (tests and benchmarks; workers poll ``state`` instead)."""
        self._terminal.wait(timeout_s)
        return self._state

    def on_terminal(self, callback) -> None:
        """Call ``callback(handle)`` once the handle is terminal (at once if it already is), from the
        thread that ends it: keep it short, and never block in it."""
        with self.lock:
            if not self._state.terminal:
                self._callbacks.append(callback)
                return
        callback(self)

    @property
    def active_s(self) -> float | None:
        """First payload to the end, for a transfer that moved anything and ended (metrics)."""
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at

    def _start(self) -> None:
        with self.lock:
            if self._state is TransferState.WAITING:
                self._state = TransferState.TRANSFERRING
                self.started_at = time.monotonic()

    def _end(self, state: TransferState, error: str = "") -> bool:
        """Move to a terminal state; False (and no change) if it already is terminal."""
        assert state.terminal
        with self.lock:
            if self._state.terminal:
                return False
            self._state, self._error = state, error
            self.finished_at = time.monotonic()
            self._terminal.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)
        return True

    def __repr__(self) -> str:
        error = ", " + self._error if self._error else ""
        return f"{type(self).__name__}({self.transfer_id!r}, {self._state.value}{error})"
