"""A KV hand-off of several parts as rank 0 sees it (worker_common/handoff.py), and the notice that starts
the other ranks' sends (worker_common/rank_notices.py): unit tests, no process."""

from __future__ import annotations

import msgpack
import pytest

from splitserve.kv_transfer.handles import TransferHandle, TransferState
from splitserve.kv_transfer.sender import PeerAddress
from splitserve.worker_common import rank_notices
from splitserve.worker_common.handoff import Handoff, RemotePart
from splitserve.worker_common.rank_notices import NoticeError, StartSends


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
            part._end(TransferState.CANCELLED, reason)

    return Handoff("req", list(parts), end_part), ended


def test_done_when_every_part_is_done_with_their_bytes_and_rank_0s_commit():
    local, remote = LocalPart("req@kv0", nbytes=100, commit="first-token"), RemotePart("req@kv1", rank=1)
    handoff, ended = make_handoff(local, remote)
    seen = []
    handoff.on_terminal(seen.append)
    local._start()
    local._end(TransferState.DONE)
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
    local._end(TransferState.CANCELLED, "ended")
    assert not handoff.terminal, "rank 2 has not confirmed yet"
    other.report(TransferState.CANCELLED, "ended")
    assert handoff.state is TransferState.FAILED
    assert handoff.error == "req@kv1: rank 1 lost its pair", "the first failure is the hand-off's"


def test_end_cancels_every_live_part_once():
    done, live = LocalPart("req@kv0"), RemotePart("req@kv1", rank=1)
    handoff, ended = make_handoff(done, live)
    done._end(TransferState.DONE)
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


# ---- the notice ------------------------------------------------------------------------------------


def make_notice() -> StartSends:
    peers = (PeerAddress("decode-0", "inc0", "127.0.0.1:5000"), PeerAddress("decode-0.rank1", "inc1", "127.0.0.1:5001"))
    return StartSends("req-7", (4, 9, 2), 40, peers)


def test_notice_round_trips():
    notice = make_notice()
    assert rank_notices.decode(rank_notices.encode(notice)) == notice


def tampered(edit) -> bytes:
    message = msgpack.unpackb(rank_notices.encode(make_notice()), raw=False)
    edit(message)
    return msgpack.packb(message, use_bin_type=True)


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda m: m.update(version=2), "version"),
        (lambda m: m.update(kind="stop"), "kind"),
        (lambda m: m.update(extra=1), "extra"),
        (lambda m: m.pop("num_tokens"), "num_tokens"),
        (lambda m: m.update(request_id=""), "request_id"),
        (lambda m: m.update(block_ids=[]), "block_ids"),
        (lambda m: m.update(block_ids=[1, -2]), "block_ids"),
        (lambda m: m.update(block_ids=[1, True]), "block_ids"),
        (lambda m: m.update(num_tokens=0), "num_tokens"),
        (lambda m: m.update(destinations=[]), "destinations"),
        (lambda m: m.update(destinations=[["a", "b"]]), r"destinations\[0\]"),
        (lambda m: m["destinations"].append(["", "x", "h:1"]), r"destinations\[2\]"),
    ],
)
def test_malformed_notice_is_refused_by_name(edit, field):
    with pytest.raises(NoticeError, match=f"^{field}: "):
        rank_notices.decode(tampered(edit))


def test_garbage_is_refused_as_payload():
    with pytest.raises(NoticeError, match="^payload: "):
        rank_notices.decode(b"\xc1 not msgpack")
    with pytest.raises(NoticeError, match="^payload: "):
        rank_notices.decode(msgpack.packb([1, 2]))
