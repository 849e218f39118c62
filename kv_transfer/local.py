"""An in-memory control stream to a ``KVReceiver`` in the same process (one thread per pair), instead of gRPC.

The payload still travels over a real torch.distributed pair group; only the control messages (hello,
descriptors, acks) stay in memory. ``splitserve profile`` uses it where the gRPC service is not importable
(``scripts/gpu_check.sh`` on a machine with torch alone), and the tests use it to run the pair protocol
without a server. Torch-free.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from splitserve.common.errors import ServingError
from splitserve.kv_transfer.control import ControlConnection, PairClosed, ReceiverMessage, SenderMessage

_END = object()
# How long close() waits for the receiver's side of the stream to end (it ends at the next message it
# reads, the end of the stream): a thread left inside the receiver at interpreter exit can end the process.
PAIR_JOIN_S = 5.0


class LocalConnection(ControlConnection):
    """The sender's end of an in-memory control stream; ``serve_pair`` is the receiver's
    (``KVReceiver.serve_pair``), run on a thread of its own."""

    def __init__(self, serve_pair: Callable[[Iterator[SenderMessage], Callable[[object], None]], None]) -> None:
        self._inbound: queue.Queue = queue.Queue()
        self._outbound: queue.Queue = queue.Queue()
        self._closed = threading.Event()

        def run() -> None:
            try:
                serve_pair(self._iterate(), self._outbound.put)
                self._outbound.put(PairClosed("receiver ended the pair"))
            except ServingError as e:  # the receiver refused the pair, or ended it with an error
                self._outbound.put(PairClosed(f"{e.code}: {e.message}", e))

        self._thread = threading.Thread(target=run, name="kv-local-pair", daemon=True)
        self._thread.start()

    def _iterate(self) -> Iterator[SenderMessage]:
        while True:
            item = self._inbound.get()
            if item is _END:
                return
            yield item

    def send(self, message: SenderMessage) -> None:
        if not self._closed.is_set():
            self._inbound.put(message)

    def receive(self, timeout_s: float | None = None) -> ReceiverMessage:
        item = self._outbound.get(timeout=timeout_s)
        if isinstance(item, PairClosed):
            self._outbound.put(item)  # stays closed for later readers
            raise item
        return item

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._inbound.put(_END)
        if self._thread is not threading.current_thread():
            self._thread.join(PAIR_JOIN_S)
