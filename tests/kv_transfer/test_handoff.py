"""A KV hand-off of several parts as rank 0 sees it (kv_transfer/tp/handoff.py): unit tests, no process."""

from __future__ import annotations

import pytest

from splitserve.kv_transfer.handles import TransferHandle, TransferState
from splitserve.kv_transfer.tp.handoff import Handoff, RemotePart


class LocalPart(TransferHandle):
    """A part this rank moves itself; the test ends it."""

    def __init__(self, transfer_id: str, nbytes: int = 0, commit=None) -> None:
        super().__init__(transfer_id, (0,), 60.0)
        self.nbytes, self.commit = nbytes, commit


def make_handoff(*parts: TransferHandle) -> tuple[Handoff, list[tuple[str, str]]]:
    """A hand-off whose ``end_part`` records (part, reason) and cancels the part, as an endpoint would."""
    ended: list[tuple[str, str]] = []

    def end_part(part: TransferHandle, reason: str) -> None:
        ended.append((part.transfer_id, reason))
        if isinstance(part, RemotePart):
            part.report(TransferState.CANCELLED, reason)
        else:
            part.cancel(reason)

    return Handoff("req", list(parts), end_part), ended


def test_done_when_every_part_is_done_with_their_bytes_and_rank_0s_commit():
    local, remote = LocalPart("req@kv0", nbytes=100, commit="first-token"), RemotePart("req@kv1", rank=1)
    handoff, ended = make_handoff(local, remote)
    seen = []
    handoff.on_terminal(seen.append)
    local.start()
    local.complete()
    assert not handoff.terminal, "one part is still moving"
    remote.report(TransferState.DONE, nbytes=60)
    assert handoff.state is TransferState.DONE and seen == [handoff]
    assert handoff.nbytes == 160 and handoff.commit == "first-token" and handoff.started_at is not None
    assert ended == []


def test_a_failed_part_ends_the_others_and_the_handoff_waits_for_them():
    """Terminal only once every part is: until the follower confirms, its rank may still write the blocks."""
    local, remote, other = LocalPart("req@kv0"), RemotePart("req@kv1", rank=1), RemotePart("req@kv2", rank=2)
    ended: list[tuple[str, str]] = []
    handoff = Handoff("req", [local, remote, other], lambda part, reason: ended.append((part.transfer_id, reason)))
    remote.report(TransferState.FAILED, "rank 1 lost its pair")
    assert [part for part, _ in ended] == ["req@kv0", "req@kv2"], "the live parts are ended"
    assert "rank 1 lost its pair" in ended[0][1]
    assert not handoff.terminal
    local.cancel("ended")
    assert not handoff.terminal, "rank 2 has not confirmed yet"
    other.report(TransferState.CANCELLED, "ended")
    assert handoff.state is TransferState.FAILED
    assert handoff.error == "req@kv1: rank 1 lost its pair", "the first failure is the hand-off's"


def test_end_cancels_every_live_part_once():
    done, live = LocalPart("req@kv0"), RemotePart("req@kv1", rank=1)
    handoff, ended = make_handoff(done, live)
    done.complete()
    handoff.end("cancelled by the router")
    assert ended == [("req@kv1", "cancelled by the router")]
    assert handoff.state is TransferState.CANCELLED and handoff.error == "req@kv1: cancelled by the router"
    handoff.end("again")
    assert len(ended) == 1


def test_a_report_after_the_end_changes_nothing():
    part = RemotePart("req@kv1", rank=1)
    assert part.report(TransferState.FAILED, "lost")
    assert not part.report(TransferState.DONE, nbytes=10)
    assert part.state is TransferState.FAILED and part.nbytes == 0


def test_a_handoff_needs_a_part():
    with pytest.raises(ValueError, match="^parts: "):
        Handoff("req", [], lambda part, reason: None)


@pytest.mark.parametrize(
    "move", [lambda h: h.start(), lambda h: h.complete(), lambda h: h.fail("x"), lambda h: h.cancel("x")]
)
def test_a_handoff_ends_only_through_its_parts(move):
    """Ending it directly would let its owner free the blocks while a part still writes into them."""
    local, remote = LocalPart("req@kv0"), RemotePart("req@kv1", rank=1)
    handoff, ended = make_handoff(local, remote)
    with pytest.raises(TypeError, match="hand-off"):
        move(handoff)
    assert handoff.state is TransferState.WAITING and not local.terminal and not remote.terminal and ended == []
