"""The fault object (splitserve/common/faults.py) without Ray or torch: a plan split per process, the
no-op hooks, delays, kill points counted per step kind, the router's token kill point, transfer points.
A kill is observed through an injected ``exit``; delays through an injected ``sleep``."""

from __future__ import annotations

import logging

import pytest

from splitserve.common.faults import NO_FAULTS, FaultPlan, FaultPoint, Faults, KillPoint


class Recorder:
    """Stands in for os._exit and time.sleep: records the calls, ends nothing."""

    def __init__(self) -> None:
        self.exits: list[int] = []
        self.sleeps: list[float] = []

    def arm(self, faults: Faults, name: str = "decode worker decode-0"):
        return faults.arm(name, exit=self.exits.append, sleep=self.sleeps.append)


def test_no_faults_arm_to_the_no_op_hooks():
    assert Faults().arm("x") is NO_FAULTS
    assert FaultPlan().for_worker("prefill-0").arm("x") is NO_FAULTS
    NO_FAULTS.step("prefill")
    NO_FAULTS.step_done()
    NO_FAULTS.tokens_relayed(10**9)
    assert NO_FAULTS.transfer("sender", "r", 0) is False


def test_delays_sleep_where_their_phase_says():
    rec = Recorder()
    hooks = rec.arm(Faults(prefill_delay_s=0.5, decode_step_delay_s=0.25))
    hooks.step("prefill")
    hooks.step("decode")  # no delay before a decode step
    hooks.step_done()
    assert rec.sleeps == [0.5, 0.25] and rec.exits == []


def test_a_kill_point_fires_as_step_after_plus_one_of_its_kind_starts(caplog):
    rec = Recorder()
    hooks = rec.arm(Faults(die_at="decode", die_after=2))
    for _ in range(5):
        hooks.step("prefill")  # another kind does not count
    hooks.step("decode")
    hooks.step("decode")
    assert rec.exits == []
    with caplog.at_level(logging.ERROR, logger="splitserve.worker"):
        hooks.step("decode")
    assert rec.exits == [1]
    assert "decode worker decode-0: dying at decode step 3 (fault point)" in caplog.text


def test_the_router_dies_past_its_token_count(caplog):
    rec = Recorder()
    hooks = rec.arm(FaultPlan(kill=(KillPoint("router", "decode", 5),)).for_router(), "router")
    hooks.tokens_relayed(5)
    assert rec.exits == []
    with caplog.at_level(logging.ERROR, logger="splitserve.router"):
        hooks.tokens_relayed(6)
    assert rec.exits == [1] and "router: dying after 6 tokens relayed (fault point)" in caplog.text


def test_transfer_points_pause_drop_and_die_per_transfer():
    rec = Recorder()
    hooks = rec.arm(
        Faults(
            transfer=(
                FaultPoint("sender", "pause", 1, seconds=1.5, request_id_prefix="hold-"),
                FaultPoint("sender", "drop", 2),
                FaultPoint("receiver", "die", 3),
            )
        )
    )
    assert hooks.transfer("sender", "hold-a", 1) is False and rec.sleeps == [1.5]
    assert hooks.transfer("sender", "hold-b", 1) is False and rec.sleeps == [1.5, 1.5]  # every matching transfer
    assert hooks.transfer("sender", "other", 1) is False and rec.sleeps == [1.5, 1.5]
    assert hooks.transfer("sender", "any", 2) is True  # the endpoint drops the connection
    assert hooks.transfer("receiver", "any", 2) is False and rec.exits == []
    hooks.transfer("receiver", "any", 3)
    assert rec.exits == [17]


def test_the_plan_gives_each_worker_its_share():
    plan = FaultPlan(
        prefill_delay_s=0.5,
        decode_step_delay_s=0.25,
        transfer=(FaultPoint("sender", "pause", 1, seconds=1.0),),
        kill=(
            KillPoint("prefill-1", "transfer", 4),
            KillPoint("decode-0", "decode", 2),
            KillPoint("router", "decode", 9),
        ),
    )
    prefill = plan.for_worker("prefill-1")
    assert (prefill.prefill_delay_s, prefill.decode_step_delay_s, prefill.die_at) == (0.5, 0.0, "")
    assert [(f.role, f.action, f.after_messages) for f in prefill.transfer] == [
        ("sender", "pause", 1),
        ("sender", "die", 4),
    ]
    decode = plan.for_worker("decode-0")
    assert (decode.prefill_delay_s, decode.decode_step_delay_s, decode.die_at, decode.die_after) == (
        0.0,
        0.25,
        "decode",
        2,
    )
    assert plan.for_worker("colocated-0").decode_step_delay_s == 0.25
    assert plan.for_router() == Faults(die_after_tokens=9)


def test_a_restarted_process_keeps_its_delays_and_loses_its_kill_points():
    faults = FaultPlan(
        decode_step_delay_s=0.25,
        transfer=(FaultPoint("receiver", "pause", 1, seconds=1.0),),
        kill=(KillPoint("decode-0", "transfer", 3), KillPoint("decode-0", "decode", 2)),
    ).for_worker("decode-0")
    again = faults.restarted()
    assert again.die_at == "" and [f.action for f in again.transfer] == ["pause"]
    assert again.decode_step_delay_s == 0.25


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Faults(die_at="transfer"), "faults.die_at: must be one of , prefill, decode"),
        (lambda: Faults(prefill_delay_s=-1), "faults.prefill_delay_s: must be >= 0"),
        (lambda: Faults(die_after_tokens=-2), "faults.die_after_tokens: must be >= -1"),
        (lambda: FaultPlan(decode_step_delay_s=-0.5), "decode_step_delay_s: must be >= 0"),
        (lambda: KillPoint("decode-0", "prefill"), "at: a decode dies at transfer or decode"),
        (lambda: FaultPoint("sender", "pause", 1, seconds=float("nan")), "fault.seconds: must be >= 0"),
    ],
)
def test_bad_faults_name_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()
