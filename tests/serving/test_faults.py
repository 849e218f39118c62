"""Each fault reached deterministically through its kill point (``faults.kill`` in the deployment
config): a worker process ends itself, as a crash would, exactly mid-prefill, mid-transfer (either
side) or mid-decode. Every time: the affected requests are retried or migrate and finish exactly as
the offline engine does, no stream pauses 5 s or more, the killed worker comes back (Ray restarts it;
its kill point fires in the first incarnation only) and no survivor holds a block afterwards.

The router's own death is in tests/multinode/test_router_fault.py (it needs ``serve`` in a process
of its own)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from splitserve.client import Client
from tests.serving.conftest import start_deployment, wait_for

PROMPTS = [list(range(1, 30)), list(range(100, 140)), list(range(300, 320)), list(range(500, 545))]
SAMPLING = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
MAX_PAUSE_S = 5.0

# name: (deployment overrides, the worker that dies). Transfers go by single layers, so a request's
# KV takes several payload messages and "after 1 message" is mid-transfer.
SCENARIOS = {
    "prefill_mid_prefill": ({"prefill": {"replicas": 2, "threads": 1}},
                            {"target": "prefill-0", "at": "prefill", "after": 0}),
    "prefill_mid_transfer": ({"prefill": {"replicas": 2, "threads": 1}},
                             {"target": "prefill-0", "at": "transfer", "after": 1}),
    "decode_mid_transfer": ({"decode": {"replicas": 2, "threads": 1}},
                            {"target": "decode-0", "at": "transfer", "after": 1}),
    "decode_mid_stream": ({"decode": {"replicas": 2, "threads": 1}},
                          {"target": "decode-0", "at": "decode", "after": 8}),
}  # fmt: skip


@pytest.fixture(scope="module")
def reference(serving_model):
    from engine import LLM, SamplingParams

    llm = LLM(serving_model, dtype="float32", num_blocks=256)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**SAMPLING))]


def timed_stream(address: str, prompt: list[int]) -> dict:
    """One stream: its tokens, finish reason, re-prefills and the longest pause between messages."""
    tokens, finish, reprefills, longest = [], 0, 0, 0.0
    with Client(address) as client:
        last = time.monotonic()
        for message in client.stream(token_ids=prompt, timeout_s=60, **SAMPLING):
            now = time.monotonic()
            longest, last = max(longest, now - last), now
            tokens.extend(message.token_ids)
            if message.finish_reason:
                finish, reprefills = message.finish_reason, message.timing.reprefills
    return {"tokens": tokens, "finish": finish, "reprefills": reprefills, "longest_pause_s": longest}


def status(deployment) -> dict:
    return {w.worker_id: w for w in Client(deployment.address).status().workers}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_worker_killed_at_its_fault_point(ray_session, serving_model, reference, scenario):
    overrides, kill = SCENARIOS[scenario]
    deployment = start_deployment(
        serving_model, **{"prefill": {"threads": 1}, "decode": {"threads": 1}, **overrides},
        transfer={"whole_request_bytes": 0, "layer_group_size": 1},
        faults={"decode_step_delay_s": 0.02, "kill": [kill]},
    )  # fmt: skip
    try:
        victim = kill["target"]
        first = status(deployment)[victim].incarnation
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: timed_stream(deployment.address, p), PROMPTS))
        for result, want in zip(results, reference):
            assert result["tokens"] == want, "a retried or migrated request must finish exactly"
            assert result["finish"] == 2  # FINISH_REASON_LENGTH
            assert result["longest_pause_s"] < MAX_PAUSE_S, result
        if kill["at"] != "prefill":  # mid-transfer or mid-decode: tokens had reached the client
            assert sum(r["reprefills"] for r in results) >= 1, "some request must have moved"
        # The worker died at its point (a new incarnation), came back, and nobody holds a block.
        wait_for(lambda: (w := status(deployment).get(victim)) is not None and w.healthy and w.incarnation != first, 60)
        wait_for(lambda: all(w.kv_blocks_in_use == 0 for w in status(deployment).values()), 15)
        # It runs clean now: the same requests again, no move.
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            again = list(pool.map(lambda p: timed_stream(deployment.address, p), PROMPTS))
        assert [r["tokens"] for r in again] == reference
        assert status(deployment)[victim].incarnation != first
    finally:
        deployment.stop()
