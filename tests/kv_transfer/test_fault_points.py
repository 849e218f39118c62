"""Transfer fault points fire per transfer: in every matching transfer, when that transfer's own count
of payload messages reaches ``after_messages``, so a long-lived deployment can hold each test's request."""

from __future__ import annotations

import time

import pytest

from splitserve.common.faults import Faults
from splitserve.kv_transfer.config import FaultPoint, TransferConfig
from splitserve.kv_transfer.handles import TransferState
from tests.kv_transfer.fakes import FakeFabric
from tests.kv_transfer.test_units import BLOCK, make_endpoints

PAUSE_S = 1.5


def test_a_fault_point_matches_role_count_and_request_id_prefix():
    hold = FaultPoint("sender", "pause", after_messages=1, seconds=1.0, request_id_prefix="hold-")
    assert hold.fires("sender", "hold-1", 1) and hold.fires("sender", "hold-2", 1)
    assert not hold.fires("sender", "hold-1", 2), "once per transfer, at its own count"
    assert not hold.fires("receiver", "hold-1", 1) and not hold.fires("sender", "other", 1)
    every = FaultPoint("receiver", "drop", after_messages=2)
    faults = Faults(transfer=(hold, every))
    assert [f for f in faults.transfer if f.fires("sender", "hold-x", 1)] == [hold]
    assert [f for f in faults.transfer if f.fires("receiver", "anything", 2)] == [every]
    assert not any(f.fires("sender", "free", 1) for f in faults.transfer)


@pytest.mark.parametrize(
    "fields, name",
    [
        (dict(role="sender", action="pause", after_messages=-1), "fault.after_messages"),
        (dict(role="sender", action="pause", after_messages=1, seconds=-2.0), "fault.seconds"),
        (dict(role="sender", action="pause", after_messages=1, request_id_prefix=3), "fault.request_id_prefix"),
        (dict(role="peer", action="pause", after_messages=1), "fault.role"),
    ],
    ids=["after_messages", "seconds", "request_id_prefix", "role"],
)
def test_bad_fault_points_name_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        FaultPoint(**fields)


def timed_transfer(sender, receiver, peer, transfer_id: str, src: list[int], dst: list[int]) -> float:
    """One whole transfer, in several messages; returns its seconds from start to done on both sides."""
    start = time.monotonic()
    rh = receiver.expect(transfer_id, dst)
    sh = sender.start(transfer_id, peer, src, len(src) * BLOCK)
    sender.finish(sh)
    assert sh.wait(10) is TransferState.DONE, sh.error
    assert rh.wait(10) is TransferState.DONE, rh.error
    elapsed = time.monotonic() - start
    assert sh.messages_moved == rh.messages_moved >= 2, "several messages per transfer, counted on each side"
    sender.release(transfer_id)
    receiver.release(transfer_id)
    return elapsed


def test_a_pause_holds_every_matching_transfer_and_no_other():
    hold = FaultPoint("sender", "pause", after_messages=1, seconds=PAUSE_S, request_id_prefix="hold-")
    config = TransferConfig(max_message_bytes=1024, whole_request_bytes=0, layer_group_size=1, op_timeout_s=5.0)
    faults = Faults(transfer=(hold,)).arm("prefill worker p")
    sender, receiver, peer = make_endpoints("cpu", config, FakeFabric().factory, faults=faults)
    try:
        first = timed_transfer(sender, receiver, peer, "hold-first", [1, 2], [10, 11])
        second = timed_transfer(sender, receiver, peer, "hold-second", [3, 4], [12, 13])
        free = timed_transfer(sender, receiver, peer, "free", [5, 6], [14, 15])
    finally:
        sender.close()
        receiver.close()
    assert first >= PAUSE_S and second >= PAUSE_S, (first, second)  # the second transfer pauses too
    assert free < PAUSE_S * 2 / 3, f"a transfer the prefix does not match paused ({free:.2f}s)"
