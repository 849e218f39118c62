"""Transfer handles: the poll-able status a worker's loop reads instead of blocking on the network.

States::

    WAITING ──first payload──▶ TRANSFERRING ──all landed / acknowledged──▶ DONE
       │                             │
       └───────────┬─────────────────┘
                   ▼
          FAILED (error says why) | CANCELLED

Terminal states never change again. The handle changes state only through its own methods: ``start``
(the first payload), then one of ``complete``, ``fail`` and ``cancel``; each checks the move against
``_NEXT`` and returns False, changing nothing, where the move is not one (a later payload, or an end
that lost a race with another end). The handle's lock is held by whoever writes into the KV cache on its
behalf, so once ``cancel``/``fail`` returns, nothing touches the request's blocks any more and the owner
may free them.
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


# Where each state may go; any other move is refused (``_move``). WAITING may end at once: a transfer
# refused, cancelled or past its deadline before anything moved, or a hand-off whose parts all ended.
_NEXT: dict[TransferState, frozenset[TransferState]] = {
    TransferState.WAITING: frozenset(TransferState) - {TransferState.WAITING},
    TransferState.TRANSFERRING: frozenset(s for s in TransferState if s.terminal),
    TransferState.DONE: frozenset(),
    TransferState.FAILED: frozenset(),
    TransferState.CANCELLED: frozenset(),
}


class TransferHandle:
    def __init__(
        self, transfer_id: str, block_ids: tuple[int, ...], timeout_s: float, start_timeout_s: float | None = None
    ) -> None:
        """``timeout_s``: the whole transfer's deadline, from now; with ``start_timeout_s``, from ``begin``
        (the peer's first message), and until then the deadline is ``start_timeout_s`` from now."""
        self.transfer_id = transfer_id
        self.block_ids = block_ids
        self.created = time.monotonic()
        self.timeout_s = timeout_s
        self.begun_at: float | None = None if start_timeout_s is not None else self.created
        self.deadline = self.created + (timeout_s if start_timeout_s is None else start_timeout_s)
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

    def begin(self) -> None:
        """The peer's first message for this transfer arrived: the whole transfer's deadline runs from now (once;
        a handle given no start timeout runs it from its creation). Every message calls it: after the first, it
        returns without the lock."""
        if self.begun_at is not None:
            return
        with self.lock:
            if self.begun_at is None:
                self.begun_at = time.monotonic()
                self.deadline = self.begun_at + self.timeout_s

    def deadline_message(self) -> str:
        if self.begun_at is None:
            return f"no KV came within the transfer start deadline of {self.deadline - self.created:.1f}s"
        return f"transfer deadline of {self.deadline - self.begun_at:.1f}s passed"

    def start(self) -> bool:
        """The first payload was posted (sender) or landed (receiver): WAITING to TRANSFERRING, noting when.
        False, and no change, in any other state (every later payload calls it too)."""
        with self.lock:
            if not self._move(TransferState.TRANSFERRING):
                return False
            self.started_at = time.monotonic()
        return True

    def complete(self) -> bool:
        """Every byte landed (receiver) or was acknowledged (sender): DONE. False if already terminal.
        (Not ``finish``: ``KVSender.finish`` means every layer is computed, and ``SendHandle.finished`` says so.)"""
        return self._settle(TransferState.DONE)

    def fail(self, error: str) -> bool:
        """FAILED, ``error`` saying why. False (and the first end kept) if already terminal."""
        return self._settle(TransferState.FAILED, error)

    def cancel(self, reason: str) -> bool:
        """CANCELLED, ``reason`` saying by whom. False (and the first end kept) if already terminal."""
        return self._settle(TransferState.CANCELLED, reason)

    def _settle(self, state: TransferState, error: str = "") -> bool:
        """Move to terminal ``state`` and run the ``on_terminal`` callbacks; False (and no change) if the
        handle is terminal already. For ``complete``/``fail``/``cancel``, and for subclasses whose end is
        reported as a state (a part another rank moved, a hand-off ending as its first failed part)."""
        if not state.terminal:
            raise ValueError(f"state: {state.value!r} is not a terminal state; start() moves to transferring")
        with self.lock:
            if not self._move(state):
                return False
            self._error = error
            self.finished_at = time.monotonic()
            self._terminal.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)
        return True

    def _move(self, state: TransferState) -> bool:
        """The one place ``_state`` changes (caller holds the lock): to ``state`` if ``_NEXT`` allows it."""
        if state not in _NEXT[self._state]:
            return False
        self._state = state
        return True

    def __repr__(self) -> str:
        error = ", " + self._error if self._error else ""
        return f"{type(self).__name__}({self.transfer_id!r}, {self._state.value}{error})"
