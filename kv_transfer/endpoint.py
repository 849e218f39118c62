"""What the sender and the receiver share: the transfer table, fault points and deadline enforcement."""

from __future__ import annotations

import logging
import threading
import time

from splitserve.common.faults import NO_FAULTS, FaultHooks
from splitserve.engine.threads import serial_torch
from splitserve.kv_transfer.config import Role, TransferConfig
from splitserve.kv_transfer.handles import TransferHandle

# How often the deadline watcher looks at the open transfers: a transfer fails at most this long after
# its deadline passes (deadlines are seconds; 50 ms is well inside them and costs nothing).
DEADLINE_POLL_S = 0.05
# How long close() waits for the endpoint's threads (deadline watcher, pair lanes, ack readers) to end once
# its pairs are broken: a thread still inside a gloo call when the interpreter exits ends the process with
# std::terminate ("terminate called without an active exception").
THREADS_JOIN_S = 5.0

log = logging.getLogger("splitserve.kv_transfer")


class Endpoint:
    role: Role

    def __init__(self, config: TransferConfig | None, faults: FaultHooks | None = None) -> None:
        self.config = config or TransferConfig()
        self.faults = faults if faults is not None else NO_FAULTS  # the process's fault hooks (tests)
        self._lock = threading.RLock()
        self._transfers: dict[str, TransferHandle] = {}
        self._pairs: dict = {}
        self._closed = threading.Event()
        # This endpoint's threads, kept until they have ended (pruned at each spawn): ``close`` joins every one
        # still alive. A thread does not take itself out as it finishes, which would leave a window in which
        # ``close`` no longer sees it and it still runs.
        self._threads: set[threading.Thread] = set()
        self._spawn(self._watch_deadlines, f"kv-{self.role}-deadlines")

    def _spawn(self, target, name: str, *args) -> None:
        """Start a daemon thread that ``close`` waits for."""

        def run() -> None:
            serial_torch()  # the model's thread keeps the cores' OpenMP team (engine.threads)
            target(*args)

        thread = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:  # started under the lock, so that no other spawn prunes it before it is alive
            self._threads = {t for t in self._threads if t.is_alive()}
            self._threads.add(thread)
            thread.start()

    def num_pairs(self) -> int:
        return len(self._pairs)

    def num_transfers(self) -> int:
        """Transfers registered here (live, or ended but not released)."""
        return len(self._transfers)

    def has_transfer(self, transfer_id: str) -> bool:
        """Whether a transfer with this id is registered (live, or ended but not released)."""
        return transfer_id in self._transfers

    def close(self) -> None:
        """Break every pair (their transfers fail, their groups are aborted), then wait up to
        ``THREADS_JOIN_S`` for this endpoint's threads to end."""
        self._closed.set()
        for pair in list(self._pairs.values()):
            self._break(pair, f"{self.role} closed")
        deadline = time.monotonic() + THREADS_JOIN_S
        with self._lock:
            threads = [t for t in self._threads if t is not threading.current_thread()]
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _break(self, pair, reason: str) -> None:
        raise NotImplementedError

    def _on_deadline(self, handle: TransferHandle, message: str) -> None:
        """Tell the peer that a transfer failed on its deadline."""
        raise NotImplementedError

    def _fault_point(self, handle: TransferHandle | None, messages_done: int) -> None:
        """Apply the fault point that fires for this transfer at ``messages_done`` of its messages, if
        any: pause or die in the hook, drop here. The sender checks before it posts the next message (so
        a pause holds the rest of the transfer back), the receiver once a message has arrived. ``None``:
        a message for a transfer this endpoint does not know (refused anyway)."""
        if handle is not None and self.faults.transfer(self.role, handle.transfer_id, messages_done):
            for pair in list(self._pairs.values()):
                self._break(pair, "fault point: connection dropped")

    def _watch_deadlines(self) -> None:
        while not self._closed.wait(DEADLINE_POLL_S):
            now = time.monotonic()
            for handle in list(self._transfers.values()):
                if not handle.terminal and now > handle.deadline:
                    message = handle.deadline_message()
                    if handle.fail(message):
                        self._on_deadline(handle, message)
