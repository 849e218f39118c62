"""The sweep's PNG plots: TTFT and TPOT percentiles against the request rate, and SLO attainment
against the rate with the target and the goodput marked. Uses matplotlib's ``Figure`` directly
(the Agg canvas, no pyplot state, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

PERCENTILE_KEYS = (("p50", "median"), ("p90", "p90"), ("p99", "p99"))


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def plot_latency(results: Sequence[dict], metric: str, label: str, slo_ms: float | None, path: Path) -> Path:
    """p50/p90/p99 of ``metric`` ("ttft" or "tpot") against the configured request rate."""
    rates = [r["request_rate"] for r in results]
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for name, key in PERCENTILE_KEYS:
        ax.plot(rates, [r[f"{key}_{metric}_ms"] for r in results], marker="o", label=name)
    if slo_ms is not None:
        ax.axhline(slo_ms, color="red", linestyle="--", label=f"SLO {slo_ms:g} ms")
    ax.set(xlabel="request rate (req/s)", ylabel=f"{label} (ms)", title=f"{label} against request rate")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_attainment(results: Sequence[dict], target: float, goodput: dict, path: Path) -> Path:
    rates = [r["request_rate"] for r in results]
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.plot(rates, [100 * r["slo_attainment"] for r in results], marker="o", label="SLO attainment")
    ax.axhline(100 * target, color="red", linestyle="--", label=f"target {target:.0%}")
    if goodput["status"] == "interpolated":
        ax.axvline(goodput["rate"], color="green", linestyle=":", label=f"goodput {goodput['rate']:.3g} req/s")
    ax.set(
        xlabel="request rate (req/s)",
        ylabel="requests meeting every SLO (%)",
        ylim=(0, 105),
        title="SLO attainment against request rate",
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_sweep(results: Sequence[dict], target: float, goodput: dict, out_dir: Path) -> list[Path]:
    """ttft.png, tpot.png and attainment.png in ``out_dir``."""
    slos = results[0]["goodput_slos_ms"] if results else {}
    return [
        plot_latency(results, "ttft", "TTFT", slos.get("ttft"), out_dir / "ttft.png"),
        plot_latency(results, "tpot", "TPOT", slos.get("tpot"), out_dir / "tpot.png"),
        plot_attainment(results, target, goodput, out_dir / "attainment.png"),
    ]
