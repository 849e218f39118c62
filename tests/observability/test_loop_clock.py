"""The worker loop's clock without a worker: the phases add up to the wall clock, only the loop thread books
time, and the worker's lock books the loop thread's waits (and only those) to ``lock_wait``."""

from __future__ import annotations

import threading
import time

import pytest

from splitserve.worker_common.loop_clock import PHASES, LoopClock, TimedLock
from splitserve.worker_common.metrics import WorkerMetrics
from tests.observability.scrape import Scrape


def make_started_clock() -> tuple[LoopClock, float]:
    clock = LoopClock()
    clock.start()
    return clock, time.perf_counter()


def test_phases_add_up_to_the_wall_clock():
    clock, started = make_started_clock()
    clock.enter("run")
    time.sleep(0.05)
    assert clock.enter("idle") == "run"
    time.sleep(0.02)
    seconds = clock.seconds()  # the phase in progress counts up to now
    elapsed = time.perf_counter() - started
    assert set(seconds) == set(PHASES)
    assert sum(seconds.values()) == pytest.approx(elapsed, abs=2e-3)
    assert seconds["run"] >= 0.05 and seconds["idle"] >= 0.02
    assert seconds["schedule"] == seconds["lock_wait"] == 0.0


def test_other_threads_book_nothing():
    clock, _ = make_started_clock()
    clock.enter("stream")
    other = threading.Thread(target=lambda: clock.enter("run"))
    other.start()
    other.join()
    assert clock.phase == "stream" and clock.seconds()["run"] == 0.0


def test_counters_never_go_back_while_the_loop_switches():
    clock, _ = make_started_clock()
    done = threading.Event()
    readings: list[dict] = []

    def scrape() -> None:
        while not done.is_set():
            readings.append(clock.seconds())

    scraper = threading.Thread(target=scrape)
    scraper.start()
    for i in range(20000):
        clock.enter(PHASES[i % len(PHASES)])
    done.set()
    scraper.join()
    assert len(readings) > 1
    for phase in PHASES:  # each series, as Prometheus sees it
        assert all(b[phase] >= a[phase] for a, b in zip(readings, readings[1:])), phase


def test_the_loop_threads_wait_for_the_lock_is_lock_wait():
    clock, started = make_started_clock()
    lock = TimedLock(clock)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            release.wait()

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait()
    clock.enter("schedule")
    threading.Timer(0.1, release.set).start()
    with lock:  # waits about 0.1 s, booked to lock_wait; then back in schedule
        assert clock.phase == "schedule"
        with lock:  # reentrant, uncontended: books nothing
            pass
    thread.join()
    seconds = clock.seconds()
    assert 0.09 <= seconds["lock_wait"] <= 0.3
    assert sum(seconds.values()) == pytest.approx(time.perf_counter() - started, abs=2e-3)


def test_a_handler_threads_wait_is_not_the_loops():
    clock, _ = make_started_clock()
    lock = TimedLock(clock)
    clock.enter("run")
    got = []

    def handler() -> None:
        with lock:
            got.append(True)

    with lock:
        thread = threading.Thread(target=handler)
        thread.start()
        time.sleep(0.05)  # the handler waits while the loop holds the lock
    thread.join()
    assert got == [True] and clock.seconds()["lock_wait"] == 0.0


def test_the_worker_exports_its_loop_phases():
    metrics = WorkerMetrics("decode-0", "decode")
    metrics.loop.start()
    metrics.loop.enter("run")
    time.sleep(0.01)
    metrics.loop.enter("idle")
    s = Scrape.registry(metrics.registry)
    rows = s.label_sets("splitserve_worker_loop_seconds_total")
    assert sorted(r["phase"] for r in rows) == sorted(PHASES)
    assert all((r["worker_id"], r["role"]) == ("decode-0", "decode") for r in rows)
    assert s.value("splitserve_worker_loop_seconds_total", phase="run") >= 0.01
    assert s.families["splitserve_worker_loop_seconds"].type == "counter"
