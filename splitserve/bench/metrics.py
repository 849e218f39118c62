"""Per-request records and the metrics over them, with vLLM's definitions (``benchmark_serving``):

- TTFT: from the moment the request is sent to the first message carrying tokens;
- TPOT, per request: ``(E2EL - TTFT) / (output_tokens - 1)``, for requests with more than one output
  token (a one-token request counts as TPOT 0 for goodput, as in vLLM);
- ITL: the gaps between consecutive messages carrying tokens, pooled over all requests;
- E2EL: sent to the last message;
- throughputs over the benchmark's duration, from successful requests only;
- goodput: successful requests meeting every given SLO, per second.

Mean, median, (population) std and percentiles use numpy, as vLLM does; an empty list counts as [0].
The client-side queue time (due to actually sent: a full ``--max-concurrency`` or a late event loop)
is kept apart and never included in TTFT.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")
# The router's Timing fields (ms) and their labels in the summary.
SERVER_TIMINGS = {
    "queue_ms": "Router queue",
    "prefill_ms": "Prefill (dispatch to 1st token)",
    "transfer_ms": "KV transfer (1st token to landed)",
    "first_token_ms": "First token (router TTFT)",
    "decode_ms": "Decode (1st to last token)",
    "total_ms": "Total",
}


@dataclass
class RequestRecord:
    """What one request did; times in seconds (``due_s`` and ``sent_s`` from the benchmark's start)."""

    input_len: int
    expected_output_len: int
    due_s: float = 0.0
    sent_s: float = 0.0
    ttft_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    e2el_s: float = 0.0
    output_len: int = 0  # tokens received
    cached_tokens: int = 0
    server_timing: dict[str, float] = field(default_factory=dict)  # the router's, from the last message
    error_code: str = ""  # a gRPC status code name (or an exception's type); "" on success
    error: str = ""
    finished: bool = False  # set once the call ended, either way (a load client reports these while it runs)

    @property
    def success(self) -> bool:
        return not self.error_code

    @property
    def client_queue_s(self) -> float:
        return self.sent_s - self.due_s

    @property
    def tpot_s(self) -> float:
        return (self.e2el_s - self.ttft_s) / (self.output_len - 1) if self.output_len > 1 else 0.0


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (SLOs in ms, vLLM's syntax)."""
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput: {item!r} is not KEY:VALUE with KEY one of {', '.join(SLO_KEYS)}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {key}: {value!r} is not a number of milliseconds") from None
        if not slos[key] >= 0:
            raise ValueError(f"--goodput: {key}: must be >= 0 ms, got {value}")
    return slos


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"90,95,99"`` -> ``(90.0, 95.0, 99.0)``."""
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--percentiles: expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--percentiles: each must be in [0, 100], got {text!r}")
    return values


def percentile_word(p: float) -> str:
    """90.0 -> "90", 99.9 -> "99.9": the ``p{word}_ttft_ms`` keys."""
    return str(int(p)) if int(p) == p else str(p)


def meets_slos(record: RequestRecord, slos: Mapping[str, float]) -> bool:
    """A successful request within every given SLO (ms)."""
    if not record.success:
        return False
    values_ms = {"ttft": record.ttft_s * 1e3, "tpot": record.tpot_s * 1e3, "e2el": record.e2el_s * 1e3}
    return all(values_ms[key] <= limit for key, limit in slos.items())


def stats_ms(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """``mean_{name}_ms``, ``median_``, ``std_`` and ``p{P}_`` of values given in seconds."""
    ms = np.asarray(values_s if len(values_s) else [0.0], dtype=float) * 1e3
    out = {
        f"mean_{name}_ms": float(np.mean(ms)),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(np.std(ms)),
    }
    for p in percentiles:
        out[f"p{percentile_word(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = (90, 95, 99),
    slos: Mapping[str, float] | None = None,
) -> dict:
    """The run's metrics under vLLM's result keys (plus splitserve's own: failures, client queue,
    server timing). ``request_goodput`` is None without SLOs, as in vLLM."""
    ok = [r for r in records if r.success]
    total_input = sum(r.input_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    good = sum(meets_slos(r, slos) for r in ok) if slos else 0
    timed = [r.server_timing for r in ok if r.server_timing]
    result = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "failures": dict(Counter(r.error_code for r in records if not r.success)),
        "duration": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good / duration_s if slos else None,
        "good_requests": good if slos else None,
        "goodput_slos_ms": dict(slos or {}),
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    result |= stats_ms("ttft", [r.ttft_s for r in ok], percentiles)
    result |= stats_ms("tpot", [r.tpot_s for r in ok if r.output_len > 1], percentiles)
    result |= stats_ms("itl", [gap for r in ok for gap in r.itls_s], percentiles)
    result |= stats_ms("e2el", [r.e2el_s for r in ok], percentiles)
    result |= stats_ms("client_queue", [r.client_queue_s for r in records], percentiles)
    for key in SERVER_TIMINGS:
        result[f"mean_server_{key}"] = float(np.mean([t[key] for t in timed])) if timed else 0.0
    return result


def per_request_lists(records: Sequence[RequestRecord]) -> dict[str, list]:
    """vLLM's per-request lists, in request order, in seconds; a failed request has 0 times, output
    length 0 and its error ("CODE: details"); ``tpots`` is 0 for a request with one output token."""
    return {
        "input_lens": [r.input_len for r in records],
        "output_lens": [r.output_len if r.success else 0 for r in records],
        "expected_output_lens": [r.expected_output_len for r in records],
        "ttfts": [r.ttft_s if r.success else 0.0 for r in records],
        "itls": [r.itls_s if r.success else [] for r in records],
        "tpots": [r.tpot_s if r.success else 0.0 for r in records],
        "e2els": [r.e2el_s if r.success else 0.0 for r in records],
        "client_queue_times": [r.client_queue_s for r in records],
        "cached_lens": [r.cached_tokens for r in records],
        "server_timings": [r.server_timing for r in records],
        "errors": [r.error for r in records],
    }


def format_summary(result: Mapping, percentiles: Sequence[float] = (90, 95, 99)) -> str:
    """The terminal table, laid out as vLLM's "Serving Benchmark Result"."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value, fmt: str = "") -> None:
        lines.append(f"{label:<40} {'None' if value is None else format(value, fmt)}")

    if "client_machine" in result:
        from splitserve.engine.hardware import cpu_summary

        row("Client machine:", cpu_summary(result["client_machine"]))
    if clients := result.get("ray_clients"):  # splitserve.bench.ray_clients
        row("Load clients (Ray):", f"{clients['clients']} on {clients['nodes']} node(s)")
        row("Client clock offset, max (ms):", clients["max_clock_offset_ms"], ".3f")
        row("Client clock uncertainty (ms):", clients["clock_uncertainty_ms"], ".3f")
        row("Load clients lost:", len(clients["clients_lost"]))
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    for code, count in sorted(result["failures"].items()):
        row(f"  {code}:", count)
    row("Maximum request concurrency:", result.get("max_concurrency"))
    rate = result.get("request_rate", "inf")
    if rate == "trace":
        row("Arrivals:", f"trace timestamps x {result.get('time_scale', 1.0):g}")
    elif rate != "inf":
        row("Request rate configured (RPS):", rate, ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for key, name, header in (
        ("ttft", "TTFT", "Time to First Token"),
        ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
        ("itl", "ITL", "Inter-token Latency"),
        ("e2el", "E2EL", "End-to-end Latency"),
        ("client_queue", "client queue", "Client-side Queue Time"),
    ):
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", result[f"mean_{key}_ms"], ".2f")
        row(f"Median {name} (ms):", result[f"median_{key}_ms"], ".2f")
        for p in percentiles:
            word = percentile_word(p)
            row(f"P{word} {name} (ms):", result[f"p{word}_{key}_ms"], ".2f")
    lines.append("{s:{c}^{n}}".format(s="Server-side Timing (router, mean)", n=50, c="-"))
    for key, label in SERVER_TIMINGS.items():
        row(f"{label} (ms):", result[f"mean_server_{key}"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
