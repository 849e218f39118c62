"""The notice with which rank 0 of a tensor-parallel prefill worker starts its other ranks' sends
(worker_common/tp/rank_notices.py): it round-trips, and every malformed form is refused by name. Unit tests,
no process."""

from __future__ import annotations

import msgpack
import pytest

from splitserve.kv_transfer.sender import PeerAddress
from splitserve.worker_common.tp import rank_notices
from splitserve.worker_common.tp.rank_notices import NoticeError, StartSends


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
