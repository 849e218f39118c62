"""``splitserve bench sweep``: one run per request rate, SLO attainment per rate, and goodput in
DistServe's sense: the highest rate whose attainment reaches the target.

Every rate gets the same number of requests from the same dataset, but fresh prompts (the dataset's
seed plus the rate's index): with the same prompts, each run after the first would be served from
the prefix cache the previous runs filled, and latency would fall as the rate rises.

Attainment at a rate is the fraction of *all* requests (a failed one counts as missing) that meet
every given SLO. Goodput is found on the measured curve: the highest rate that meets the target,
linearly interpolated towards the next rate (which misses it) at the point where the line between the
two crosses the target. If even the lowest rate misses, goodput is below the range ("below_range",
reported as 0); if the highest rate meets it, goodput is at least that rate ("at_least").
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from splitserve.bench.arrivals import arrival_offsets
from splitserve.bench.datasets import BenchRequest
from splitserve.bench.metrics import format_summary
from splitserve.bench.runner import BenchConfig, benchmark
from splitserve.bench.timeline import format_timeline


def parse_rates(text: str) -> list[float]:
    """``"1,2,4,8"`` -> ``[1.0, 2.0, 4.0, 8.0]``: finite, positive, sorted, distinct."""
    try:
        rates = sorted({float(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise ValueError(f"--rates: expected comma-separated numbers, got {text!r}") from None
    if not rates or not all(0 < r < float("inf") for r in rates):
        raise ValueError(f"--rates: each rate must be a finite number > 0, got {text!r}")
    return rates


def slo_attainment(result: dict) -> float:
    """Requests meeting every SLO over all requests sent (failed ones miss)."""
    return (result["good_requests"] or 0) / result["num_prompts"]


def goodput_rate(rates: Sequence[float], attainments: Sequence[float], target: float) -> dict:
    """``{"rate", "status", "between"}``: status is "interpolated", "at_least" or "below_range"."""
    assert len(rates) == len(attainments) > 0 and list(rates) == sorted(rates)
    meeting = [i for i, a in enumerate(attainments) if a >= target]
    if not meeting:
        return {"rate": 0.0, "status": "below_range", "between": [0.0, rates[0]]}
    hi = meeting[-1]
    if hi == len(rates) - 1:
        return {"rate": rates[hi], "status": "at_least", "between": [rates[hi], None]}
    r0, r1, a0, a1 = rates[hi], rates[hi + 1], attainments[hi], attainments[hi + 1]
    return {"rate": r0 + (a0 - target) / (a0 - a1) * (r1 - r0), "status": "interpolated", "between": [r0, r1]}


def describe_goodput(goodput: dict, target: float) -> str:
    pct = f"{target:.0%}"
    if goodput["status"] == "below_range":
        return f"goodput: below {goodput['between'][1]:g} req/s (the lowest rate already misses {pct} attainment)"
    if goodput["status"] == "at_least":
        return f"goodput: >= {goodput['rate']:g} req/s (the highest rate still meets {pct} attainment)"
    low, high = goodput["between"]
    return f"goodput: {goodput['rate']:.3g} req/s at {pct} SLO attainment (between {low:g} and {high:g} req/s)"


def run_sweep(
    requests: Callable[[int], Sequence[BenchRequest]],
    config: BenchConfig,
    rates: Sequence[float],
    target: float,
    out_dir: str | Path,
    model_id: str = "",
    dataset: str = "",
    run: Callable[..., dict] | None = None,
) -> dict:
    """Runs ``requests(i)`` at the i-th rate (the same arrival seed for every rate), writes
    ``rate_<R>.json`` per rate, ``sweep.json`` and the plots into ``out_dir``; returns sweep.json's content.

    ``run`` stands in for ``benchmark`` (the same arguments, the same result keys): a simulator's, so that a
    simulated sweep gets the same requests, arrivals, attainment and files as a measured one."""
    from splitserve.bench.plots import plot_sweep  # matplotlib: loaded only for a sweep

    if not 0 < target <= 1:
        raise ValueError(f"--attainment: must be in (0, 1], got {target}")
    if not config.goodput:
        raise ValueError("--goodput: a sweep needs at least one SLO, e.g. --goodput ttft:500 tpot:50")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # The plots show p50 (the median), p90 and p99 whatever --percentiles says.
    config = replace(config, percentiles=tuple(sorted({*config.percentiles, 90.0, 99.0})))
    run = run or benchmark  # looked up at the call, not at the definition (the tests replace benchmark)
    per_rate = []
    for i, rate in enumerate(rates):
        batch = requests(i)
        offsets = arrival_offsets(len(batch), rate, config.burstiness, config.seed)
        result = run(batch, offsets, replace(config, request_rate=rate), model_id, dataset)
        result["slo_attainment"] = slo_attainment(result)
        (out / f"rate_{rate:g}.json").write_text(json.dumps(result, indent=2))
        print(format_summary(result, config.percentiles), file=sys.stderr)
        if "timeline" in result:  # a measured run of a splitserve deployment (splitserve.bench.timeline)
            print(format_timeline(result["timeline"]), file=sys.stderr)
        print(f"rate {rate:g} req/s: SLO attainment {result['slo_attainment']:.1%}", file=sys.stderr)
        # sweep.json keeps the summary; the per-request lists stay in rate_<R>.json.
        per_rate.append({k: v for k, v in result.items() if not isinstance(v, list)})
    goodput = goodput_rate(rates, [r["slo_attainment"] for r in per_rate], target)
    sweep = {
        "model_id": model_id,
        "dataset": dataset,
        "num_prompts": len(batch),
        "slos_ms": dict(config.goodput),
        "attainment_target": target,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "rates": list(rates),
        "goodput": goodput | {"text": describe_goodput(goodput, target)},
        "results": per_rate,
        "plots": [p.name for p in plot_sweep(per_rate, target, goodput, out)],
    }
    (out / "sweep.json").write_text(json.dumps(sweep, indent=2))
    return sweep
