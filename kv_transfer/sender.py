"""The prefill side: push a request's KV blocks to the decode worker the router chose.

``start`` opens (or reuses) the pair with that receiver; ``layers_ready`` queues whole layer groups as
the model finishes them (streaming), ``finish`` queues the rest and the commit payload. One lane
thread per pair gathers each message's blocks from the paged cache into a contiguous buffer, writes
its descriptor to the control stream and posts the payload on the pair's group, in FIFO order, while
the next message is already being gathered. The handle turns DONE when the receiver acknowledges
that every layer landed; only then (or on failure) may the owner release the blocks.

Tensor parallelism: a sender is one rank. ``start(..., heads=)`` sends only those of the model's KV heads
(the overlap of this rank's and the destination rank's ranges, as ``splitserve.kv_transfer.tp.parts.sends_for``
lists them); by default every head this rank holds. Each descriptor names the heads it carries.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from splitserve.common.arith import ceil_div
from splitserve.common.faults import FaultHooks
from splitserve.engine.kv_cache.cache import KVCache
from splitserve.engine.tp.layout import HeadRange
from splitserve.kv_transfer.comm import (
    Communicator,
    CommunicatorFactory,
    TransferError,
    choose_backend,
    connect_store,
    open_communicator,
)
from splitserve.kv_transfer.config import TransferConfig
from splitserve.kv_transfer.control import (
    Ack,
    AckStatus,
    Cancel,
    ControlConnection,
    DescriptorBytes,
    Hello,
    PairClosed,
    Welcome,
)
from splitserve.kv_transfer.descriptor import (
    PROTOCOL_VERSION,
    Commit,
    LayoutFingerprint,
    PayloadDescriptor,
    encode_descriptor,
)
from splitserve.kv_transfer.endpoint import Endpoint
from splitserve.kv_transfer.handles import TransferHandle
from splitserve.kv_transfer.tp.heads import check_cache_heads, gather_heads

log = logging.getLogger("splitserve.kv_transfer")


@dataclass(frozen=True)
class PeerAddress:
    """Where a receiver is: its id, its incarnation ("" = whichever is there) and its control address."""

    receiver_id: str
    incarnation: str
    control: str


class SendHandle(TransferHandle):
    def __init__(
        self,
        transfer_id: str,
        block_ids: tuple[int, ...],
        num_tokens: int,
        num_layers: int,
        streaming: bool,
        timeout_s: float,
        device: torch.device,
        heads: HeadRange,
        local_heads: tuple[int, int],
        unit_bytes: int,
    ) -> None:
        super().__init__(transfer_id, block_ids, timeout_s)
        self.src = torch.tensor(block_ids, dtype=torch.long, device=device)
        self.heads = heads  # the model's KV heads it sends
        self.local_heads = local_heads  # the same, in this rank's cache numbering (dimension 3)
        self.unit_bytes = unit_bytes  # bytes of one (layer, block) of those heads
        self.num_tokens, self.num_layers, self.streaming = num_tokens, num_layers, streaming
        self.layers_queued = 0  # layers [0, layers_queued) are queued
        self.finished = False  # finish() called: everything is queued
        self.pair: _SenderPair | None = None


@dataclass
class _Message:
    handle: SendHandle
    layer_start: int
    layer_end: int
    block_start: int
    block_end: int
    last: bool
    commit: Commit | None


class _SenderPair:
    def __init__(self, peer: PeerAddress) -> None:
        self.peer = peer
        self.queue: queue.Queue[_Message | None] = queue.Queue()
        self.conn: ControlConnection | None = None
        self.comm: Communicator | None = None
        self.store = None  # the rendezvous client, kept alive as long as the group
        self.staging = [torch.empty(0), torch.empty(0)]  # reused gather buffers, one per message in flight
        self.flip = 0
        self.queue_closed = False
        self.broken = threading.Event()
        self.transfers: set[str] = set()
        self.next_seq = 0
        self.last_used = time.monotonic()


class KVSender(Endpoint):
    role = "sender"

    def __init__(
        self,
        cache: KVCache,
        fingerprint: LayoutFingerprint,
        sender_id: str,
        connect: Callable[[PeerAddress], ControlConnection],
        host: str = "127.0.0.1",
        config: TransferConfig | None = None,
        communicator_factory: CommunicatorFactory = open_communicator,
        faults: FaultHooks | None = None,  # the process's fault hooks (tests); None: none
    ) -> None:
        super().__init__(config, faults)
        self.cache, self.fingerprint, self.sender_id, self.host = cache, fingerprint, sender_id, host
        check_cache_heads(cache, fingerprint)
        self.incarnation = uuid.uuid4().hex
        self.backend = choose_backend(cache.device, self.config.backend)
        self._connect = connect
        self._open_communicator = communicator_factory
        self._pairs: OrderedDict[PeerAddress, _SenderPair] = OrderedDict()  # least recently used first

    # ---- the prefill worker's side --------------------------------------------------------------

    def start(
        self,
        transfer_id: str,
        peer: PeerAddress,
        block_ids: Sequence[int],
        num_tokens: int,
        timeout_s: float | None = None,
        heads: HeadRange | None = None,
    ) -> SendHandle:
        """Begin pushing a request's KV (its blocks in token order) to ``peer``; returns at once.

        ``heads``: the model's KV heads to send (those the destination rank holds among this rank's);
        None: every head of this rank."""
        fp = self.fingerprint
        if ceil_div(num_tokens, fp.block_size) != len(block_ids):
            raise ValueError(
                f"block_ids: {len(block_ids)} blocks for {num_tokens} tokens of block size {fp.block_size}"
            )
        heads = heads or fp.heads
        if heads.overlap(fp.heads) != heads:
            raise ValueError(
                f"heads: [{heads.start}, {heads.stop}) are not all held by this rank ([{fp.heads.start}, "
                f"{fp.heads.stop}))"
            )
        unit_bytes = fp.bytes_per_block_layer_of(heads.count)
        total = fp.num_layers * len(block_ids) * unit_bytes
        handle = SendHandle(
            transfer_id,
            tuple(block_ids),
            num_tokens,
            fp.num_layers,
            total > self.config.whole_request_bytes,
            timeout_s or self.config.transfer_timeout_s,
            self.cache.device,
            heads,
            (heads.start - fp.heads_start, heads.stop - fp.heads_start),
            unit_bytes,
        )
        with self._lock:
            if transfer_id in self._transfers:
                raise ValueError(f"transfer_id: {transfer_id!r} is already being sent")
            self._transfers[transfer_id] = handle
            pair = self._pair_for(peer)
            handle.pair = pair
            pair.transfers.add(transfer_id)
        return handle

    def layers_ready(self, handle: SendHandle, num_layers: int) -> None:
        """Layers [0, num_layers) of the request are computed: queue every whole layer group among them."""
        if not handle.streaming or handle.finished:
            return
        group = self.config.layer_group_size
        end = (min(num_layers, handle.num_layers) // group) * group
        if end > handle.layers_queued and end < handle.num_layers:
            self._queue(handle, handle.layers_queued, end, last=False, commit=None)

    def finish(self, handle: SendHandle, commit: Commit | None = None) -> None:
        """All layers are computed: queue what is left; ``commit`` travels with the last message."""
        if handle.finished:
            raise ValueError(f"transfer {handle.transfer_id!r}: finish() called twice")
        handle.finished = True
        self._queue(handle, handle.layers_queued, handle.num_layers, last=True, commit=commit)

    def cancel(self, transfer_id: str, reason: str = "cancelled by the sender") -> None:
        """Stop a transfer: nothing more is sent for it (a payload already posted completes) and the
        receiver is told."""
        handle = self._transfers.get(transfer_id)
        if handle is not None and handle.cancel(reason):
            self._tell_receiver(handle, reason)

    def release(self, transfer_id: str) -> None:
        """Forget a transfer (cancelling it if still live); the owner then releases its blocks."""
        self.cancel(transfer_id)
        with self._lock:
            handle = self._transfers.pop(transfer_id, None)
            if handle is not None and handle.pair is not None:
                handle.pair.transfers.discard(transfer_id)

    # ---- planning messages ----------------------------------------------------------------------

    def _queue(self, handle: SendHandle, layer_start: int, layer_end: int, last: bool, commit: Commit | None) -> None:
        pair = handle.pair
        messages = self._plan(handle, layer_start, layer_end, last, commit, handle.unit_bytes)
        handle.layers_queued = layer_end
        for message in messages:
            pair.queue.put(message)

    def _plan(
        self, handle: SendHandle, l0: int, l1: int, last: bool, commit: Commit | None, per_unit: int | None = None
    ) -> list[_Message]:
        """Cut layers [l0, l1) of every block into messages of at most max_message_bytes, where one
        (layer, block) is ``per_unit`` bytes (default: every head of this rank)."""
        per_unit = per_unit or self.fingerprint.bytes_per_block_layer
        limit = self.config.max_message_bytes
        nb = len(handle.block_ids)
        layers_per_msg = max(1, min(l1 - l0, limit // (per_unit * nb)))
        blocks_per_msg = max(1, min(nb, limit // (per_unit * layers_per_msg)))
        messages = [
            _Message(handle, a, min(a + layers_per_msg, l1), b, min(b + blocks_per_msg, nb), False, None)
            for a in range(l0, l1, layers_per_msg)
            for b in range(0, nb, blocks_per_msg)
        ]
        if last:
            messages[-1].last, messages[-1].commit = True, commit
        return messages

    # ---- pairs ------------------------------------------------------------------------------------

    def _pair_for(self, peer: PeerAddress) -> _SenderPair:
        pair = self._pairs.get(peer)
        if pair is not None and not pair.broken.is_set():
            self._pairs.move_to_end(peer)
            pair.last_used = time.monotonic()
            return pair
        pair = self._pairs[peer] = _SenderPair(peer)
        self._spawn(self._lane, f"kv-send-{peer.receiver_id}", pair)
        idle = [p for p in self._pairs.values() if p is not pair and not self._busy(p)]
        for victim in idle[: max(0, len(self._pairs) - self.config.max_pairs)]:
            self._break(victim, "closed to stay within max_pairs")
        return pair

    def _busy(self, pair: _SenderPair) -> bool:
        return any(not h.terminal for t in pair.transfers if (h := self._transfers.get(t)) is not None)

    def _setup(self, pair: _SenderPair) -> None:
        cfg, peer = self.config, pair.peer
        pair.conn = self._connect(peer)
        pair.conn.send(
            Hello(PROTOCOL_VERSION, self.sender_id, self.incarnation, peer.incarnation, self.fingerprint, self.host)
        )
        try:
            welcome = pair.conn.receive(cfg.pair_setup_timeout_s)
        except queue.Empty:
            raise TransferError(f"no welcome from {peer.receiver_id} within {cfg.pair_setup_timeout_s:.1f}s") from None
        except PairClosed as e:
            raise TransferError(f"{peer.receiver_id} refused the pair: {e}") from None
        if not isinstance(welcome, Welcome):
            raise TransferError(f"{peer.receiver_id} sent {type(welcome).__name__} instead of a welcome")
        if welcome.backend != self.backend:
            raise TransferError(f"backend: receiver uses {welcome.backend}, this sender's KV needs {self.backend}")
        store = connect_store(welcome.store_host, welcome.store_port, cfg.pair_setup_timeout_s)
        pair.comm = self._open_communicator(
            self.backend, store, welcome.store_prefix, 0, self.host, cfg.op_timeout_s, self.cache.device
        )
        pair.store = store
        self._spawn(self._read_acks, "kv-send-acks", pair)

    def _lane(self, pair: _SenderPair) -> None:
        """Post messages in FIFO order, keeping two on the wire: while one is being received, the next
        one's descriptor is already with the receiver and its payload follows without a gap."""
        try:
            self._setup(pair)
        except Exception as e:
            self._break(pair, f"pair setup failed: {e}")
            return
        in_flight: deque = deque()
        ending = False
        while not pair.broken.is_set():
            while len(in_flight) < len(pair.staging) and not ending:
                message = self._next_message(pair, block=not in_flight)
                if message is None:
                    ending = not in_flight or pair.queue_closed
                    break
                self._fault_point(message.handle, message.handle.messages_moved)  # may pause, drop or die
                if pair.broken.is_set():
                    return
                if message.handle.terminal:  # cancelled while a fault point held it
                    continue
                data = self._gather(message, pair)
                try:
                    in_flight.append(self._post(pair, message, data))
                except TransferError as e:
                    self._break(pair, f"send failed: {e}")
                    return
            if not in_flight:
                return
            try:
                in_flight.popleft().wait(self.config.op_timeout_s)
            except TransferError as e:
                self._break(pair, f"send failed: {e}")
                return

    def _next_message(self, pair: _SenderPair, block: bool) -> _Message | None:
        """The next message of a live transfer; None when the queue is empty (not blocking) or closed."""
        while True:
            try:
                message = pair.queue.get() if block else pair.queue.get_nowait()
            except queue.Empty:
                return None
            if message is None:
                pair.queue_closed = True
                return None
            if not message.handle.terminal:
                return message

    def _gather(self, message: _Message, pair: _SenderPair) -> torch.Tensor:
        """Copy the message's blocks into the pair's next staging buffer (two alternate: one may be on
        the wire while the other fills)."""
        blocks = message.handle.src[message.block_start : message.block_end]
        layers = range(message.layer_start, message.layer_end)
        h0, h1 = message.handle.local_heads
        spec = self.cache.spec
        elems = len(layers) * len(blocks) * 2 * (h1 - h0) * spec.block_size * spec.head_dim
        pair.flip ^= 1
        if pair.staging[pair.flip].numel() < elems:
            pair.staging[pair.flip] = torch.empty(elems, dtype=self.cache.tensor.dtype, device=self.cache.device)
        return gather_heads(self.cache, blocks, layers, h0, h1, out=pair.staging[pair.flip])

    def _post(self, pair: _SenderPair, message: _Message, data: torch.Tensor):
        handle = message.handle
        desc = PayloadDescriptor(
            seq=pair.next_seq,
            transfer_id=handle.transfer_id,
            layer_start=message.layer_start,
            layer_end=message.layer_end,
            block_start=message.block_start,
            block_end=message.block_end,
            num_blocks=len(handle.block_ids),
            num_tokens=handle.num_tokens,
            dtype=self.fingerprint.dtype,
            shape=tuple(data.shape),
            nbytes=data.numel() * data.element_size(),
            last=message.last,
            commit=message.commit,
            heads=(handle.heads.start, handle.heads.stop),
        )
        pair.next_seq += 1
        handle.messages_moved += 1  # only this pair's lane thread posts for the handle
        handle.start()
        handle.nbytes += desc.nbytes
        pair.conn.send(DescriptorBytes(encode_descriptor(desc)))
        return pair.comm.isend(data.reshape(-1).view(torch.uint8))

    def _read_acks(self, pair: _SenderPair) -> None:
        while True:
            try:
                ack = pair.conn.receive()
            except PairClosed as e:
                self._break(pair, str(e))
                return
            if not isinstance(ack, Ack):
                self._break(pair, f"unexpected {type(ack).__name__} from the receiver")
                return
            handle = self._transfers.get(ack.transfer_id)
            if handle is None:
                continue
            if ack.status is AckStatus.DONE:
                handle.complete()
            elif ack.status is AckStatus.CANCELLED:
                handle.cancel(ack.error or "cancelled by the receiver")
            elif ack.status in (AckStatus.REFUSED, AckStatus.FAILED):
                handle.fail(f"receiver: {ack.error}")

    def _break(self, pair: _SenderPair, reason: str) -> None:
        with self._lock:
            if pair.broken.is_set():
                return
            pair.broken.set()
            if self._pairs.get(pair.peer) is pair:
                del self._pairs[pair.peer]
        log.info("kv pair with %s broken: %s", pair.peer.receiver_id, reason)
        if pair.comm is not None:
            pair.comm.abort()
        if pair.conn is not None:
            pair.conn.close()
        for transfer_id in list(pair.transfers):
            handle = self._transfers.get(transfer_id)
            if handle is not None:
                handle.fail(f"pair with {pair.peer.receiver_id} broke: {reason}")
        pair.queue.put(None)

    def _tell_receiver(self, handle: SendHandle, reason: str) -> None:
        pair = handle.pair
        if pair is not None and pair.conn is not None and not pair.broken.is_set():
            pair.conn.send(Cancel(handle.transfer_id, reason))

    def _on_deadline(self, handle: SendHandle, message: str) -> None:
        self._tell_receiver(handle, message)
