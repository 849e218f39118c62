"""When each request is due, as offsets in seconds from the start of the benchmark.

Open loop as in vLLM's ``benchmark_serving``: the gaps between arrivals are gamma-distributed with
shape ``burstiness`` and scale ``1 / (rate * burstiness)``, so the mean rate is ``rate`` whatever the
burstiness and the coefficient of variation of the gaps is ``1 / sqrt(burstiness)``: 1 is a Poisson
process, below 1 burstier, above 1 more regular. ``rate = inf`` sends everything at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def arrival_gaps(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """``num`` gaps in seconds; the first request goes at 0 and request i at the sum of the first i gaps."""
    if not rate > 0:
        raise ValueError(f"--request-rate: must be > 0 (or inf), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"--burstiness: must be a positive number, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num).tolist()


def arrival_offsets(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Offsets of ``num`` requests: 0, then the running sum of ``arrival_gaps``."""
    gaps = arrival_gaps(num, rate, burstiness, seed)
    return [0.0, *np.cumsum(gaps[: max(num - 1, 0)]).tolist()][:num]


def trace_offsets(timestamps_ms: Sequence[float], time_scale: float = 1.0) -> list[float]:
    """Offsets of a replayed trace: its timestamps (ms) relative to the earliest, times ``time_scale``
    (2 replays it at half speed, 0.5 at twice the speed)."""
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ValueError(f"--time-scale: must be a positive number, got {time_scale}")
    start = min(timestamps_ms, default=0.0)
    return [(t - start) / 1e3 * time_scale for t in timestamps_ms]
