"""The decode side: lease-backed transfer expectations, pair sessions, and the FIFO receive lane.

A decode worker leases blocks for a request, then calls ``expect(transfer_id, block_ids)``. Senders
open pair sessions (``serve_pair``, one control stream and one thread each); each pair's lane thread
posts receives strictly in descriptor order (one FIFO per pair, as NCCL requires), lands every
payload in a staging buffer and scatters it into the leased blocks. Every payload that was described
is received, even for a transfer that is no longer wanted (then it is dropped), so the FIFO never
desynchronises; anything that could desynchronise it (a malformed descriptor, a transport error, a
timeout) breaks the pair instead: its transfers fail, its group is aborted, the sender rebuilds.

Tensor parallelism: the receiver is one rank and ``expect`` leases its blocks for its heads only. The
parts of a transfer may arrive on several pairs (one per sending rank that holds some of those heads,
``splitserve.engine.tp.layout.transfer_pairs``); each descriptor names its heads, which must lie inside
both this rank's range and the sender's, and the transfer is DONE once every (layer, block, head) has
landed exactly once. Every pair that contributed is then acknowledged (docs/kv_transfer.md).
"""

from __future__ import annotations

import itertools
import logging
import queue
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import torch

from splitserve.common.arith import ceil_div
from splitserve.common.errors import ServingError
from splitserve.common.faults import FaultHooks
from splitserve.engine.kv_cache.cache import KVCache
from splitserve.engine.tp.layout import HeadRange
from splitserve.kv_transfer.comm import (
    Communicator,
    CommunicatorFactory,
    TransferError,
    bind_store,
    choose_backend,
    open_communicator,
)
from splitserve.kv_transfer.config import TransferConfig
from splitserve.kv_transfer.control import (
    Ack,
    AckStatus,
    Cancel,
    DescriptorBytes,
    Hello,
    PairClosed,
    ReceiverMessage,
    SenderMessage,
    Welcome,
)
from splitserve.kv_transfer.descriptor import (
    PROTOCOL_VERSION,
    Commit,
    DescriptorError,
    LayoutFingerprint,
    PayloadDescriptor,
    decode_descriptor,
)
from splitserve.kv_transfer.endpoint import Endpoint
from splitserve.kv_transfer.handles import TransferHandle, TransferState
from splitserve.kv_transfer.tp.heads import check_cache_heads, scatter_heads

log = logging.getLogger("splitserve.kv_transfer")


class ReceiveHandle(TransferHandle):
    """One expected transfer into leased blocks; DONE once every (layer, block, head) has landed."""

    def __init__(
        self,
        transfer_id: str,
        block_ids: tuple[int, ...],
        timeout_s: float,
        device: torch.device,
        start_timeout_s: float | None = None,
    ) -> None:
        super().__init__(transfer_id, block_ids, timeout_s, start_timeout_s)
        self.dest = torch.tensor(block_ids, dtype=torch.long, device=device)
        self.num_blocks: int | None = None  # set by the first descriptor
        self.landed: bytearray | None = None  # one flag per (layer, block, head of this rank), in that order
        self.units_landed = 0
        self.commit: Commit | None = None  # set by the last message
        self.pairs: list[_ReceiverPair] = []  # the pairs its parts arrive on: one per sending rank

    @property
    def progress(self) -> float:
        return self.units_landed / len(self.landed) if self.landed else 0.0


class _ReceiverPair:
    def __init__(
        self, hello: Hello, generation: int, prefix: str, send: Callable[[ReceiverMessage | PairClosed], None]
    ) -> None:
        self.hello, self.generation, self.prefix, self.send = hello, generation, prefix, send
        self.name = f"{hello.sender_id}#{generation}"
        self.queue: queue.Queue[PayloadDescriptor | None] = queue.Queue()
        self.comm: Communicator | None = None
        self.next_seq = 0
        self.broken = threading.Event()
        self.transfers: set[str] = set()
        self.last_used = time.monotonic()


class KVReceiver(Endpoint):
    role = "receiver"

    def __init__(
        self,
        cache: KVCache,
        fingerprint: LayoutFingerprint,
        receiver_id: str,
        host: str = "127.0.0.1",
        config: TransferConfig | None = None,
        store_port: int = 0,
        communicator_factory: CommunicatorFactory = open_communicator,
        faults: FaultHooks | None = None,  # the process's fault hooks (tests); None: none
    ) -> None:
        super().__init__(config, faults)
        self.cache, self.fingerprint, self.receiver_id, self.host = cache, fingerprint, receiver_id, host
        check_cache_heads(cache, fingerprint)
        self.incarnation = uuid.uuid4().hex
        self.backend = choose_backend(cache.device, self.config.backend)
        self.store, self.store_port = bind_store(host, store_port, self.config.pair_setup_timeout_s)
        self._pairs: OrderedDict[str, _ReceiverPair] = OrderedDict()  # least recently used first
        self._generations = itertools.count(1)
        self._dtype = cache.spec.dtype
        self._open_communicator = communicator_factory

    # ---- the decode worker's side ---------------------------------------------------------------

    def expect(self, transfer_id: str, block_ids: Sequence[int], timeout_s: float | None = None) -> ReceiveHandle:
        """Accept a transfer into these leased blocks (in the sender's block order). Without ``timeout_s`` it
        waits up to the config's ``transfer_start_timeout_s`` for the sender's first message and then up to its
        ``transfer_timeout_s`` for the whole transfer; with one, the transfer ends within it from now."""
        if not block_ids:
            raise ValueError("block_ids: at least one destination block is needed")
        cfg = self.config
        handle = ReceiveHandle(
            transfer_id,
            tuple(block_ids),
            timeout_s or cfg.transfer_timeout_s,
            self.cache.device,
            start_timeout_s=None if timeout_s else cfg.transfer_start_timeout_s,
        )
        with self._lock:
            if transfer_id in self._transfers:
                raise ValueError(f"transfer_id: {transfer_id!r} is already expected")
            self._transfers[transfer_id] = handle
        return handle

    def cancel(self, transfer_id: str, reason: str = "cancelled by the receiver") -> None:
        """End a transfer; once this returns nothing writes into its blocks. Tells the sender to stop."""
        handle = self._transfers.get(transfer_id)
        if handle is not None and handle.cancel(reason):
            self._notify(handle, AckStatus.CANCELLED, reason)

    def release(self, transfer_id: str) -> None:
        """Forget a transfer (cancelling it first if it is still live); the owner then frees its blocks."""
        self.cancel(transfer_id)
        with self._lock:
            self._transfers.pop(transfer_id, None)

    # ---- one pair session (run by the control service, one thread per pair) ---------------------

    def serve_pair(
        self, inbound: Iterator[SenderMessage], send: Callable[[ReceiverMessage | PairClosed], None]
    ) -> None:
        """Run a sender's control stream until it ends; raises ServingError to refuse or end it with an error.

        ``send`` delivers a message to the sender; ``send(PairClosed(reason))`` ends the stream.
        """
        first = next(inbound, None)
        if not isinstance(first, Hello):
            raise ServingError("INVALID_ARGUMENT", "the first message of a pair must be hello")
        self._check_hello(first)
        generation = next(self._generations)
        # The store is unauthenticated: whoever reaches its port may read and write any key they can
        # name. A fresh secret per pair and generation, told only to this sender over the (authenticated)
        # control stream, keeps others from guessing this group's keys (docs/security.md).
        secret = secrets.token_hex(16)
        prefix = f"kv/{first.sender_id}/{first.sender_incarnation}/{self.incarnation}/{generation}/{secret}/"
        pair = _ReceiverPair(first, generation, prefix, send)
        self._register(pair)
        self._spawn(self._lane, f"kv-recv-{pair.name}", pair)
        send(
            Welcome(
                PROTOCOL_VERSION,
                self.receiver_id,
                self.incarnation,
                generation,
                self.host,
                self.store_port,
                prefix,
                self.backend,
            )
        )
        try:
            for message in inbound:
                pair.last_used = time.monotonic()
                if isinstance(message, DescriptorBytes):
                    self._on_descriptor(pair, message.data)
                elif isinstance(message, Cancel):
                    self._on_cancel(pair, message)
                else:
                    raise ServingError("INVALID_ARGUMENT", f"unexpected {type(message).__name__} on an open pair")
                if pair.broken.is_set():
                    break
        except ServingError as e:
            self._break(pair, e.message, end_stream=False)  # the refusal itself ends the stream
            raise
        self._break(pair, "control stream ended")

    def _check_hello(self, hello: Hello) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            raise ServingError(
                "FAILED_PRECONDITION", f"protocol_version {hello.protocol_version} != {PROTOCOL_VERSION}"
            )
        if hello.receiver_incarnation and hello.receiver_incarnation != self.incarnation:
            raise ServingError(
                "FAILED_PRECONDITION", "receiver_incarnation: this receiver restarted; fetch its endpoint again"
            )
        diff = hello.fingerprint.mismatches(self.fingerprint)
        if diff:
            raise ServingError("FAILED_PRECONDITION", f"layout fingerprint mismatch: {'; '.join(diff)}")

    def _on_descriptor(self, pair: _ReceiverPair, data: bytes) -> None:
        try:
            desc = decode_descriptor(data, self.config.max_descriptor_bytes)
        except DescriptorError as e:
            raise ServingError("INVALID_ARGUMENT", f"malformed descriptor: {e}") from None
        if desc.seq != pair.next_seq:
            raise ServingError("INVALID_ARGUMENT", f"seq: expected {pair.next_seq}, got {desc.seq}")
        if desc.nbytes > self.config.max_message_bytes:
            raise ServingError("INVALID_ARGUMENT", f"nbytes: {desc.nbytes} exceeds max_message_bytes")
        pair.next_seq += 1
        handle = self._transfers.get(desc.transfer_id)
        if handle is not None:
            handle.begin()
            with handle.lock:
                if pair not in handle.pairs:  # from now on, this pair breaking fails the transfer
                    if handle.pairs and handle.terminal and handle.state is not TransferState.DONE:
                        # A later sending rank of a part that already ended elsewhere: the notice went
                        # to the ranks known then, so tell this one now rather than leave it to its deadline.
                        status = AckStatus.CANCELLED if handle.state is TransferState.CANCELLED else AckStatus.FAILED
                        pair.send(Ack(desc.transfer_id, desc.seq, status, handle.error))
                    handle.pairs.append(pair)
                    pair.transfers.add(desc.transfer_id)
        pair.queue.put(desc)

    def _on_cancel(self, pair: _ReceiverPair, message: Cancel) -> None:
        """A sender gave up. A TP-1 sender may end only a transfer it is sending (or one nobody sends
        yet); a rank of a larger sender may also end one whose other parts come from its peer ranks."""
        handle = self._transfers.get(message.transfer_id)
        if handle is None:
            return
        if handle.pairs and pair not in handle.pairs and pair.hello.fingerprint.tp_size == 1:
            return
        if handle.fail(f"sender gave up: {message.reason}"):
            self._notify(handle, AckStatus.FAILED, f"another sending rank gave up: {message.reason}", skip=pair)

    # ---- the lane: receives in FIFO order, then scatters ---------------------------------------

    def _lane(self, pair: _ReceiverPair) -> None:
        cfg = self.config
        try:
            pair.comm = self._open_communicator(
                self.backend, self.store, pair.prefix, 1, self.host, cfg.op_timeout_s, self.cache.device
            )
        except Exception as e:
            self._break(pair, f"group setup failed: {e}")
            return
        if pair.broken.is_set():
            pair.comm.abort()
            return
        staging = [torch.empty(0, dtype=torch.uint8, device=self.cache.device) for _ in range(2)]
        landing: tuple | None = None  # received, not yet scattered
        while True:
            try:
                desc = pair.queue.get_nowait()
            except queue.Empty:
                if landing is not None:  # nothing to overlap with: land now, then wait
                    self._land(*landing)
                    landing = None
                desc = pair.queue.get()
            if desc is None:
                break
            buf = staging[desc.seq % 2]
            if buf.numel() < desc.nbytes:
                buf = staging[desc.seq % 2] = torch.empty(desc.nbytes, dtype=torch.uint8, device=self.cache.device)
            view = buf[: desc.nbytes]
            try:
                pending = pair.comm.irecv(view)
                if landing is not None:  # overlaps the next receive
                    self._land(*landing)
                    landing = None
                pending.wait(cfg.op_timeout_s)
            except TransferError as e:
                self._break(pair, f"receive failed: {e}")
                return
            landing = (pair, desc, view)
            handle = self._transfers.get(desc.transfer_id)
            if handle is not None:  # only this pair's lane thread receives for the handle
                handle.messages_moved += 1
                self._fault_point(handle, handle.messages_moved)
        if landing is not None:
            self._land(*landing)

    def _land(self, pair: _ReceiverPair, desc: PayloadDescriptor, data: torch.Tensor) -> None:
        handle = self._transfers.get(desc.transfer_id)
        if handle is None:
            pair.send(Ack(desc.transfer_id, desc.seq, AckStatus.REFUSED, f"no lease for transfer {desc.transfer_id!r}"))
            return
        with handle.lock:
            if handle.terminal:
                return  # cancelled, failed or timed out: the payload is dropped
            try:
                self._validate(handle, desc, pair)
                problem = ""
            except DescriptorError as e:  # names the field
                problem = str(e)
            if problem:
                handle.fail(f"refused: {problem}")
                pair.send(Ack(desc.transfer_id, desc.seq, AckStatus.REFUSED, problem))
                return
            handle.start()
            h0, h1 = self._local_heads(desc)
            dest = handle.dest[desc.block_start : desc.block_end]
            layers = range(desc.layer_start, desc.layer_end)
            scatter_heads(self.cache, dest, data.view(self._dtype), layers, h0, h1)
            for flags in self._unit_flags(handle, desc, h0, h1):
                handle.landed[flags] = b"\x01" * (flags.stop - flags.start)
            handle.units_landed += desc.num_units * (h1 - h0)
            handle.nbytes += desc.nbytes
            if desc.commit is not None:
                handle.commit = desc.commit
            if handle.units_landed == len(handle.landed):
                if self.cache.device.type == "cuda":
                    torch.cuda.current_stream(self.cache.device).synchronize()
                handle.complete()
                pair.send(Ack(desc.transfer_id, desc.seq, AckStatus.DONE))
                self._notify(handle, AckStatus.DONE, "", skip=pair)  # the other sending ranks

    def _validate(self, handle: ReceiveHandle, desc: PayloadDescriptor, pair: _ReceiverPair) -> None:
        """Raise DescriptorError, naming the field, unless the payload fits this transfer and this rank."""
        fp = self.fingerprint
        if pair not in handle.pairs:
            raise DescriptorError("id: the transfer was not expected yet when this pair announced it")
        if desc.dtype != fp.dtype:
            raise DescriptorError(f"dtype: {desc.dtype} != {fp.dtype}")
        if desc.layer_end > fp.num_layers:
            raise DescriptorError(f"layers: [{desc.layer_start}, {desc.layer_end}) exceed the model's {fp.num_layers}")
        if desc.num_blocks > len(handle.block_ids):
            raise DescriptorError(f"num_blocks: {desc.num_blocks} blocks do not fit the {len(handle.block_ids)} leased")
        if ceil_div(desc.num_tokens, fp.block_size) != desc.num_blocks:
            raise DescriptorError(
                f"num_tokens: {desc.num_tokens} tokens do not fill {desc.num_blocks} blocks of {fp.block_size}"
            )
        heads = _heads(desc, fp)
        sender = pair.hello.fingerprint.heads
        if heads.overlap(fp.heads) != heads:
            raise DescriptorError(
                f"heads: [{heads.start}, {heads.stop}) are not all held by this receiver "
                f"(rank {fp.tp_rank} of {fp.tp_size} holds [{fp.heads.start}, {fp.heads.stop}))"
            )
        if heads.overlap(sender) != heads:
            raise DescriptorError(
                f"heads: [{heads.start}, {heads.stop}) are not all held by the sender "
                f"(its fingerprint says [{sender.start}, {sender.stop}))"
            )
        expected = (
            desc.layer_end - desc.layer_start,
            desc.block_end - desc.block_start,
            2,
            heads.count,
            fp.block_size,
            fp.head_dim,
        )
        if desc.shape != expected:
            raise DescriptorError(f"shape: {list(desc.shape)} != {list(expected)}")
        if desc.nbytes != desc.num_units * fp.bytes_per_block_layer_of(heads.count):
            raise DescriptorError(f"nbytes: {desc.nbytes} does not match the shape")
        if desc.commit is not None and handle.commit is not None and desc.commit != handle.commit:
            raise DescriptorError(f"commit: {desc.commit} differs from {handle.commit} sent by another rank")
        if handle.num_blocks is None:
            handle.num_blocks = desc.num_blocks
            handle.landed = bytearray(fp.num_layers * desc.num_blocks * fp.heads.count)
        elif handle.num_blocks != desc.num_blocks:
            raise DescriptorError(f"num_blocks: changed from {handle.num_blocks} to {desc.num_blocks}")
        h0, h1 = self._local_heads(desc)
        for flags in self._unit_flags(handle, desc, h0, h1):
            if any(handle.landed[flags]):
                raise DescriptorError(
                    f"layers: [{desc.layer_start}, {desc.layer_end}) blocks [{desc.block_start}, {desc.block_end}) "
                    f"heads [{heads.start}, {heads.stop}) arrived twice"
                )

    def _local_heads(self, desc: PayloadDescriptor) -> tuple[int, int]:
        """The descriptor's heads in this rank's cache numbering (dimension 3)."""
        heads, mine = _heads(desc, self.fingerprint), self.fingerprint.heads
        return heads.start - mine.start, heads.stop - mine.start

    def _unit_flags(self, handle: ReceiveHandle, desc: PayloadDescriptor, h0: int, h1: int) -> list[slice]:
        """The slices of ``handle.landed`` a payload fills: one per layer when it holds every head of
        this rank (the TP-1 case), else one per (layer, block)."""
        per_block = self.fingerprint.heads.count
        if (h0, h1) == (0, per_block):
            return [
                slice(
                    (layer * handle.num_blocks + desc.block_start) * per_block,
                    (layer * handle.num_blocks + desc.block_end) * per_block,
                )
                for layer in range(desc.layer_start, desc.layer_end)
            ]
        return [
            slice(
                (layer * handle.num_blocks + block) * per_block + h0,
                (layer * handle.num_blocks + block) * per_block + h1,
            )
            for layer in range(desc.layer_start, desc.layer_end)
            for block in range(desc.block_start, desc.block_end)
        ]

    # ---- pairs, faults, deadlines ---------------------------------------------------------------

    def _register(self, pair: _ReceiverPair) -> None:
        with self._lock:
            self._pairs[pair.prefix] = pair
            idle = [p for p in self._pairs.values() if p is not pair and not self._busy(p)]
            for victim in idle[: max(0, len(self._pairs) - self.config.max_pairs)]:
                self._break(victim, "closed to stay within max_pairs")

    def _busy(self, pair: _ReceiverPair) -> bool:
        return any(not h.terminal for t in pair.transfers if (h := self._transfers.get(t)) is not None)

    def _break(self, pair: _ReceiverPair, reason: str, end_stream: bool = True) -> None:
        with self._lock:
            if pair.broken.is_set():
                return
            pair.broken.set()
            self._pairs.pop(pair.prefix, None)
        log.info("kv pair %s broken: %s", pair.name, reason)
        if pair.comm is not None:
            pair.comm.abort()
        for transfer_id in list(pair.transfers):
            handle = self._transfers.get(transfer_id)
            message = f"pair with {pair.hello.sender_id} broke: {reason}"
            if handle is not None and handle.fail(message):
                self._notify(handle, AckStatus.FAILED, message, skip=pair)  # the other sending ranks
        pair.queue.put(None)
        if end_stream:
            pair.send(PairClosed(reason))

    def _notify(self, handle: ReceiveHandle, status: AckStatus, error: str, skip: _ReceiverPair | None = None) -> None:
        """Tell every sending rank of the transfer (but ``skip``) how it ended."""
        for pair in list(handle.pairs):
            if pair is not skip and not pair.broken.is_set():
                pair.send(Ack(handle.transfer_id, 0, status, error))

    def _on_deadline(self, handle: ReceiveHandle, message: str) -> None:
        self._notify(handle, AckStatus.FAILED, message)


def _heads(desc: PayloadDescriptor, fp: LayoutFingerprint) -> HeadRange:
    """A descriptor's heads in model numbering; a descriptor without ``heads`` holds all of the model's."""
    start, stop = desc.heads if desc.heads is not None else (0, fp.num_kv_heads)
    if stop > fp.num_kv_heads:
        raise DescriptorError(f"heads: [{start}, {stop}) exceed the model's {fp.num_kv_heads} KV heads")
    return HeadRange(start, stop)
