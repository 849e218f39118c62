"""The KV-transfer control path over gRPC (``proto/splitserve/rpc/kv_transfer.proto``).

The decode worker serves ``KVTransfer.Pair`` (``KVTransferServicer``, or ``serve`` for a standalone
server); a prefill worker's ``KVSender`` dials it through ``GrpcConnection``. Protobuf lives at this
edge only: the sender and receiver speak the dataclasses of ``splitserve.kv_transfer.control``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc

from splitserve.common.errors import ServingError
from splitserve.engine.threads import serial_torch
from splitserve.kv_transfer.control import (
    Ack,
    AckStatus,
    Cancel,
    ControlConnection,
    DescriptorBytes,
    Hello,
    PairClosed,
    ReceiverMessage,
    SenderMessage,
    Welcome,
)
from splitserve.kv_transfer.descriptor import DescriptorError, LayoutFingerprint
from splitserve.kv_transfer.receiver import KVReceiver
from splitserve.rpc import kv_transfer_pb2 as pb
from splitserve.rpc import kv_transfer_pb2_grpc as pb_grpc
from splitserve.rpc.auth import server_interceptors
from splitserve.rpc.options import CLIENT_OPTIONS, SERVER_OPTIONS
from splitserve.rpc.security import InternalSecurity
from splitserve.rpc.status import abort, from_status

# ---- protobuf at the edge ------------------------------------------------------------------------


def _fingerprint_to_pb(fp: LayoutFingerprint) -> pb.LayoutFingerprint:
    return pb.LayoutFingerprint(
        model=fp.model,
        dtype=fp.dtype,
        block_size=fp.block_size,
        num_layers=fp.num_layers,
        num_kv_heads=fp.num_kv_heads,
        head_dim=fp.head_dim,
        weights_checksum=fp.weights_checksum,
        tp_size=fp.tp_size,
        tp_rank=fp.tp_rank,
        heads_start=fp.heads_start,
        heads_stop=fp.heads_stop,
    )


def _fingerprint_from_pb(f: pb.LayoutFingerprint) -> LayoutFingerprint:
    """proto3 leaves an unset field 0: a TP-1 sender that predates the TP fields reads as TP 1."""
    try:
        return LayoutFingerprint(
            f.model,
            f.dtype,
            f.block_size,
            f.num_layers,
            f.num_kv_heads,
            f.head_dim,
            f.weights_checksum,
            tp_size=f.tp_size or 1,
            tp_rank=f.tp_rank,
            heads_start=f.heads_start,
            heads_stop=f.heads_stop,
        )
    except DescriptorError as e:  # names the field
        raise ServingError("INVALID_ARGUMENT", f"fingerprint: {e}") from None


def sender_to_pb(message: SenderMessage) -> pb.SenderMessage:
    if isinstance(message, Hello):
        return pb.SenderMessage(
            hello=pb.Hello(
                protocol_version=message.protocol_version,
                sender_id=message.sender_id,
                sender_incarnation=message.sender_incarnation,
                receiver_incarnation=message.receiver_incarnation,
                fingerprint=_fingerprint_to_pb(message.fingerprint),
                sender_host=message.sender_host,
            )
        )
    if isinstance(message, DescriptorBytes):
        return pb.SenderMessage(descriptor=message.data)
    return pb.SenderMessage(cancel=pb.Cancel(transfer_id=message.transfer_id, reason=message.reason))


def sender_from_pb(message: pb.SenderMessage) -> SenderMessage:
    kind = message.WhichOneof("kind")
    if kind == "hello":
        h, f = message.hello, message.hello.fingerprint
        fp = _fingerprint_from_pb(f)
        return Hello(h.protocol_version, h.sender_id, h.sender_incarnation, h.receiver_incarnation, fp, h.sender_host)
    if kind == "descriptor":
        return DescriptorBytes(message.descriptor)
    if kind == "cancel":
        return Cancel(message.cancel.transfer_id, message.cancel.reason)
    raise ServingError("INVALID_ARGUMENT", "sender message: no kind set")


def receiver_to_pb(message: ReceiverMessage) -> pb.ReceiverMessage:
    if isinstance(message, Welcome):
        return pb.ReceiverMessage(
            welcome=pb.Welcome(
                protocol_version=message.protocol_version,
                receiver_id=message.receiver_id,
                receiver_incarnation=message.receiver_incarnation,
                generation=message.generation,
                store_host=message.store_host,
                store_port=message.store_port,
                store_prefix=message.store_prefix,
                backend=message.backend,
            )
        )
    return pb.ReceiverMessage(
        ack=pb.Ack(transfer_id=message.transfer_id, seq=message.seq, status=message.status.value, error=message.error)
    )


def receiver_from_pb(message: pb.ReceiverMessage) -> ReceiverMessage:
    if message.WhichOneof("kind") == "welcome":
        w = message.welcome
        return Welcome(
            w.protocol_version,
            w.receiver_id,
            w.receiver_incarnation,
            w.generation,
            w.store_host,
            w.store_port,
            w.store_prefix,
            w.backend,
        )
    a = message.ack
    try:
        status = AckStatus(a.status)
    except ValueError:
        raise PairClosed(f"receiver sent an ack with unknown status {a.status}") from None
    return Ack(a.transfer_id, a.seq, status, a.error)


# ---- server side ---------------------------------------------------------------------------------


class KVTransferServicer(pb_grpc.KVTransferServicer):
    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver

    def Pair(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        outbox: queue.Queue = queue.Queue()

        def inbound() -> Iterator[SenderMessage]:
            try:
                for message in request_iterator:
                    yield sender_from_pb(message)
            except grpc.RpcError:  # the sender went away: the stream simply ends
                return

        def run() -> None:
            try:
                self.receiver.serve_pair(inbound(), outbox.put)
                outbox.put(PairClosed("sender closed the pair"))
            except ServingError as e:
                outbox.put(e)
            except Exception as e:  # a bug must end this pair, never the server
                outbox.put(ServingError("INTERNAL", f"{type(e).__name__}: {e}"))

        threading.Thread(target=run, name="kv-pair-session", daemon=True).start()
        while True:
            item = outbox.get()
            if isinstance(item, ServingError):
                abort(context, item)
            if isinstance(item, PairClosed):
                if str(item) != "sender closed the pair":
                    context.abort(grpc.StatusCode.UNAVAILABLE, f"pair closed: {item}")
                return
            yield receiver_to_pb(item)


# Handler threads beyond one per pair's control stream: room for the unary calls (Expect, Release,
# status) that arrive while every pair's stream is open.
UNARY_CALL_THREADS = 8


def serve(
    receiver: KVReceiver, host: str = "127.0.0.1", port: int = 0, security: InternalSecurity | None = None
) -> tuple[grpc.Server, int]:
    """A standalone gRPC server for a receiver, bound to ``host`` only (mTLS and the cluster token
    when ``security`` says so); returns (server, port)."""
    security = security or InternalSecurity()
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=receiver.config.max_pairs + UNARY_CALL_THREADS, initializer=serial_torch
        ),
        options=SERVER_OPTIONS,
        interceptors=server_interceptors(security.policy(), aio=False),
    )
    pb_grpc.add_KVTransferServicer_to_server(KVTransferServicer(receiver), server)
    bound = security.add_port(server, f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the KV transfer service to {host}:{port}")
    server.start()
    return server, bound


# ---- client side ---------------------------------------------------------------------------------

_END = object()


class GrpcConnection(ControlConnection):
    """The sender's end of a pair's control stream, dialled to ``target`` ("host:port"), over mTLS
    and with the cluster token when ``security`` says so."""

    def __init__(self, target: str, security: InternalSecurity | None = None) -> None:
        self._channel = (security or InternalSecurity()).channel(target, CLIENT_OPTIONS)
        self._outbox: queue.Queue = queue.Queue()
        self._inbox: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._call = pb_grpc.KVTransferStub(self._channel).Pair(self._requests())
        threading.Thread(target=self._read, name="kv-grpc-read", daemon=True).start()

    def _requests(self):
        while True:
            item = self._outbox.get()
            if item is _END:
                return
            yield item

    def _read(self) -> None:
        try:
            for message in self._call:
                self._inbox.put(receiver_from_pb(message))
            self._inbox.put(PairClosed("receiver ended the pair"))
        except grpc.RpcError as e:
            code = e.code()
            refusal = from_status(code, e.details()) if code != grpc.StatusCode.CANCELLED else None
            self._inbox.put(PairClosed(f"{code.name}: {e.details()}", refusal))
        except PairClosed as e:
            self._inbox.put(e)

    def send(self, message: SenderMessage) -> None:
        if not self._closed.is_set():
            self._outbox.put(sender_to_pb(message))

    def receive(self, timeout_s: float | None = None) -> ReceiverMessage:
        item = self._inbox.get(timeout=timeout_s)
        if isinstance(item, PairClosed):
            self._inbox.put(item)
            raise item
        return item

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._outbox.put(_END)
        self._call.cancel()
        self._channel.close()
