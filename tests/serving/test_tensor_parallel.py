"""Tensor-parallel workers served end to end on the embedded Ray: each worker is one Ray actor per rank in
a placement group, its ranks joined by their own gloo group; the KV moves head by head between workers of
different sizes; the router sees one worker per placement group.

Covered, against the offline engine at TP 1 on the same checkpoint (greedy, fp32, under the parity tie
rule with transformers' logit gaps):

- prefill TP 2 -> decode TP 1, TP 1 -> TP 2, and TP 2 -> TP 2 with Llama's one KV head replicated on
  both ranks of both workers (each decode rank gets it from prefill rank 0; prefill rank 1 sends nothing);
- a colocated worker at TP 2;
- a prefill rank killed mid-prefill and a decode rank killed mid-decode (kill points of the first
  request): the prefill is retried and the request migrates, each worker comes back as a new group, the
  output is unchanged, and no rank holds a block or a transfer part afterwards;
- a prefill rank that stalls (SIGSTOP) fails its worker within the group's timeout, and the request is
  retried on the group Ray restarts;
- a request cancelled mid-transfer frees its blocks and its transfer parts on every rank.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from splitserve.client.grpc_client import Client, make_request
from splitserve.v1 import splitserve_pb2_grpc as pb_grpc
from tests.engine.parity import assert_matches, hf_greedy, make_prompts
from tests.serving.conftest import start_deployment, wait_for
from tests.serving.test_serving import run_concurrently

NEW_TOKENS = 16
TIE_GAP = 1e-3
PROMPTS = make_prompts(5, [5, 40, 70])
GREEDY = {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
GROUP_TIMEOUT_S = 3.0  # engine.tensor_parallel_timeout_s of these deployments
HOLD_S = 3.0  # the pause of a ``hold-`` request's transfer, on every sending rank


def tp(size: int, **role) -> dict:
    return {"threads": 1, "tensor_parallel_size": size, **role}


@pytest.fixture(scope="module")
def references(serving_model, arch_model_dirs) -> dict[str, list[tuple[list[int], list[int], list[float]]]]:
    """Per model: for each prompt, the offline engine's greedy tokens (TP 1) and transformers' tokens and gaps."""
    import torch
    from transformers import AutoModelForCausalLM

    from splitserve.engine import LLM, SamplingParams

    refs = {}
    for name, model_dir in {"tiny": serving_model, "llama": arch_model_dirs["llama"]}.items():
        offline = LLM(model_dir, dtype="float32", num_blocks=256).generate(PROMPTS, SamplingParams(**GREEDY))
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        refs[name] = [(o.token_ids, *hf_greedy(hf, p, NEW_TOKENS)) for o, p in zip(offline, PROMPTS)]
    return refs


def assert_equals_offline(outputs: list[list[int]], refs, what: str) -> None:
    """Token for token the offline engine's (and, under the tie rule, transformers')."""
    for i, (ours, (offline, hf, gaps)) in enumerate(zip(outputs, refs)):
        assert_matches(ours, offline, gaps, TIE_GAP, f"{what} vs the offline engine, prompt {i}")
        assert_matches(ours, hf, gaps, TIE_GAP, f"{what} vs transformers, prompt {i}")
    assert len({tuple(o) for o in outputs}) == len(outputs), "different prompts gave the same output"


def serve_all(deployment) -> list[list[int]]:
    return [out.token_ids for out in run_concurrently(deployment.address, PROMPTS, **GREEDY)]


def assert_at_rest(deployment) -> None:
    """No block in use on any worker and no KV transfer part on any rank of any worker."""

    def at_rest():
        ranks = {w: deployment.rank_status(w) for w in deployment.actors}
        busy = {w: r for w, r in ranks.items() if r[0]["blocks_in_use"] or any(rank["parts"] for rank in r)}
        return not busy and not deployment.router.inflight

    wait_for(at_rest, timeout_s=15)


def rank_pids(deployment, worker_id: str) -> list[int]:
    return [rank["pid"] for rank in deployment.rank_status(worker_id)]


def sizes(deployment) -> dict[str, int]:
    return {w.worker_id: w.tensor_parallel_size for w in Client(deployment.address).status().workers}


def assert_gone(pid: int) -> None:
    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, timeout_s=15)


# ---- prefill TP 2 -> decode TP 1 ------------------------------------------------------------------


@pytest.fixture(scope="module")
def p2_d1(ray_session, serving_model):
    deployment = start_deployment(
        serving_model, prefill=tp(2), decode=tp(1), engine={"tensor_parallel_timeout_s": GROUP_TIMEOUT_S}
    )
    yield deployment
    deployment.stop()


def test_prefill_tp2_to_decode_tp1_equals_the_offline_engine(p2_d1, references):
    assert sizes(p2_d1) == {"prefill-0": 2, "decode-0": 1}
    assert len(set(rank_pids(p2_d1, "prefill-0"))) == 2, "two ranks, two processes"
    pids = rank_pids(p2_d1, "prefill-0")
    assert_equals_offline(serve_all(p2_d1), references["tiny"], "prefill TP 2 -> decode TP 1")
    assert_at_rest(p2_d1)
    time.sleep(2 * GROUP_TIMEOUT_S)  # idle past the group's timeout: rank 0's ticks keep its ranks waiting
    assert rank_pids(p2_d1, "prefill-0") == pids, "an idle group stays up"


def test_a_stalled_rank_fails_its_worker_within_the_group_timeout(p2_d1, references):
    """SIGSTOP on prefill rank 1: rank 0's next collective waits out the group's timeout, its process
    ends, Ray restarts the group (the stopped rank goes with its owner) and the request is retried there."""
    before = rank_pids(p2_d1, "prefill-0")
    os.kill(before[1], signal.SIGSTOP)
    try:
        with Client(p2_d1.address) as client:
            out = client.generate(token_ids=PROMPTS[1], timeout_s=90, **GREEDY)
    finally:
        try:
            os.kill(before[1], signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert_matches(out.token_ids, *references["tiny"][1][::2], TIE_GAP, "after the stalled rank")
    after = rank_pids(p2_d1, "prefill-0")
    assert not set(after) & set(before), "a new group: both ranks are new processes"
    assert_gone(before[1])
    assert_at_rest(p2_d1)


# ---- prefill TP 1 -> decode TP 2 ------------------------------------------------------------------


@pytest.fixture(scope="module")
def p1_d2(ray_session, serving_model, p2_d1):
    p2_d1.stop()  # one deployment at a time on the two cores
    deployment = start_deployment(serving_model, prefill=tp(1), decode=tp(2))
    yield deployment
    deployment.stop()


def test_prefill_tp1_to_decode_tp2_equals_the_offline_engine(p1_d2, references):
    assert sizes(p1_d2) == {"prefill-0": 1, "decode-0": 2}
    assert_equals_offline(serve_all(p1_d2), references["tiny"], "prefill TP 1 -> decode TP 2")
    assert_at_rest(p1_d2)


def assert_samples_equal_single_requests(deployment) -> None:
    """n = 3 seeded samples of one prompt (forked on rank 0, computed on every rank) equal single requests
    with seed + i."""
    sampling = dict(max_tokens=NEW_TOKENS, temperature=1.0, seed=21, ignore_eos=True)
    message = make_request(token_ids=PROMPTS[1], **sampling)
    message.n = 3
    with grpc.insecure_channel(deployment.address) as channel:
        messages = list(pb_grpc.SplitServeStub(channel).Generate(message, timeout=60))
    samples = [[t for m in messages if m.choice == i for t in m.token_ids] for i in range(3)]
    with Client(deployment.address) as client:
        singles = [client.generate(token_ids=PROMPTS[1], **{**sampling, "seed": 21 + i}).token_ids for i in range(3)]
    assert samples == singles and len({tuple(s) for s in samples}) == 3


def test_samples_fork_on_a_tp2_decode_worker(p1_d2):
    assert_samples_equal_single_requests(p1_d2)
    assert_at_rest(p1_d2)


# ---- prefill TP 2 -> decode TP 2, one KV head replicated on every rank ---------------------------


@pytest.fixture(scope="module")
def llama_p2_d2(ray_session, arch_model_dirs, p1_d2):
    p1_d2.stop()
    deployment = start_deployment(
        arch_model_dirs["llama"],
        prefill=tp(2),
        decode=tp(2),
        engine={"tensor_parallel_timeout_s": GROUP_TIMEOUT_S},
        transfer={"whole_request_bytes": 0, "layer_group_size": 1},  # several messages per part
        faults={
            # The first request: prefill rank 1 dies as its first prefill step starts, decode rank 1 as
            # its fifth decode step does. A restarted group runs clean.
            "kill": [
                {"target": "prefill-0", "at": "prefill", "after": 0, "rank": 1},
                {"target": "decode-0", "at": "decode", "after": 4, "rank": 1},
            ],
            "transfer": [
                {
                    "role": "sender",
                    "action": "pause",
                    "after_messages": 1,
                    "seconds": HOLD_S,
                    "request_id_prefix": "hold-",
                }
            ],
        },
    )
    yield deployment
    deployment.stop()


def test_ranks_killed_mid_prefill_and_mid_decode_retry_then_migrate(llama_p2_d2, references):
    dep = llama_p2_d2
    before = {w: rank_pids(dep, w) for w in ("prefill-0", "decode-0")}
    metrics = dep.router.metrics
    retries, migrations = metrics.prefill_retries._value.get(), metrics.migrations._value.get()
    with Client(dep.address) as client:
        out = client.generate(token_ids=PROMPTS[2], timeout_s=120, **GREEDY)
    assert metrics.prefill_retries._value.get() == retries + 1, "the prefill was retried once"
    assert metrics.migrations._value.get() == migrations + 1, "the request migrated once"
    assert_matches(out.token_ids, *references["llama"][2][::2], TIE_GAP, "killed ranks, llama")
    for worker_id, pids in before.items():
        assert not set(rank_pids(dep, worker_id)) & set(pids), f"{worker_id}: a new group"
        assert_gone(pids[1])
    assert_at_rest(dep)


def test_tp2_to_tp2_with_replicated_kv_heads_equals_the_offline_engine(llama_p2_d2, references):
    assert sizes(llama_p2_d2) == {"prefill-0": 2, "decode-0": 2}
    assert_equals_offline(serve_all(llama_p2_d2), references["llama"], "prefill TP 2 -> decode TP 2, llama")
    assert_at_rest(llama_p2_d2)


def test_cancel_mid_transfer_frees_blocks_and_parts_on_every_rank(llama_p2_d2):
    dep = llama_p2_d2
    seen = {}
    with Client(dep.address) as client:
        stream = client.stream(token_ids=PROMPTS[2], request_id="hold-tp-cancel", **{**GREEDY, "max_tokens": 50})
        for message in stream:
            if message.token_ids:  # the first token: the KV is held mid-transfer on the sending ranks
                seen = {w: dep.rank_status(w) for w in ("prefill-0", "decode-0")}
                break
        stream.close()
    decode_ranks = seen["decode-0"]
    assert all(rank["parts"] == 1 for rank in decode_ranks), f"each decode rank expects its part: {decode_ranks}"
    assert decode_ranks[0]["blocks_in_use"] > 0, "the lease is held while the KV moves"
    assert_at_rest(dep)
    with Client(dep.address) as client:  # the pairs live on
        assert len(client.generate(token_ids=PROMPTS[0], timeout_s=60, **GREEDY).token_ids) == NEW_TOKENS


# ---- colocated TP 2 -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def colocated_tp2(ray_session, serving_model, llama_p2_d2):
    llama_p2_d2.stop()
    deployment = start_deployment(serving_model, mode="colocated", colocated=tp(2))
    yield deployment
    deployment.stop()


def test_colocated_tp2_equals_the_offline_engine(colocated_tp2, references):
    assert sizes(colocated_tp2) == {"colocated-0": 2}
    assert_equals_offline(serve_all(colocated_tp2), references["tiny"], "colocated TP 2")
    assert_at_rest(colocated_tp2)


def test_samples_fork_on_a_colocated_tp2_worker(colocated_tp2):
    assert_samples_equal_single_requests(colocated_tp2)
    assert_at_rest(colocated_tp2)
