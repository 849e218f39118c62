"""The live planner serving on a simulated Ray cluster (SimCluster: real Ray nodes on 127.0.0.1, one
unit of their role's resource each). The test plays the cluster's autoscaler: a worker that the planner
starts waits for resources, and is reported pending in the status, until the test adds a node for it.

The planner is given a profile of the tiny preset whose step costs are scaled up, as if the workers ran
on a device that much slower: by as much as makes one decode step of the output-heavy load, at the
planner's 0.5 correction floor, take 2/3 of the TPOT SLO (about 25x for the committed profile; a fixed
factor would tie the test to one measurement of the profile). The few requests per second this machine
can send then call for a second worker, and the measured latencies (far below the profile's) keep the
planner's correction at its 0.5 floor. The rates are set from the planner's own model, so that whatever
correction it applies, a prompt-heavy load needs 2 prefill workers and 1 decode worker, and an
output-heavy load the reverse. No request may fail, and every token must equal the offline engine's
(nothing lost or repeated across the drain and the migration)."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from splitserve.client.grpc_client import Client
from splitserve.deploy.sim_cluster import ServeProcess, SimCluster
from tests.serving.conftest import wait_for

PROFILE = Path(__file__).parents[1] / "planning" / "data" / "tiny-profile.json"
SLOWED_DECODE_STEP = 2 / 3  # of the TPOT SLO: one decode step of OUTPUT_HEAVY, slowed, at the 0.5 floor
PROMPT_HEAVY = (512, 1)  # prompt tokens, max_tokens
OUTPUT_HEAVY = (16, 48)
PLANNER = {
    "enabled": True,
    "interval_s": 1.0,
    "window_s": 4.0,
    "ttft_ms": 2000,
    "tpot_ms": 30,
    "headroom": 1.2,
    "smoothing": 1.0,
    "stable_intervals": 2,
    "scale_down_intervals": 2,
    "cooldown_s": 2.0,
    "max_prefill": 2,
    "max_decode": 2,
}


class Load:
    """Requests at a steady rate from a thread, each its own prompt; the results kept for the check."""

    def __init__(self, address: str) -> None:
        self.client = Client(address)
        self.pool = ThreadPoolExecutor(max_workers=24)
        self.sent: list[tuple[list[int], int, object]] = []
        self.phase: tuple[float, tuple[int, int]] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            if self.phase is None:
                time.sleep(0.05)
                continue
            rate, (prompt_len, max_tokens) = self.phase
            prompt = [3 + (n * 7919 + 13 * j) % 2000 for j in range(prompt_len)]
            n += 1
            sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
            future = self.pool.submit(self.client.generate, token_ids=prompt, timeout_s=120, **sampling)
            self.sent.append((prompt, max_tokens, future))
            self._stop.wait(1.0 / rate)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.pool.shutdown(wait=True)
        self.client.close()


@pytest.fixture(scope="module")
def planned(serving_model, tmp_path_factory):
    from splitserve.deploy.config import DeploymentConfig
    from splitserve.deploy.live_planner import ProfileModel
    from splitserve.deploy.profile import Profile, StepShape

    folder = tmp_path_factory.mktemp("planner")
    profile = Profile.load(PROFILE)
    one_decode = profile.step_s(StepShape.of(contexts=[OUTPUT_HEAVY[0] + OUTPUT_HEAVY[1] // 2]))
    slower = SLOWED_DECODE_STEP * PLANNER["tpot_ms"] / 1e3 / (0.5 * one_decode)
    slow = dataclasses.replace(profile, step_coefficients={k: v * slower for k, v in profile.step_coefficients.items()})
    slow.save(folder / "slow.json")
    with SimCluster([("prefill", 1), ("decode", 1)]) as cluster:
        config = {
            "model": str(serving_model),
            "dtype": "float32",
            "port": 0,
            "ray_address": cluster.address,
            "prefill": {"replicas": 1, "threads": 1},
            "decode": {"replicas": 1, "threads": 1},
            "engine": {"max_num_seqs": 4},
            "planner": {**PLANNER, "profile": str(folder / "slow.json")},
        }
        model = ProfileModel(slow, DeploymentConfig.from_dict(config), PLANNER["ttft_ms"], PLANNER["tpot_ms"])
        served = ServeProcess(config, folder / "deploy.yaml")
        try:
            yield cluster, served, model
        finally:
            assert served.stop() == 0


def status(served):
    return Client(served.address).status()


def healthy(served, role: str) -> list[str]:
    return sorted(w.worker_id for w in status(served).workers if w.role == role and w.healthy)


def test_the_planner_moves_workers_with_the_load_and_reports_pending_ones(planned, serving_model):
    from splitserve.engine import LLM, SamplingParams

    cluster, served, model = planned
    headroom = PLANNER["headroom"]
    # Whatever its correction (0.5x to 4x the profile's step costs), the planner must want 2 and 1, then 1 and 2.
    prompt_rate = 1.3 * model.prefill_capacity(PROMPT_HEAVY[0], 0.5) / headroom
    output_rate = 1.3 * model.decode_capacity(*OUTPUT_HEAVY, 0.5) / headroom
    assert 1 < prompt_rate < 8 and 1 < output_rate < 8, (prompt_rate, output_rate)
    assert output_rate * headroom < model.prefill_capacity(OUTPUT_HEAVY[0], 4.0), "one prefill worker suffices"

    load = Load(served.address)
    try:
        load.phase = (prompt_rate, PROMPT_HEAVY)
        pending = wait_for(lambda: list(status(served).pending_workers), timeout_s=60, interval_s=0.5)
        assert pending == ["prefill-1: splitserve_prefill 1"], pending
        assert "prefill 1 -> 2" in status(served).planner
        assert "pending: prefill-1: splitserve_prefill 1" in served.cli("status")
        cluster.add("prefill", 1)  # the autoscaler adds a node with room for it
        wait_for(lambda: healthy(served, "prefill") == ["prefill-0", "prefill-1"], timeout_s=90, interval_s=0.5)
        assert not status(served).pending_workers and healthy(served, "decode") == ["decode-0"]

        load.phase = (output_rate, OUTPUT_HEAVY)
        pending = wait_for(lambda: list(status(served).pending_workers), timeout_s=60, interval_s=0.5)
        assert pending == ["decode-1: splitserve_decode 1"], pending
        cluster.add("decode", 1)
        wait_for(lambda: healthy(served, "decode") == ["decode-0", "decode-1"], timeout_s=90, interval_s=0.5)
        wait_for(lambda: healthy(served, "prefill") == ["prefill-0"], timeout_s=30, interval_s=0.5)
        time.sleep(3)  # requests in flight across the change, on the new deployment
    finally:
        load.stop()

    results = [(prompt, max_tokens, future.result(timeout=60)) for prompt, max_tokens, future in load.sent]
    assert len(results) > 40
    offline = LLM(serving_model, dtype="float32", num_blocks=512)
    for max_tokens in (PROMPT_HEAVY[1], OUTPUT_HEAVY[1]):
        batch = [(p, r) for p, m, r in results if m == max_tokens]
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        want = [o.token_ids for o in offline.generate([p for p, _ in batch], sampling)]
        assert [r.token_ids for _, r in batch] == want, "no token lost or repeated"
    wait_for(lambda: all(w.kv_blocks_in_use == 0 for w in status(served).workers), timeout_s=15)
