"""The open-loop arrival process: mean rate and burstiness as asked, seeded; ``inf`` sends at once."""

from __future__ import annotations

import math

import numpy as np
import pytest

from splitserve.bench.arrivals import arrival_gaps, arrival_offsets, trace_offsets


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_gaps_have_the_mean_rate_and_the_coefficient_of_variation(burstiness):
    rate = 8.0
    gaps = np.asarray(arrival_gaps(20_000, rate, burstiness, seed=3))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)  # 1 for Poisson, higher when burstier
    assert (gaps >= 0).all()


def test_seeded_and_different_across_seeds():
    assert arrival_gaps(100, 5.0, 1.0, seed=1) == arrival_gaps(100, 5.0, 1.0, seed=1)
    assert arrival_gaps(100, 5.0, 1.0, seed=1) != arrival_gaps(100, 5.0, 1.0, seed=2)


def test_offsets_start_at_zero_and_accumulate_the_gaps():
    gaps = arrival_gaps(5, 2.0, 1.0, seed=0)
    offsets = arrival_offsets(5, 2.0, 1.0, seed=0)
    assert offsets[0] == 0.0 and len(offsets) == 5
    assert offsets == pytest.approx(np.cumsum([0.0, *gaps[:4]]).tolist())
    assert arrival_offsets(1, 2.0) == [0.0] and arrival_offsets(0, 2.0) == []


def test_infinite_rate_sends_everything_at_once():
    assert arrival_gaps(50, math.inf) == [0.0] * 50
    assert arrival_offsets(50, math.inf, burstiness=0.3) == [0.0] * 50


def test_bad_rates_name_the_option():
    for rate in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="--request-rate"):
            arrival_gaps(3, rate)
    with pytest.raises(ValueError, match="--burstiness"):
        arrival_gaps(3, 1.0, burstiness=0.0)
    with pytest.raises(ValueError, match="--time-scale"):
        trace_offsets([0.0], time_scale=0.0)


def test_trace_offsets_follow_the_timestamps_scaled():
    assert trace_offsets([100.0, 100.0, 350.0, 1100.0]) == pytest.approx([0.0, 0.0, 0.25, 1.0])
    assert trace_offsets([100.0, 350.0], time_scale=2.0) == pytest.approx([0.0, 0.5])
