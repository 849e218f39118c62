"""Control-path messages of a pair, as plain dataclasses, and the channel abstraction they travel on.

The sender and receiver state machines speak these types only; ``splitserve.kv_transfer.service`` maps them to
the gRPC service in ``proto/splitserve/rpc/kv_transfer.proto``, and ``local_connection`` carries them
in memory (tests, and the GPU check, which runs without gRPC). Torch-free.
"""

from __future__ import annotations

import enum
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from splitserve.common.errors import ServingError
from splitserve.kv_transfer.descriptor import LayoutFingerprint


@dataclass(frozen=True)
class Hello:
    protocol_version: int
    sender_id: str
    sender_incarnation: str
    receiver_incarnation: str  # the one the sender expects ("" = any)
    fingerprint: LayoutFingerprint
    sender_host: str


@dataclass(frozen=True)
class Welcome:
    protocol_version: int
    receiver_id: str
    receiver_incarnation: str
    generation: int
    store_host: str
    store_port: int
    store_prefix: str
    backend: str


class AckStatus(enum.Enum):
    LANDED = 1
    DONE = 2
    REFUSED = 3
    CANCELLED = 4
    FAILED = 5


@dataclass(frozen=True)
class Ack:
    transfer_id: str
    seq: int
    status: AckStatus
    error: str = ""


@dataclass(frozen=True)
class Cancel:
    transfer_id: str
    reason: str


@dataclass(frozen=True)
class DescriptorBytes:
    """A payload descriptor exactly as it travels (msgpack); the receiver decodes it strictly."""

    data: bytes


SenderMessage = Hello | DescriptorBytes | Cancel
ReceiverMessage = Welcome | Ack


class PairClosed(Exception):
    """The control stream ended (peer gone, cancelled, or refused: then ``refusal`` says why)."""

    def __init__(self, message: str, refusal: ServingError | None = None) -> None:
        super().__init__(message)
        self.refusal = refusal


class ControlConnection(ABC):
    """The sender's end of one pair's control stream."""

    @abstractmethod
    def send(self, message: SenderMessage) -> None:
        """Queue a message for the receiver (never blocks on the network)."""

    @abstractmethod
    def receive(self, timeout_s: float | None = None) -> ReceiverMessage:
        """The next message; raises PairClosed when the stream ended, queue.Empty on timeout."""

    @abstractmethod
    def close(self) -> None:
        """End the stream (idempotent); the receiver sees its inbound side end."""


_END = object()


class LocalConnection(ControlConnection):
    """An in-memory control stream to a receiver in the same process (one thread per pair)."""

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

        threading.Thread(target=run, name="kv-local-pair", daemon=True).start()

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
