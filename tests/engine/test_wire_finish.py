"""The one finish-reason table: engine FinishReason <-> protobuf enum <-> text label."""

from __future__ import annotations

from splitserve.engine.scheduler.request import FinishReason
from splitserve.engine.wire import FINISH_FROM_PB, FINISH_TO_PB, finish_label
from splitserve.v1 import splitserve_pb2 as pb


def test_finish_reasons_round_trip():
    for reason, value in FINISH_TO_PB.items():
        assert FINISH_FROM_PB[value] is reason
    assert set(FINISH_TO_PB) == {FinishReason.STOP, FinishReason.LENGTH}


def test_labels():
    assert finish_label(pb.FINISH_REASON_STOP) == "stop"
    assert finish_label(pb.FINISH_REASON_LENGTH) == "length"
    assert finish_label(pb.FINISH_REASON_UNSPECIFIED) == ""
    assert {finish_label(FINISH_TO_PB[r]) for r in FINISH_TO_PB} == {r.value for r in FINISH_TO_PB}
