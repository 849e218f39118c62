"""KV transfer between ranks of tensor-parallel workers of different sizes, in real processes over gloo:
each receiving rank ends up with exactly its heads, taken from the ranks that hold them; descriptors
claiming heads a receiver does not hold are refused by name with nothing written; a cancelled hand-off
frees its blocks on every rank."""

from __future__ import annotations

import time

import pytest

from splitserve.common.arith import ceil_div
from splitserve.common.faults import Faults
from splitserve.engine.tp.layout import transfer_pairs
from splitserve.kv_transfer.config import FaultPoint
from splitserve.kv_transfer.tp.parts import rank_transfer_id, sends_for
from tests.kv_transfer.harness import SPEC, Worker
from tests.kv_transfer.test_processes import assert_no_blocks_held, commit_for, make_config, wait_until

HEADS = SPEC["num_kv_heads"]  # 2: TP 4 replicates each head on two ranks
# Transfers named "cancel..." pause on the sender after 3 messages, so that they are mid-way when cancelled.
PAUSE = Faults(transfer=(FaultPoint("sender", "pause", after_messages=3, seconds=1.5, request_id_prefix="cancel"),))


@pytest.fixture(scope="module")
def ranks():
    """Senders of TP 1 and 2, receivers of TP 1, 2 and 4, keyed by (role, tp size)."""
    cfg = make_config()
    layout = [("sender", 1), ("sender", 2), ("receiver", 1), ("receiver", 2), ("receiver", 4)]
    launched = {
        (role, tp): [
            Worker.launch(role, f"{role[0]}{tp}r{rank}", cfg, faults=PAUSE, tp=(tp, rank)) for rank in range(tp)
        ]
        for role, tp in layout
    }
    workers = {key: [w.ready() for w in group] for key, group in launched.items()}
    yield workers
    for group in workers.values():
        for w in group:
            w.stop()


def start_handoff(senders: list[Worker], receivers: list[Worker], tid: str, tokens: int, stream: bool) -> None:
    """What the worker wiring does: each receiving rank expects its part, each sending rank sends its pairs."""
    for r, receiver in enumerate(receivers):
        receiver.call("expect", rank_transfer_id(tid, r, len(receivers)), tokens)
    for s, sender in enumerate(senders):
        for pair in sends_for(HEADS, len(senders), s, len(receivers)):
            part = rank_transfer_id(tid, pair.receiver_rank, len(receivers))
            peer = receivers[pair.receiver_rank].peer
            heads = (pair.heads.start, pair.heads.stop)
            sender.call("send", part, peer, tokens, stream=stream, commit=commit_for(tid), heads=heads)


def finish_handoff(senders: list[Worker], receivers: list[Worker], tid: str, tokens: int) -> None:
    n = ceil_div(tokens, SPEC["block_size"])
    pairs = transfer_pairs(HEADS, len(senders), len(receivers))
    for r, receiver in enumerate(receivers):
        part = rank_transfer_id(tid, r, len(receivers))
        received = receiver.call("wait", part, timeout_s=10)
        assert received["state"] == "done" and received["commit"] == commit_for(tid), received
        # The reference: per block, each head as the rank that sent it holds it.
        expected: list[dict[int, str]] = [{} for _ in range(n)]
        for pair in (p for p in pairs if p.receiver_rank == r):
            sent = senders[pair.sender_rank].call("head_checksums", part, n)
            for block, heads in enumerate(sent):
                expected[block].update({h: heads[h] for h in range(pair.heads.start, pair.heads.stop)})
        assert receiver.call("head_checksums", part, n) == expected, f"{part}: KV differs after transfer"
    for s, sender in enumerate(senders):
        for pair in sends_for(HEADS, len(senders), s, len(receivers)):
            part = rank_transfer_id(tid, pair.receiver_rank, len(receivers))
            assert sender.call("wait", part, timeout_s=10)["state"] == "done"
            sender.call("release", part)
    for r, receiver in enumerate(receivers):
        receiver.call("release", rank_transfer_id(tid, r, len(receivers)))


@pytest.mark.parametrize(
    ("sender_tp", "receiver_tp"), [(2, 1), (1, 2), (2, 2), (1, 4)], ids=["2to1", "1to2", "2to2", "1to4-replicated"]
)
def test_each_receiving_rank_gets_exactly_its_heads(ranks, sender_tp, receiver_tp):
    senders, receivers = ranks["sender", sender_tp], ranks["receiver", receiver_tp]
    for i, (tokens, stream) in enumerate([(5, False), (45, True)]):
        tid = f"tp{sender_tp}{receiver_tp}-{i}"
        start_handoff(senders, receivers, tid, tokens, stream)
        finish_handoff(senders, receivers, tid, tokens)
    assert_no_blocks_held(*senders, *receivers)


def test_heads_outside_the_receivers_range_are_refused_by_name(ranks):
    (sender,), receivers = ranks["sender", 1], ranks["receiver", 2]
    rank1 = receivers[1]  # holds head 1 only
    rank1.call("expect", "wrong-heads", 9)
    before = rank1.call("checksums", "wrong-heads", 3)
    sender.call("send", "wrong-heads", rank1.peer, 9, heads=(0, 2))  # both heads, to a rank of one
    received, sent = rank1.call("wait", "wrong-heads", timeout_s=10), sender.call("wait", "wrong-heads", timeout_s=10)
    assert received["state"] == "failed" and "heads: [0, 2) are not all held by this receiver" in received["error"]
    assert sent["state"] == "failed" and "heads:" in sent["error"]
    assert rank1.call("checksums", "wrong-heads", 3) == before  # nothing written
    for w in (sender, rank1):
        w.call("release", "wrong-heads")
    start_handoff([sender], receivers, "after-wrong-heads", 20, stream=False)  # the pair lives on
    finish_handoff([sender], receivers, "after-wrong-heads", 20)
    assert_no_blocks_held(sender, *receivers)


def test_cancel_mid_handoff_frees_every_receiving_rank(ranks):
    (sender,), receivers = ranks["sender", 1], ranks["receiver", 2]
    start_handoff([sender], receivers, "cancel-1to2", 200, stream=True)  # 200 tokens: 25 messages per part
    parts = [rank_transfer_id("cancel-1to2", r, 2) for r in range(2)]
    wait_until(lambda: all(w.call("state", p) == "transferring" for w, p in zip(receivers, parts)))
    for part in parts:  # the sending worker gives the hand-off up: each of its transfers
        sender.call("cancel", part)
    for w, part in zip(receivers, parts):
        assert w.call("wait", part, timeout_s=10)["state"] == "failed"
        w.call("release", part)
        sender.call("release", part)
    assert_no_blocks_held(sender, *receivers)


def test_one_sending_rank_giving_up_ends_the_others_part(ranks):
    senders, (receiver,) = ranks["sender", 2], ranks["receiver", 1]
    start_handoff(senders, [receiver], "cancel-2to1", 200, stream=True)
    wait_until(lambda: receiver.call("state", "cancel-2to1") == "transferring")
    senders[0].call("cancel", "cancel-2to1")
    start = time.monotonic()
    assert receiver.call("wait", "cancel-2to1", timeout_s=10)["state"] == "failed"
    other = senders[1].call("wait", "cancel-2to1", timeout_s=10)
    assert other["state"] == "failed" and "another sending rank gave up" in other["error"], other
    assert time.monotonic() - start < 5  # told by the receiver, not left to its deadline
    for w in (*senders, receiver):
        w.call("release", "cancel-2to1")
    start_handoff(senders, [receiver], "after-cancel-2to1", 30, stream=True)
    finish_handoff(senders, [receiver], "after-cancel-2to1", 30)
    assert_no_blocks_held(*senders, receiver)
