"""Control-path messages of a pair, as plain dataclasses, and the channel abstraction they travel on.

The sender and receiver state machines speak these types only; ``splitserve.kv_transfer.service`` maps them to
the gRPC service in ``proto/splitserve/rpc/kv_transfer.proto``; the tests carry them in memory
(``splitserve.kv_transfer.local``). Torch-free.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
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
