#!/usr/bin/env python3
"""How close ``splitserve simulate`` comes to ``splitserve bench`` on this machine: ``make sim-fidelity``.

For each preset (random-weight checkpoints written when missing, float32):

1. ``splitserve profile`` twice, as the workers will run: one torch thread (a disaggregated worker pinned
   to a core of its own) and two threads (a colocated worker on both cores), each with what serving adds
   measured on the real deployment of that mode;
2. for each mode, one real deployment on the embedded Ray: 1P+1D (prefill on core 0, decode on core 1,
   one thread each) or one colocated worker (cores 0-1, two threads);
3. for each workload (chat; a long prompt: the summarize preset's shape, scaled to the model) and three
   rates (fractions of the capacity the simulator predicts for that mode and workload under the SLOs),
   the same requests and arrivals through the real router (``splitserve.bench.runner.benchmark``) and
   through the simulator timed by the profile;
4. the relative error |sim - real| / real of TTFT p50 and p90, TPOT p50 and p90, and goodput (requests
   meeting both SLOs per second) on every row;
5. each row judged by two SLO sets: attainment (the fraction of requests meeting both SLOs) real and
   simulated, its error (sim - real, percentage points), and goodput with its relative error;
6. a rate sweep (``splitserve.bench.sweep.run_sweep``) on the real deployment and the same one through the
   simulator, and the capacity knee of each (the rate where attainment crosses 90%) under both SLO sets.

SLO sets per model and workload: "4x/3x", TTFT within 4x and TPOT within 3x what the profile predicts for
one request alone at the workload's 90th-percentile prompt (met by nearly every request at 30% load); and
"binding", the real run's p90 TTFT and p90 TPOT (``--binding-percentile``) at the 60% row, fixed once that
row is measured and applied unchanged to every row and sweep, real and simulated. Nothing here is a timed
assertion: the tables are the result.

    python scripts/sim_fidelity.py [--presets tiny,small,qwen2.5-0.5b] [--quick] [--json-out FILE]
        [--sweep-points 5] [--sweep-requests N] [--sweep-range 0.2,1.2] [--binding-percentile 90]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

FRACTIONS = (0.3, 0.6, 0.9)
BINDING_ROW = 1  # the row whose real run gives the binding SLOs: 60% of the simulated capacity
KNEE_TARGET = 0.9
# Per preset: (chat input/output medians, long-prompt input/output medians, requests per run).
WORKLOADS = {
    "tiny": ((256, 200), (2000, 100), 120),
    "small": ((256, 200), (2000, 64), 40),
    "qwen2.5-0.5b": ((128, 32), (512, 16), 16),
}
# Per preset, the profile grid's prompt lengths and batches where the default's largest points would take
# minutes each on one core (a 2048-token prefill of qwen2.5-0.5b in float32); they still span the rows'.
GRIDS = {
    "qwen2.5-0.5b": dict(prefill_tokens=(16, 64, 256, 1024), decode_batches=(1, 4, 16, 32), repeats=2),
}
METRICS = (
    ("median_ttft_ms", "TTFT p50"),
    ("p90_ttft_ms", "TTFT p90"),
    ("median_tpot_ms", "TPOT p50"),
    ("p90_tpot_ms", "TPOT p90"),
    ("request_goodput", "goodput"),
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_model(preset: str) -> Path:
    path = ROOT / "models" / preset
    if not (path / "config.json").is_file():
        from splitserve.tools.make_model import make_model

        log(f"writing the {preset} preset to {path} ...")
        make_model(preset, path, dtype="float32", overwrite=True)
    return path


def profiles_for(model: Path, preset: str, quick: bool, cache: Path):
    """(one-thread profile with serving overheads, two-thread profile with the same overheads)."""
    from splitserve.deploy.profile import Profile
    from splitserve.planning.measure import Grid, measure_profile, measure_serving, with_serving

    grid = Grid(**GRIDS.get(preset, {}))
    grid = grid.scaled(0.3) if quick else grid
    out = []
    for threads in (1, 2):
        path = cache / f"{preset}-t{threads}.json"
        if path.is_file():
            out.append(Profile.load(path))
            continue
        log(f"{preset}: profile, {threads} thread(s) ...")
        profile = measure_profile(str(model), "float32", "cpu", threads, grid, name=preset)
        # What serving adds, measured on the deployment the rows of that mode run (pinned cores).
        mode = "disaggregated" if threads == 1 else "colocated"
        serving = measure_serving(profile, str(model), threads, roles=deployment_roles(mode), mode=mode)
        profile = with_serving(profile, serving)
        profile.save(path)
        out.append(profile)
    return out


def deployment_roles(mode: str) -> dict:
    """The role sections of each mode: 1P+1D on a core each, or one colocated worker on both."""
    usable = sorted(os.sched_getaffinity(0))
    pin = len(usable) >= 2
    if mode == "disaggregated":
        return {
            "prefill": {"threads": 1, **({"cpus": [usable[0]]} if pin else {})},
            "decode": {"threads": 1, **({"cpus": [usable[1]]} if pin else {})},
        }
    return {"colocated": {"threads": 2, **({"cpus": usable[:2]} if pin else {})}}


def deployment_for(model: Path, mode: str):
    from splitserve.deploy.config import DeploymentConfig

    raw = {"model": str(model), "dtype": "float32", "port": 0, "mode": mode, **deployment_roles(mode)}
    return DeploymentConfig.from_dict(raw)


def slos(profile, requests) -> dict[str, float]:
    """TTFT within 4x and TPOT within 3x what the profile predicts for one request alone, at the
    workload's 90th-percentile prompt (a median prompt's figure would have the longer prompts miss even
    alone, once a model's prefill outweighs the serving overhead)."""
    from splitserve.deploy.profile import StepShape

    def p90(values: list[int]) -> int:
        return sorted(values)[int(0.9 * (len(values) - 1))]

    prompt = p90([len(r.prompt) for r in requests])
    context = p90([len(r.prompt) + r.output_len // 2 for r in requests])
    ttft = profile.step_s(StepShape.of([(0, prompt)])) + profile.ttft_overhead_s
    tpot = profile.serving_step_s(StepShape.of([], [context]), 1)
    return {"ttft": round(4 * ttft * 1e3, 1), "tpot": round(3 * tpot * 1e3, 1)}


def requests_for(model_vocab: int, dataset: str, medians: tuple[int, int], n: int, seed: int, max_len: int):
    from splitserve.bench.datasets import DatasetOptions, TokenRange, make_requests

    options = DatasetOptions(
        name=dataset, num_prompts=n, input_len=medians[0], output_len=medians[1], max_model_len=max_len, seed=seed
    )
    return make_requests(options, TokenRange.for_vocab(model_vocab))


def sweep_requests(model_vocab: int, dataset: str, medians: tuple[int, int], n: int, max_len: int, i: int):
    """The i-th rate's requests of a sweep: fresh prompts per rate (seeds apart from the rows'), as bench
    sweep makes them, so that no rate is served from the prefix cache an earlier one filled."""
    return requests_for(model_vocab, dataset, medians, n, 100 + i, max_len)


def simulated(config, requests, offsets, goodput):
    from splitserve.planning.simulator import simulate

    work = [(r.prompt, r.output_len) for r in requests]
    result, _ = simulate(config, work, offsets, (50, 90), goodput, per_request=True)
    return result


def capacity(config, requests, goodput) -> float:
    """The highest rate at which the simulator has 90% of the requests meet the SLOs."""
    from splitserve.bench.arrivals import arrival_offsets
    from splitserve.planning.plan import max_rate

    def meets(rate: float) -> bool:
        result = simulated(config, requests, arrival_offsets(len(requests), rate, 1.0, 0), goodput)
        return (result["good_requests"] or 0) >= 0.9 * len(requests)

    return max_rate(meets, low=0.005, high=1.0, iterations=8)


def sweep_knees(deployment, config, make_requests, rates, slo_sets: dict, out_dir: Path, name: str) -> dict:
    """The same sweep through the simulator and on the real deployment (bench sweep's own ``run_sweep``:
    fresh prompts per rate, the same arrival seed), judged by each SLO set. The sweep's files (rate_<R>.json
    with the per-request lists, sweep.json, the plots) go to ``out_dir``/sim and ``out_dir``/real."""
    from splitserve.bench.config import BenchConfig
    from splitserve.bench.runner import benchmark
    from splitserve.bench.sweep import run_sweep
    from splitserve.planning.fidelity import compare_knees, simulator_bench

    # run_sweep judges its attainment and plots by the binding SLOs; both sets are judged below on the
    # per-request lists of the results kept here.
    bench = BenchConfig(addr=deployment.address, goodput=slo_sets["binding"], progress=False, seed=100)
    kept: dict[str, list[dict]] = {}
    seconds = {}
    for side, run in (("sim", simulator_bench(config)), ("real", benchmark)):
        log(f"{name}: {side} sweep at {', '.join(f'{r:g}' for r in rates)} req/s ...")
        kept[side] = []

        def keep(*args, run=run, into=kept[side]):
            result = run(*args)
            into.append(result)
            return result

        start = time.monotonic()
        run_sweep(make_requests, bench, rates, KNEE_TARGET, out_dir / side, name, run=keep)
        seconds[side] = time.monotonic() - start
    return {
        "rates": list(rates),
        "requests_per_rate": len(kept["real"][0]["errors"]),
        "real_seconds": seconds["real"],
        "failed": [r["failed"] for r in kept["real"]],
        "slo_sets": {
            label: compare_knees(rates, kept["real"], kept["sim"], slos, KNEE_TARGET)
            for label, slos in slo_sets.items()
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small,qwen2.5-0.5b")
    parser.add_argument("--modes", default="disaggregated,colocated")
    parser.add_argument("--quick", action="store_true", help="a coarse profile grid and half the requests")
    parser.add_argument("--workloads", default="chat,long", help="chat, long, or both")
    parser.add_argument("--requests", type=int, help="requests per run (default: the preset's; --quick halves it)")
    parser.add_argument("--json-out", default=str(ROOT / "models" / "sim_fidelity.json"))
    parser.add_argument("--profiles", default=str(ROOT / "models" / "profiles"), help="where profiles are kept")
    parser.add_argument(
        "--binding-percentile",
        type=float,
        default=90.0,
        help="the binding SLOs: this percentile of the real TTFT and TPOT at the 60%% row",
    )
    parser.add_argument("--sweep-points", type=int, default=5, help="rates per knee sweep (0: no sweeps)")
    parser.add_argument(
        "--sweep-requests", type=int, help="requests per sweep rate (default: half the rows' requests, at least 10)"
    )
    parser.add_argument(
        "--sweep-range",
        default="0.2,1.2",
        help="LOW,HIGH: the sweep's lowest and highest rates, as fractions of the simulated capacity",
    )
    parser.add_argument("--sweep-dir", default=str(ROOT / "models" / "sim_fidelity_sweeps"))
    args = parser.parse_args()
    try:
        low, high = (float(x) for x in args.sweep_range.split(","))
    except ValueError:
        parser.error(f"--sweep-range: expected LOW,HIGH such as 0.2,1.2, got {args.sweep_range!r}")
    if args.sweep_points not in (0, 1) and not 0 < low < high:
        parser.error(f"--sweep-range: expected 0 < LOW < HIGH, got {args.sweep_range!r}")
    if args.sweep_points == 1 or args.sweep_points < 0:
        parser.error(f"--sweep-points: 0 (no sweeps) or at least 2, got {args.sweep_points}")
    if not 0 < args.binding_percentile < 100:
        parser.error(f"--binding-percentile: must be in (0, 100), got {args.binding_percentile}")
    faulthandler.enable()  # a crash in a native library still says where

    from splitserve.bench.arrivals import arrival_offsets
    from splitserve.bench.config import BenchConfig
    from splitserve.bench.runner import benchmark
    from splitserve.deploy.deployment import Deployment
    from splitserve.engine.hardware import describe_machine
    from splitserve.planning.deployment import sim_config
    from splitserve.planning.fidelity import binding_slos, compare_under, relative_error, sweep_rates

    machine = describe_machine(probe_torch=True)
    log(f"cpu: {machine['cpu_model']}, {machine['usable_cores']} usable cores")
    cache = Path(args.profiles)
    cache.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    knees: list[dict] = []

    def save() -> None:
        Path(args.json_out).write_text(json.dumps({"machine": machine, "rows": rows, "knees": knees}, indent=1))

    for preset in args.presets.split(","):
        model = ensure_model(preset)
        one, two = profiles_for(model, preset, args.quick, cache)
        chat, long, n = WORKLOADS[preset]
        n = max(20, n // 2) if args.quick else n
        n = args.requests or n
        sweep_n = args.sweep_requests or max(10, n // 2)
        for mode in args.modes.split(","):
            deployment_config = deployment_for(model, mode)
            profiles = {"prefill": one, "decode": one, "colocated": two}
            config = sim_config(deployment_config, profiles)
            deployment = Deployment(deployment_config)
            deployment.start()
            try:
                chosen = args.workloads.split(",")
                for name, dataset, medians in (("chat", "chat", chat), ("long", "summarize", long)):
                    if name not in chosen:
                        continue
                    max_len = one.model.max_position_embeddings
                    probe = requests_for(one.model.vocab_size, dataset, medians, n, 1000, max_len)
                    goodput = slos(one if mode == "disaggregated" else two, probe)
                    top = capacity(config, probe, goodput)
                    runs = []  # (row, real, sim): judged by the binding SLOs once its row is measured
                    for i, fraction in enumerate(FRACTIONS):
                        rate = round(max(top * fraction, 0.01), 3)
                        requests = requests_for(one.model.vocab_size, dataset, medians, n, i, max_len)
                        offsets = arrival_offsets(len(requests), rate, 1.0, i)
                        sim = simulated(config, requests, offsets, goodput)
                        log(f"{preset} {mode} {name} {rate} req/s: real run ({len(requests)} requests) ...")
                        start = time.monotonic()
                        bench = BenchConfig(
                            addr=deployment.address,
                            request_rate=rate,
                            percentiles=(50, 90),
                            goodput=goodput,
                            progress=False,
                            seed=i,
                        )
                        real = benchmark(requests, offsets, bench)
                        row = {
                            "preset": preset,
                            "mode": mode,
                            "workload": name,
                            "rate": rate,
                            "fraction_of_capacity": fraction,
                            "slos_ms": goodput,
                            "requests": len(requests),
                            "real_seconds": time.monotonic() - start,
                            "failed": real["failed"],
                        }
                        for key, _ in METRICS:
                            r, s = real[key] or 0.0, sim[key] or 0.0
                            row[f"real_{key}"], row[f"sim_{key}"] = r, s
                            row[f"error_{key}"] = relative_error(r, s)
                        row["judged"] = {"4x/3x": compare_under(real, sim, goodput)}
                        rows.append(row)
                        runs.append((row, real, sim))
                        log("  " + format_row(row))
                        # Written after every row, so that a run cut short keeps the rows it measured.
                        save()
                    label = f"{preset} {mode} {name}"
                    try:
                        binding = binding_slos(runs[BINDING_ROW][1], args.binding_percentile)
                    except ValueError as e:  # e.g. every request of that row failed: no SLO to take
                        log(f"{label}: no binding SLOs: {e}")
                        continue
                    for row, real, sim in runs:
                        row["judged"]["binding"] = compare_under(real, sim, binding)
                    log(f"{label}: binding SLOs {binding} ms; " + format_judged(runs))
                    save()
                    if not args.sweep_points:
                        continue
                    rates = sweep_rates(top, args.sweep_points, low, high)

                    vocab = one.model.vocab_size
                    make_requests = partial(sweep_requests, vocab, dataset, medians, sweep_n, max_len)
                    out_dir = Path(args.sweep_dir) / f"{preset}-{mode}-{name}"
                    slo_sets = {"4x/3x": goodput, "binding": binding}
                    found = sweep_knees(deployment, config, make_requests, rates, slo_sets, out_dir, label)
                    knees.append({"preset": preset, "mode": mode, "workload": name, "capacity": top, **found})
                    log("  " + format_knees(knees[-1]))
                    save()
            finally:
                deployment.stop()
    print_table(rows)
    print_judged(rows)
    print_knees(knees)
    save()
    log(f"written to {args.json_out}")
    return 0


def format_row(row: dict) -> str:
    cells = []
    for key, label in METRICS:
        error = row[f"error_{key}"]
        cells.append(
            f"{label} {row[f'real_{key}']:.4g}/{row[f'sim_{key}']:.4g} ({'-' if error is None else f'{error:.0%}'})"
        )
    return ", ".join(cells)


def pp(value: float) -> str:
    return f"{value:+.1f} pp"


def format_judged(runs) -> str:
    return "; ".join(
        f"{row['rate']} req/s: attainment {j['real_attainment']:.0%}/{j['sim_attainment']:.0%} "
        f"({pp(j['attainment_error_pp'])})"
        for row, _, _ in runs
        for j in [row["judged"]["binding"]]
    )


def format_knees(entry: dict) -> str:
    return "; ".join(
        f"{label}: knee {k['real_knee']['text']} / {k['sim_knee']['text']} req/s "
        f"({'-' if k['knee_error'] is None else format(k['knee_error'], '.0%')})"
        for label, k in entry["slo_sets"].items()
    )


def print_judged(rows: list[dict]) -> None:
    """Per workload and SLO set, one cell per rate: attainment real / sim (sim - real in points) and the
    goodput's relative error."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["preset"], row["mode"], row["workload"]), []).append(row)
    print(
        "\n| preset | mode | workload | SLOs | TTFT / TPOT SLO ms | "
        + " | ".join(f"at {f:.0%}: attainment real / sim (pp); goodput err" for f in FRACTIONS)
        + " |"
    )
    print("|" + "---|" * (5 + len(FRACTIONS)))
    for (preset, mode, workload), group in groups.items():
        for label in ("4x/3x", "binding"):
            judged = [row["judged"].get(label) for row in group]
            if not all(judged):
                continue
            cells = []
            for j in judged:
                err = "-" if j["goodput_error"] is None else f"{j['goodput_error']:.0%}"
                cells.append(
                    f"{j['real_attainment']:.0%} / {j['sim_attainment']:.0%} ({pp(j['attainment_error_pp'])}); {err}"
                )
            slos_ms = judged[0]["slos_ms"]
            print(
                f"| {preset} | {mode} | {workload} | {label} | {slos_ms['ttft']:.4g} / {slos_ms['tpot']:.4g} | "
                + " | ".join(cells)
                + " |"
            )
    errors = [abs(j["attainment_error_pp"]) for row in rows for j in [row["judged"].get("binding")] if j]
    if errors:
        print(
            f"\nbinding SLOs: {sum(e <= 5 for e in errors)} of {len(errors)} attainments within 5 points; "
            f"largest error {max(errors):.1f} points"
        )


def print_knees(knees: list[dict]) -> None:
    """Per sweep and SLO set: the rate where attainment crosses 90%, real / sim, and the relative error."""
    if not knees:
        return
    print(
        f"\n| preset | mode | workload | swept rates (req/s) | SLOs | knee at {KNEE_TARGET:.0%} attainment, "
        "real (req/s) | simulated | error |"
    )
    print("|" + "---|" * 8)
    for entry in knees:
        rates = ", ".join(f"{r:g}" for r in entry["rates"])
        for label, k in entry["slo_sets"].items():
            err = "-" if k["knee_error"] is None else f"{k['knee_error']:.0%}"
            print(
                f"| {entry['preset']} | {entry['mode']} | {entry['workload']} | {rates} | {label} "
                f"| {k['real_knee']['text']} | {k['sim_knee']['text']} | {err} |"
            )


def print_table(rows: list[dict]) -> None:
    head = "| preset | mode | workload | rate (req/s) | " + " | ".join(
        f"{label} real / sim (err)" for _, label in METRICS
    )
    print(head + " |")
    print("|" + "---|" * (4 + len(METRICS)))
    for row in rows:
        cells = []
        for key, _ in METRICS:
            error = row[f"error_{key}"]
            err = "-" if error is None else f"{error:.0%}"
            cells.append(f"{row[f'real_{key}']:.4g} / {row[f'sim_{key}']:.4g} ({err})")
        print(f"| {row['preset']} | {row['mode']} | {row['workload']} | {row['rate']} | " + " | ".join(cells) + " |")
    errors = [row[f"error_{key}"] for row in rows for key, _ in METRICS if row[f"error_{key}"] is not None]
    if errors:
        within = sum(e <= 0.15 for e in errors)
        print(f"\n{within} of {len(errors)} figures within 15%; median error {sorted(errors)[len(errors) // 2]:.1%}")


if __name__ == "__main__":
    sys.exit(main())
