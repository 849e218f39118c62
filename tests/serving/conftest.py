"""Deployments on an embedded Ray for the serving tests: real worker processes (Ray actors), a real
gRPC router, real KV transfers. One Ray for the whole session (``ray_session`` and the checkpoint
``serving_model`` are in tests/conftest.py, shared with the bench and multi-node tests);
deployments per module."""

from __future__ import annotations

import time

import pytest


def start_deployment(model_dir, **overrides):
    from splitserve.deploy.config import DeploymentConfig
    from splitserve.deploy.deployment import Deployment

    raw = {
        "model": str(model_dir),
        "dtype": "float32",
        "port": 0,
        "prefill": {"threads": 1},
        "decode": {"threads": 1},
        **overrides,
    }
    deployment = Deployment(DeploymentConfig.from_dict(raw))
    deployment.start()
    return deployment


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s (last value {value!r})")
        time.sleep(interval_s)


def assert_logprobs_as_offline(model_dir, prompt: list[int], done, k: int = 2) -> None:
    """A served request's log-probabilities (prompt and output) equal the offline engine's, which
    tests/engine/test_logprobs.py holds to transformers' log_softmax."""
    from splitserve.engine import LLM, SamplingParams

    offline = LLM(model_dir, dtype="float32", num_blocks=64)
    sampling = SamplingParams(
        max_tokens=len(done.token_ids), temperature=0.0, ignore_eos=True, logprobs=k, prompt_logprobs=k
    )
    (want,) = offline.generate([prompt], sampling)
    assert done.token_ids == want.token_ids
    assert len(done.prompt_logprobs) == len(prompt) - 1 and len(done.logprobs) == len(done.token_ids)
    for got, ref in zip([*done.prompt_logprobs, *done.logprobs], [*want.prompt_logprobs[1:], *want.logprobs]):
        assert (got.token_id, got.rank) == (ref.token_id, ref.rank)
        assert got.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert [(t.token_id, t.logprob) for t in got.top] == [(t, pytest.approx(v, abs=1e-4)) for t, v in ref.top]
