"""The KV rendezvous store is unauthenticated; each pair's keys live under a prefix with a fresh
secret that only the pair's sender learns, over the control stream. Real gloo groups in one process."""

from __future__ import annotations

import re

import torch

from splitserve.engine.kv_cache.cache import KVCache, KVCacheSpec
from splitserve.kv_transfer.config import TransferConfig
from splitserve.kv_transfer.control import Welcome
from splitserve.kv_transfer.handles import TransferState
from splitserve.kv_transfer.local import LocalConnection
from splitserve.kv_transfer.receiver import KVReceiver
from splitserve.kv_transfer.sender import KVSender, PeerAddress
from tests.kv_transfer.test_units import BLOCK, FP, HEAD_DIM, HEADS, LAYERS

SECRET = re.compile(r"^kv/(?P<sender>[^/]+)/[0-9a-f]{32}/[0-9a-f]{32}/(?P<generation>\d+)/(?P<secret>[0-9a-f]{32})/$")


class RecordingConnection(LocalConnection):
    """An in-memory control stream that keeps every Welcome its sender received."""

    welcomes: list[Welcome] = []

    def receive(self, timeout_s: float | None = None):
        message = super().receive(timeout_s)
        if isinstance(message, Welcome):
            RecordingConnection.welcomes.append(message)
        return message


def test_every_pair_and_generation_gets_its_own_unguessable_prefix():
    RecordingConnection.welcomes = []
    config = TransferConfig(op_timeout_s=5.0, pair_setup_timeout_s=5.0)
    spec = KVCacheSpec(LAYERS, HEADS, HEAD_DIM, 32, BLOCK, torch.float32)
    receiver = KVReceiver(KVCache(spec, "cpu"), FP, "d", config=config)
    senders = []
    for name in ("p1", "p2"):
        cache = KVCache(spec, "cpu")
        cache.tensor.copy_(torch.randn(cache.tensor.shape))
        senders.append(
            KVSender(cache, FP, name, connect=lambda peer: RecordingConnection(receiver.serve_pair), config=config)
        )
    peer = PeerAddress("d", receiver.incarnation, "local")

    def move(sender: KVSender, transfer_id: str, src: list[int], dst: list[int]) -> None:
        rh = receiver.expect(transfer_id, dst)
        sh = sender.start(transfer_id, peer, src, len(src) * BLOCK)
        sender.finish(sh)
        assert sh.wait(10) is TransferState.DONE and rh.wait(10) is TransferState.DONE  # the gloo group formed
        assert torch.equal(receiver.cache.tensor[:, dst], sender.cache.tensor[:, src])
        receiver.release(transfer_id)
        sender.release(transfer_id)

    try:
        move(senders[0], "a", [1, 2], [3, 4])
        move(senders[1], "b", [5], [6])
        senders[0]._break(next(iter(senders[0]._pairs.values())), "test: rebuild the pair")
        move(senders[0], "c", [7, 8], [9, 10])  # a new generation of p1's pair
        prefixes = [w.store_prefix for w in RecordingConnection.welcomes]
        assert len(prefixes) == 3 and len(set(prefixes)) == 3
        parsed = [SECRET.match(p) for p in prefixes]
        assert all(parsed), prefixes
        assert [(m["sender"], m["generation"]) for m in parsed] == [("p1", "1"), ("p2", "2"), ("p1", "3")]
        assert len({m["secret"] for m in parsed}) == 3  # 128 fresh random bits each: not derivable from the rest
    finally:
        for sender in senders:
            sender.close()
        receiver.close()
