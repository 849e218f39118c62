"""The soak test, short: ``scripts/soak.py`` as ``make soak`` runs it (mixed load, random cancels, one
decode worker killed mid-decode and restarted), for under a minute instead of five; and the soak's
books (how it classifies a request, how it compares greedy results) on their own."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak_script", ROOT / "scripts" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def make_record(soak, **fields):
    values = dict(max_tokens=8, ignore_eos=True, case=None, cancel_after_s=None, started=10.0, ended=12.0)
    return soak.RequestRecord(**{**values, **fields})


def make_kill(soak, alive_at=11.0, gone_at=11.4):
    return soak.KillWindow("decode-0", "inc-1", alive_at=alive_at, gone_at=gone_at)


GAVE_UP = "decode worker decode-0 failed: UNAVAILABLE: Socket closed; gave up after 0 migrations"


def test_each_outcome_is_classified_only_for_its_own_cause(soak):
    kill = make_kill(soak)
    full = make_record(soak, tokens=list(range(8)), finish=soak.FINISH_LENGTH)
    assert soak.classify(full, kill) == "finished"
    assert soak.classify(make_record(soak, tokens=list(range(5)), finish=soak.FINISH_LENGTH), kill) is None
    # Its own EOS ends a request only when it did not ask to ignore EOS.
    eos = dict(tokens=[1, 2, 3], finish=soak.FINISH_STOP)
    assert soak.classify(make_record(soak, **eos), kill) is None
    assert soak.classify(make_record(soak, ignore_eos=False, **eos), kill) == "finished"
    # CANCELLED only counts when the client did cancel it.
    cancelled = dict(status="CANCELLED", cancel_after_s=0.5)
    assert soak.classify(make_record(soak, cancel_fired=True, **cancelled), kill) == "cancelled_by_client"
    assert soak.classify(make_record(soak, cancel_fired=False, **cancelled), kill) is None
    # UNAVAILABLE for the kill: the router's "gave up" naming the victim, for a request in flight then.
    assert soak.classify(make_record(soak, status="UNAVAILABLE", details=GAVE_UP), kill) == "failed_by_injected_cause"
    retries = GAVE_UP.replace("0 migrations", "3 retries")
    assert soak.classify(make_record(soak, status="UNAVAILABLE", details=retries), kill) == "failed_by_injected_cause"
    for details in (
        GAVE_UP.replace("decode-0", "decode-1"),
        GAVE_UP.replace("decode-0", "decode-01"),
        "no decode worker had room for 3 KV blocks within lease_timeout_s",
        "",
    ):
        assert soak.classify(make_record(soak, status="UNAVAILABLE", details=details), kill) is None, details
    for started, ended in ((11.5, 13.0), (8.0, 9.9)):  # sent after the victim was seen gone; ended before the kill
        late = make_record(soak, status="UNAVAILABLE", details=GAVE_UP, started=started, ended=ended)
        assert soak.classify(late, kill) is None
    assert (
        soak.classify(make_record(soak, status="UNAVAILABLE", details=GAVE_UP), make_kill(soak, gone_at=None)) is None
    )
    # Causes the soak does not create fail it, whatever their message.
    for status in ("RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "INTERNAL"):
        assert soak.classify(make_record(soak, status=status, details=GAVE_UP), kill) is None


def test_the_kill_window_follows_the_status_polls(soak):
    class Worker:
        def __init__(self, healthy, incarnation):
            self.worker_id, self.healthy, self.incarnation = "decode-0", healthy, incarnation

    kill = soak.KillWindow("decode-0", "inc-1", alive_at=0.0)
    kill.seen([Worker(True, "inc-1")], sent=1.0, answered=1.1)
    kill.seen([Worker(False, "inc-1")], sent=1.2, answered=1.3)
    kill.seen([], sent=1.4, answered=1.5)
    kill.seen([Worker(True, "inc-2")], sent=4.0, answered=4.1)
    kill.seen([Worker(True, "inc-2")], sent=5.0, answered=5.1)
    assert (kill.alive_at, kill.gone_at, kill.back_at) == (1.0, 1.3, 4.1)


def test_greedy_results_are_compared_with_their_first_and_the_offline_engine(soak):
    reference = [[1, 2, 3], [4, 5]]
    ok = [
        make_record(soak, case=0, max_tokens=3, tokens=[1, 2, 3], finish=soak.FINISH_LENGTH, started=t)
        for t in (1.0, 2.0, 3.0)
    ]
    moved = make_record(soak, case=1, max_tokens=2, tokens=[4, 5], finish=soak.FINISH_LENGTH, reprefills=1)
    short = make_record(soak, case=1, max_tokens=2, tokens=[4], finish=soak.FINISH_LENGTH)  # not compared
    sampled = make_record(soak, max_tokens=2, tokens=[9, 9], finish=soak.FINISH_LENGTH)  # not compared
    books = soak.compare_greedy([*ok, moved, short, sampled], reference)
    assert (books["with_first"], books["with_engine"], books["comparisons"]) == (2, 4, 6)
    assert books["cases"] == 2 and books["moved_compared"] == 1 and books["mismatches"] == []
    wrong = make_record(soak, case=0, max_tokens=3, tokens=[1, 2, 4], finish=soak.FINISH_LENGTH, started=4.0)
    books = soak.compare_greedy([*ok, wrong], reference)
    assert books["comparisons"] == 7 and len(books["mismatches"]) == 2, books["mismatches"]
    books = soak.compare_greedy([*ok], [[1, 2, 4], [4, 5]])  # the engine disagrees with all three
    assert len(books["mismatches"]) == 3


def test_short_soak_loses_no_request_leaks_no_block_and_holds_its_memory(serving_model, tmp_path):
    out = tmp_path / "soak"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "soak.py"),
            "--model",
            str(serving_model),
            "--duration-s",
            "40",
            "--warmup-s",
            "12",
            "--concurrency",
            "6",
            "--kill-after-steps",
            "150",
            "--out-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    verdict = json.loads((out / "soak.json").read_text())
    # What failed first and shortest (a CI log may keep only the message's first few hundred characters).
    failed = [name for name, ok in verdict.get("checks", {}).items() if not ok]
    assert done.returncode == 0 and verdict["passed"], (
        f"unclassified: {verdict.get('unclassified', [])[:5]}; failed checks: {failed}; "
        f"greedy mismatches: {verdict['greedy']['mismatches'][:5]}; kill: {verdict.get('kill')}; "
        f"stderr: {done.stderr[-1500:]}"
    )
    outcomes = verdict["outcomes"]
    assert outcomes["unclassified"] == 0 and verdict["unclassified"] == [], verdict["unclassified"]
    assert outcomes["finished"] >= 20 and outcomes["cancelled_by_client"] >= 1, outcomes
    # One kill, three migrations allowed: no request may run out of them.
    assert outcomes["failed_by_injected_cause"] == 0, verdict["injected"]
    assert sum(outcomes.values()) == verdict["requests"]
    greedy = verdict["greedy"]
    assert greedy["comparisons"] > 0 and greedy["with_first"] > 0 and greedy["with_engine"] > 0, greedy
    assert greedy["mismatches"] == []
    kill = verdict["kill"]
    assert kill["seen_gone_s"] is not None and 0 < kill["back_after_kill_s"] < 60, kill
    assert verdict["blocks_zero_after_s"] is not None
    checked = [row for row in verdict["memory"] if row["checked"]]
    assert {row["name"] for row in checked} >= {"router", "worker"}, verdict["memory"]
    assert all(row["growth"] < 0.10 for row in checked)
    assert verdict["serve_exit"] == 0
