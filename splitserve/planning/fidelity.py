"""How a simulated run compares with a measured one (``scripts/sim_fidelity.py``, docs/planning.md).

Everything here works on results with ``splitserve bench``'s keys and per-request lists (``ttfts``,
``e2els``, ``output_lens``, ``errors``): a measured run's, or a simulated one's from
``simulate(..., per_request=True)``. So a run can be judged against SLOs chosen after it ran, and the
measured and the simulated runs of the same requests are judged by the same code:

- ``attainment``: the fraction of *all* requests (a failed one misses) that meet every SLO, by
  ``splitserve.bench.metrics.meets_slos``, the rule behind bench's ``good_requests``;
- ``binding_slos``: SLOs taken from a measured run (its p-th percentile TTFT and TPOT), which its own
  requests and those of a busier run miss in part: unlike SLOs of a few times one request alone;
- ``knee``: the rate where attainment crosses a target on a rate sweep, which is ``splitserve bench
  sweep``'s goodput (``splitserve.bench.sweep.goodput_rate``) with "not reached" said in words.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from splitserve.bench.metrics import RequestRecord, meets_slos, percentile_word, stats_ms
from splitserve.bench.sweep import goodput_rate
from splitserve.planning.simulator import SimConfig, simulate

# TPOT is rebuilt from these (RequestRecord.tpot_s), as bench computed its ``tpots``.
LISTS = ("ttfts", "e2els", "output_lens", "errors")


def records_of(result: Mapping) -> list[RequestRecord]:
    """The requests of a result, rebuilt from its per-request lists (what SLOs are judged on)."""
    missing = [key for key in LISTS if key not in result]
    if missing:
        raise ValueError(
            f"result: no per-request list {missing[0]!r} (a simulated run keeps them with simulate(per_request=True))"
        )
    n = len(result["errors"])
    if any(len(result[key]) != n for key in LISTS):
        raise ValueError(f"result: per-request lists of different lengths ({', '.join(LISTS)})")
    return [
        RequestRecord(
            input_len=0,
            expected_output_len=output_len,
            ttft_s=ttft,
            e2el_s=e2el,
            output_len=output_len,
            error_code=error,  # "" on success: bench's lists keep "CODE: details" for a failed request
            error=error,
        )
        for ttft, e2el, output_len, error in zip(
            result["ttfts"], result["e2els"], result["output_lens"], result["errors"], strict=True
        )
    ]


def attainment(result: Mapping, slos: Mapping[str, float]) -> float:
    """Requests meeting every SLO (ms) over all requests of the run; failed ones miss."""
    if not slos:
        raise ValueError("slos: attainment needs at least one SLO, e.g. {'ttft': 500, 'tpot': 50}")
    records = records_of(result)
    if not records:
        raise ValueError("result: a run of no requests has no attainment")
    return sum(meets_slos(r, slos) for r in records) / len(records)


def goodput(result: Mapping, slos: Mapping[str, float]) -> float:
    """Requests meeting every SLO per second of the run: bench's ``request_goodput`` under ``slos``."""
    return attainment(result, slos) * len(result["errors"]) / result["duration"]


def binding_slos(result: Mapping, percentile: float = 90.0) -> dict[str, float]:
    """``{"ttft", "tpot"}`` in ms: the run's ``percentile``-th percentile TTFT over its successful requests
    and TPOT over those with more than one output token, as bench's summary computes ``p90_ttft_ms``."""
    if not 0 < percentile < 100:
        raise ValueError(f"percentile: must be in (0, 100), got {percentile}")
    records = [r for r in records_of(result) if r.success]
    if not records:
        raise ValueError("result: the run the SLOs are taken from has no successful request")
    streamed = [r.tpot_s for r in records if r.output_len > 1]
    if not streamed:
        raise ValueError("result: no request of the run has more than one output token, so it has no TPOT")
    word = percentile_word(percentile)
    ttft = stats_ms("ttft", [r.ttft_s for r in records], [percentile])[f"p{word}_ttft_ms"]
    tpot = stats_ms("tpot", streamed, [percentile])[f"p{word}_tpot_ms"]
    return {"ttft": round(ttft, 3), "tpot": round(tpot, 3)}


def relative_error(real: float, sim: float) -> float | None:
    """|sim - real| / real; 0 when both are 0, None when only the real figure is 0 (no scale)."""
    if real:
        return abs(sim - real) / real
    return 0.0 if sim == 0 else None


def compare_under(real: Mapping, sim: Mapping, slos: Mapping[str, float]) -> dict:
    """A measured and a simulated run of the same requests judged by the same SLOs: attainment (and its
    error, sim - real in percentage points: positive where the simulator is optimistic) and goodput (and
    its relative error)."""
    out = {"slos_ms": dict(slos)}
    for side, result in (("real", real), ("sim", sim)):
        out[f"{side}_attainment"] = attainment(result, slos)
        out[f"{side}_goodput"] = goodput(result, slos)
    out["attainment_error_pp"] = 100 * (out["sim_attainment"] - out["real_attainment"])
    out["goodput_error"] = relative_error(out["real_goodput"], out["sim_goodput"])
    return out


def sweep_rates(capacity: float, points: int, low: float, high: float) -> list[float]:
    """``points`` rates evenly from ``low`` to ``high`` times ``capacity`` (req/s, 3 decimals, >= 0.01)."""
    if points < 2:
        raise ValueError(f"--sweep-points: a sweep needs at least 2 rates to find a crossing, got {points}")
    if not 0 < low < high:
        raise ValueError(f"--sweep-range: expected 0 < LOW < HIGH, got {low},{high}")
    if not capacity > 0:
        raise ValueError(f"capacity: must be > 0 req/s, got {capacity}")
    rates = [round(max(capacity * (low + (high - low) * i / (points - 1)), 0.01), 3) for i in range(points)]
    if len(set(rates)) != len(rates):
        raise ValueError(
            f"--sweep-points: {points} points over {low}-{high} x {capacity:g} req/s repeat a rate: {rates}"
        )
    return rates


def knee(rates: Sequence[float], attainments: Sequence[float], target: float = 0.9) -> dict:
    """Where attainment falls below ``target`` on a sweep: ``goodput_rate``'s ``{"rate", "status",
    "between"}`` and a ``"text"``.

    Between two rates the crossing is linear between them; a rate that meets the target exactly is the
    knee itself. On a curve that is not monotone (noise: a rate that misses, then a higher one that meets)
    the highest rate meeting the target counts, as in ``bench sweep``'s goodput, so that the knee of a
    measured sweep is the goodput its ``sweep.json`` reports. Never crossed within the range: "not reached",
    with the side ("at_least": the highest rate still meets it; "below_range": the lowest already misses).
    """
    if len(rates) != len(attainments) or not rates:
        raise ValueError(f"attainments: expected one per rate ({len(rates)}), got {len(attainments)}")
    if list(rates) != sorted(set(rates)):
        raise ValueError(f"rates: must rise strictly, got {list(rates)}")
    found = goodput_rate(rates, attainments, target)
    if found["status"] == "at_least":
        text = f"not reached (>= {found['rate']:g})"
    elif found["status"] == "below_range":
        text = f"not reached (< {found['between'][1]:g})"
    else:
        text = f"{found['rate']:.3g}"
    return found | {"text": text}


def knee_error(real: Mapping, sim: Mapping) -> float | None:
    """The relative error of the simulated knee; None unless both sweeps crossed within their range."""
    if real["status"] == sim["status"] == "interpolated":
        return relative_error(real["rate"], sim["rate"])
    return None


def compare_knees(
    rates: Sequence[float],
    real: Sequence[Mapping],
    sim: Sequence[Mapping],
    slos: Mapping[str, float],
    target: float = 0.9,
) -> dict:
    """A measured and a simulated sweep over the same rates (one result per rate) judged by ``slos``."""
    if not len(real) == len(sim) == len(rates):
        raise ValueError(f"real, sim: expected one result per rate ({len(rates)}), got {len(real)} and {len(sim)}")
    out: dict = {"slos_ms": dict(slos), "target": target}
    for side, results in (("real", real), ("sim", sim)):
        out[f"{side}_attainments"] = [attainment(r, slos) for r in results]
        out[f"{side}_knee"] = knee(rates, out[f"{side}_attainments"], target)
    out["knee_error"] = knee_error(out["real_knee"], out["sim_knee"])
    return out


def simulator_bench(config: SimConfig) -> Callable[..., dict]:
    """A stand-in for ``splitserve.bench.runner.benchmark`` that runs the requests through the simulator
    (``run_sweep(..., run=simulator_bench(config))``): the same arguments, bench's keys and lists."""

    def run(requests, offsets_s, bench, model_id: str = "", dataset: str = "") -> dict:
        result, _ = simulate(
            config,
            [(r.prompt, r.output_len) for r in requests],
            offsets_s,
            bench.percentiles,
            bench.goodput,
            per_request=True,
        )
        return {
            "backend": "simulate",
            "model_id": model_id,
            "dataset": dataset,
            "num_prompts": len(requests),
            "request_rate": bench.request_rate,
            "burstiness": bench.burstiness,
            **result,
        }

    return run
