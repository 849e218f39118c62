"""A profile of the tiny preset, measured once per session through the real engine (``splitserve
profile``'s code) on a small grid: the measured-profile test checks it, and the planner tests time their
simulations with it."""

from __future__ import annotations

import pytest

TINY_GRID = dict(
    prefill_tokens=(16, 128),
    prefill_contexts=(0, 256),
    decode_batches=(1, 8),
    decode_contexts=(32, 256),
    mixed=((64, 4, 64),),
    transfer_tokens=(16, 512),
    repeats=2,
    decode_steps=3,
)


@pytest.fixture(scope="session")
def tiny_profile(tiny_model_dir):
    from splitserve.planning.measure import Grid, measure_profile

    return measure_profile(str(tiny_model_dir), "float32", "cpu", threads=1, grid=Grid(**TINY_GRID))
