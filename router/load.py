"""The router's own figures of recent load, over a sliding window: what a live planner reads.

Arrivals are counted as requests are admitted; prompt and output lengths, TTFT and TPOT are taken from
each finished request's summary (the same ``Timing`` its client received). Torch-free; the router's event
loop writes it, a reader on the same loop takes ``snapshot``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from splitserve.router.metrics import RequestSummary


@dataclass(frozen=True)
class LoadSnapshot:
    window_s: float
    arrival_rate: float  # requests admitted per second over the window
    finished: int  # requests finished in the window
    mean_prompt_tokens: float
    mean_output_tokens: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float


class Finished(NamedTuple):
    """One finished request as the window keeps it (a tuple: the window holds thousands)."""

    at: float  # when it finished (the window's clock)
    prompt_tokens: int
    completion_tokens: int
    first_token_ms: float
    tpot_ms: float | None  # mean time per output token after the first; None with one output token

    @property
    def arrived(self) -> float:
        """When it arrived: its end less its first-token time and its decoding time."""
        decode_ms = (self.tpot_ms or 0) * max(self.completion_tokens - 1, 0)
        return self.at - (self.first_token_ms + decode_ms) / 1e3


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (as numpy's default); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


class LoadWindow:
    def __init__(self, window_s: float = 60.0, clock=time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self._arrivals: deque[float] = deque()
        self._finished: deque[Finished] = deque()
        self.started = clock()

    def arrived(self) -> None:
        self._arrivals.append(self.clock())
        self._trim()

    def ended(self, summary: RequestSummary) -> None:
        if summary.outcome != "finished" or summary.timing is None:
            return
        t = summary.timing
        self.finished(summary.prompt_tokens, summary.completion_tokens, t.first_token_ms, t.decode_ms)

    def finished(self, prompt_tokens: int, completion_tokens: int, first_token_ms: float, decode_ms: float) -> None:
        """A request finished now (``ended``'s figures; the simulated router calls it directly)."""
        tpot = decode_ms / (completion_tokens - 1) if completion_tokens > 1 else None
        self._finished.append(Finished(self.clock(), prompt_tokens, completion_tokens, first_token_ms, tpot))
        self._trim()

    def snapshot(self, window_s: float | None = None, since: float | None = None) -> LoadSnapshot:
        """The window's figures; ``since``: only of the requests that arrived at or after that time (the
        latencies a deployment shows once it has changed, not those of requests that queued before)."""
        now = self.clock()
        window = min(window_s or self.window_s, self.window_s, max(now - self.started, 1e-9))
        arrivals = sum(1 for t in self._arrivals if t >= now - window)
        done = [f for f in self._finished if f.at >= now - window]
        if since is not None:
            done = [f for f in done if f.arrived >= since]
        ttfts = [f.first_token_ms for f in done]
        tpots = [f.tpot_ms for f in done if f.tpot_ms is not None]
        n = len(done)
        return LoadSnapshot(
            window_s=window,
            arrival_rate=arrivals / window,
            finished=n,
            mean_prompt_tokens=sum(f.prompt_tokens for f in done) / n if n else 0.0,
            mean_output_tokens=sum(f.completion_tokens for f in done) / n if n else 0.0,
            ttft_p50_ms=percentile(ttfts, 50),
            ttft_p90_ms=percentile(ttfts, 90),
            tpot_p50_ms=percentile(tpots, 50),
            tpot_p90_ms=percentile(tpots, 90),
        )

    def _trim(self) -> None:
        horizon = self.clock() - self.window_s
        while self._arrivals and self._arrivals[0] < horizon:
            self._arrivals.popleft()
        while self._finished and self._finished[0].at < horizon:
            self._finished.popleft()
