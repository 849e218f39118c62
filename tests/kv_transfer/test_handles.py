"""A transfer handle's state machine (kv_transfer/handles.py): only its own methods move it, each move is
checked, and a terminal state never changes. Unit tests, no process."""

from __future__ import annotations

import pytest

from splitserve.kv_transfer.handles import TransferHandle, TransferState


def make_handle() -> tuple[TransferHandle, list[TransferHandle]]:
    handle = TransferHandle("t1", (3, 4), 60.0)
    ended: list[TransferHandle] = []
    handle.on_terminal(ended.append)
    return handle, ended


def test_start_moves_a_waiting_handle_once():
    handle, _ = make_handle()
    assert handle.state is TransferState.WAITING and handle.started_at is None
    assert handle.start()
    started = handle.started_at
    assert handle.state is TransferState.TRANSFERRING and started is not None
    assert not handle.start(), "a later payload changes nothing"
    assert handle.started_at == started


@pytest.mark.parametrize(
    "end,state,error",
    [
        (lambda h: h.complete(), TransferState.DONE, ""),
        (lambda h: h.fail("pair broke"), TransferState.FAILED, "pair broke"),
        (lambda h: h.cancel("cancelled by the router"), TransferState.CANCELLED, "cancelled by the router"),
    ],
)
def test_each_end_is_terminal_runs_the_callbacks_once_and_keeps_the_first_end(end, state, error):
    handle, ended = make_handle()
    handle.start()
    assert end(handle)
    assert handle.state is state and handle.error == error and handle.terminal
    assert handle.finished_at is not None and handle.active_s is not None
    assert ended == [handle]
    assert handle.wait(0) is state
    # Every later move is refused and changes nothing: neither the state, nor its error, nor the callbacks.
    assert not handle.complete()
    assert not handle.fail("later")
    assert not handle.cancel("later")
    assert not handle.start()
    assert handle.state is state and handle.error == error and ended == [handle]


def test_a_waiting_handle_may_end_without_starting():
    handle, ended = make_handle()
    assert handle.cancel("cancelled before any payload")
    assert handle.state is TransferState.CANCELLED and handle.started_at is None and handle.active_s is None
    assert ended == [handle]


def test_a_callback_added_after_the_end_runs_at_once():
    handle, _ = make_handle()
    handle.fail("deadline passed")
    late: list[TransferHandle] = []
    handle.on_terminal(late.append)
    assert late == [handle]


def test_ending_in_a_live_state_is_refused_by_name():
    handle, ended = make_handle()
    with pytest.raises(ValueError, match="^state: 'transferring' is not a terminal state"):
        handle._settle(TransferState.TRANSFERRING)
    assert handle.state is TransferState.WAITING and ended == []
