"""The command lines of ``splitserve profile`` and ``splitserve simulate`` (docs/planning.md).

``simulate`` takes ``splitserve bench``'s workload flags (the same datasets, seeds and arrivals, so the
same requests) and prints the same summary and JSON keys; the deployment comes from a deployment config
(``--config``, as ``splitserve serve`` takes it) with the role counts and TP sizes overridable, and its
timing from profiles.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from splitserve.bench.options import add_result_arguments, add_workload_arguments, dataset_options, request_offsets

ROLES = ("prefill", "decode", "colocated")


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a Hugging Face checkpoint folder (measured; required unless --roofline)")
    p.add_argument(
        "--roofline",
        metavar="DEVICE",
        help="no measurement: a profile from the published peaks of DEVICE (h200, h100) at assumed efficiencies, "
        "for --shape (splitserve.planning.roofline); labelled as such in the file",
    )
    p.add_argument("--shape", help="with --roofline: a published model shape (llama3.1-70b, llama3.1-8b, qwen2.5-72b)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU), as each worker rank runs")
    p.add_argument(
        "--backend",
        choices=["splitserve", "vllm"],
        default="splitserve",
        help="the engine whose steps are measured (vllm: vLLM's engine core as a vllm-backend worker runs it)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor_parallel_size: a worker of this many ranks (spawned here; one GPU each on CUDA)",
    )
    p.add_argument("--out", required=True, help="the profile to write (JSON)")
    p.add_argument("--quick", action="store_true", help="a smaller grid (a first look; the fit is coarser)")
    p.add_argument(
        "--no-transfer",
        action="store_true",
        help="skip the KV-transfer measurement: the profile has no transfer, and simulate and plan take it for "
        "colocated deployments only",
    )
    p.add_argument(
        "--serving",
        action="store_true",
        help="also start a 1P+1D deployment (embedded Ray) and measure what serving adds to a first token and a step",
    )


def run_roofline(args: argparse.Namespace) -> int:
    from splitserve.planning.roofline import DEVICES, SHAPES, roofline_profile

    if args.roofline not in DEVICES:
        raise ValueError(f"--roofline: expected one of {', '.join(DEVICES)}, got {args.roofline!r}")
    if args.shape not in SHAPES:
        raise ValueError(f"--shape: expected one of {', '.join(SHAPES)}, got {args.shape!r}")
    profile = roofline_profile(SHAPES[args.shape], DEVICES[args.roofline], args.tp)
    profile.save(args.out)
    c = profile.step_coefficients
    print(f"roofline profile of {profile.model.name} on TP {args.tp} x {profile.device_name}: NOT MEASURED")
    print(
        f"step = {c['const'] * 1e3:.3f} ms + {c['prefill_tokens'] * 1e6:.3f} us/prompt token + "
        f"{c['prefill_attention'] * 1e6:.4f} us/1k attention pairs + {c['decodes'] * 1e6:.3f} us/decode + "
        f"{c['decode_context'] * 1e6:.2f} us/1k context tokens; KV {profile.notes['kv_cache_bytes'] / 1e9:.1f} "
        f"GB per rank"
    )
    print(f"written to {args.out}")
    return 0


def run_profile(args: argparse.Namespace) -> int:
    from splitserve.deploy.profile import relative_errors
    from splitserve.planning.measure import Grid, measure_profile

    if args.roofline:
        return run_roofline(args)
    if not args.model:
        raise ValueError("--model: a checkpoint folder to measure (or --roofline DEVICE --shape NAME)")

    grid = Grid().scaled(0.3) if args.quick else Grid()
    profile = measure_profile(
        args.model,
        args.dtype,
        args.device,
        args.threads,
        grid,
        transfers=not args.no_transfer,
        tensor_parallel_size=args.tp,
        backend=args.backend,
    )
    if args.serving:
        from splitserve.planning.measure import measure_serving, with_serving

        profile = with_serving(profile, measure_serving(profile, args.model, args.threads))
    profile.save(args.out)
    errors = relative_errors(profile)
    c = profile.step_coefficients
    print(
        f"profile of {profile.model.name} ({profile.dtype}, {profile.device_name}, {profile.threads} threads, "
        f"TP {profile.tensor_parallel_size}, {args.backend} engine)"
    )
    print(
        f"step = {c['const'] * 1e3:.3f} ms + {c['prefill_tokens'] * 1e6:.2f} us/prompt token + "
        f"{c['prefill_attention'] * 1e6:.2f} us/1k attention pairs + {c['decodes'] * 1e6:.2f} us/decode + "
        f"{c['decode_context'] * 1e6:.2f} us/1k context tokens"
    )
    print(f"fit: {len(errors)} steps, median error {sorted(errors)[len(errors) // 2]:.1%}, worst {max(errors):.1%}")
    if profile.transfer is not None:
        print(
            f"KV transfer = {profile.transfer.latency_s * 1e3:.2f} ms + bytes / "
            f"{profile.transfer.bytes_per_s / 1e9:.2f} GB/s ({profile.notes['transfer_path']})"
        )
    else:  # simulate and plan refuse disaggregated deployments on this profile: say so now
        print(f"KV transfer: {profile.parts['transfer']}; the profile has none (colocated deployments only)")
    if args.serving:
        print(
            f"serving adds {profile.ttft_overhead_s * 1e3:.2f} ms to a first token, and to a step "
            f"{profile.step_overhead_s * 1e3:.2f} ms + {profile.token_overhead_s * 1e3:.3f} ms per streamed token"
        )
    print(f"written to {args.out}")
    return 0


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="the profile of every role (splitserve profile)")
    for role in ROLES:
        p.add_argument(f"--{role}-profile", help=f"the {role} workers' own profile (default: --profile)")
    p.add_argument("--config", help="a deployment config, as `splitserve serve --config` takes (default: the defaults)")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], help="override the config's mode")
    for role in ROLES:
        p.add_argument(f"--{role}", type=int, help=f"{role} workers (override the config's replicas)")
        p.add_argument(f"--{role}-tp", type=int, help=f"{role} workers' tensor_parallel_size")
    p.add_argument(
        "--ttft-overhead-ms",
        type=float,
        default=None,
        help="time outside the steps before a first token (router, gRPC); default: the profile's measured one",
    )
    p.add_argument(
        "--lose", action="append", default=[], metavar="WORKER@S", help="lose a worker at a time, e.g. decode-0@12.5"
    )
    p.add_argument(
        "--planner",
        action="store_true",
        help="run the config's planner: section (the live planner, enabled or not) on the simulated deployment: "
        "it scales prefill and decode as `splitserve scale` does; prints each decision (docs/planning.md)",
    )
    p.add_argument(
        "--startup-s",
        type=float,
        default=10.0,
        help="with --planner: seconds a new worker takes before it takes work (loading, registering)",
    )
    add_workload_arguments(p)
    r = p.add_argument_group("results")
    add_result_arguments(r)
    r.add_argument("--json", action="store_true", help="print the result as one JSON object instead of the summary")
    r.add_argument(
        "--rates",
        help="a sweep, as `splitserve bench sweep --rates`: simulate at each of these rates (req/s, comma-separated) "
        "and find the goodput rate; needs --goodput",
    )
    r.add_argument("--target", type=float, default=0.9, help="the sweep's SLO attainment target")
    r.add_argument("--plot-dir", help="with --rates: write ttft.png, tpot.png and attainment.png here (bench sweep's)")


def run_simulate(args: argparse.Namespace) -> int:
    from splitserve.bench.datasets import TokenRange, make_requests
    from splitserve.bench.metrics import format_summary, parse_goodput, parse_percentiles
    from splitserve.deploy.config import DeploymentConfig
    from splitserve.deploy.profile import Profile
    from splitserve.planning.deployment import sim_config
    from splitserve.planning.simulator import Simulation, simulate, utilization

    deployment = DeploymentConfig.from_file(args.config) if args.config else DeploymentConfig()
    roles = {}
    for role in ROLES:
        changes = {
            k: v
            for k, v in (("replicas", getattr(args, role)), ("tensor_parallel_size", getattr(args, f"{role}_tp")))
            if v is not None
        }
        if changes:
            roles[role] = replace(getattr(deployment, role), **changes)
    deployment = replace(deployment, **roles, **({"mode": args.mode} if args.mode else {}))
    base = Profile.load(args.profile)
    profiles = {
        role: Profile.load(getattr(args, f"{role}_profile")) if getattr(args, f"{role}_profile") else base
        for role in ROLES
    }
    overhead = None if args.ttft_overhead_ms is None else args.ttft_overhead_ms / 1e3
    config = sim_config(deployment, profiles, ttft_overhead_s=overhead, losses=_losses(args.lose))
    for line in unmeasured(config):  # what the run does without each part its profiles did not measure
        print(line, file=sys.stderr)
    options = dataset_options(args, base.model.max_position_embeddings)
    requests = make_requests(options, TokenRange.for_vocab(base.model.vocab_size))
    percentiles = parse_percentiles(args.percentiles)
    if args.rates:
        if args.planner:
            raise ValueError("--planner: one run at a time (the planner resizes it), not a sweep over --rates")
        return _sweep(args, config, requests, percentiles, base.model.name)
    offsets = request_offsets(args, requests)
    planned = _planned(args, deployment, base) if args.planner else Simulation
    result, sim = simulate(
        config, [(r.prompt, r.output_len) for r in requests], offsets, percentiles, parse_goodput(args.goodput), planned
    )
    result = {
        "backend": "simulate",
        "model_id": base.model.name,
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "request_rate": "trace" if args.dataset == "mooncake" else _rate(args.request_rate),
        "burstiness": args.burstiness,
        "deployment": describe(config),
        "utilization": utilization(sim),
        "profile_parts": profile_parts(config),
        **result,
    }
    if args.planner:
        result["planner"] = [_interval(i) for i in sim.intervals]
        result["final_counts"] = sim.counts()
    if args.json:
        print(json.dumps(result))
    else:
        print(format_summary(result, percentiles))
        if args.planner:
            print(_describe_planner(sim))
    if args.save_result:
        path = Path(args.save_result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"result written to {path}", file=sys.stderr)
    return 0 if result["completed"] else 1


def _planned(args: argparse.Namespace, deployment, profile):
    """``--planner``: the simulation the live planner resizes, with the config's ``planner:`` settings and
    the oracles the live one builds (``live.profile_oracles``) from ``planner.profile``, else ``--profile``."""
    from splitserve.deploy.live_planner import Planner, profile_oracles
    from splitserve.deploy.profile import Profile
    from splitserve.planning.sim_planner import PlannedSimulation

    if args.startup_s < 0:
        raise ValueError(f"--startup-s: expected 0 or more seconds, got {args.startup_s}")
    settings = deployment.planner
    oracle = Profile.load(settings.profile) if settings.profile else profile
    planner = Planner(settings, *profile_oracles(settings, deployment, oracle))
    return lambda config: PlannedSimulation(config, planner, startup_s=args.startup_s)


def _interval(interval) -> dict:
    """One planner interval for the JSON result (attainment None when no request finished in it)."""
    d = interval.decision
    return {
        "at_s": interval.at,
        "counts": interval.counts,
        "targets": d.targets,
        "applied": d.applied,
        "decision": d.describe(),
        "finished": interval.finished,
        "attainment": None if math.isnan(interval.attainment) else interval.attainment,
    }


def _describe_planner(sim) -> str:
    """The planner's intervals, one line each, and where the deployment ended."""
    s = sim.planner.settings
    applied = sum(i.decision.applied for i in sim.intervals)
    final = sim.counts()
    lines = [
        f"planner: {len(sim.intervals)} decisions every {s.interval_s:g} s, {applied} applied (workers start in "
        f"{sim.startup_s:g} s); at the end prefill {final['prefill']}, decode {final['decode']}"
    ]
    for i in sim.intervals:
        reached = "-" if math.isnan(i.attainment) else f"{i.attainment:.0%}"
        lines.append(
            f"  {i.at:8.1f} s  prefill {i.counts['prefill']} decode {i.counts['decode']}: {i.decision.describe()}; "
            f"{i.finished} finished, {reached} within the planner's SLOs"
        )
    return "\n".join(lines)


def _sweep(args: argparse.Namespace, config, requests, percentiles, model_name: str) -> int:
    """``--rates``: one simulation per rate, the goodput rate and the plots, by ``splitserve bench sweep``'s
    own code (``goodput_rate``, ``plot_sweep``), so a simulated sweep reads as a measured one."""
    from splitserve.bench.arrivals import arrival_offsets
    from splitserve.bench.metrics import parse_goodput
    from splitserve.bench.sweep import describe_goodput, goodput_rate, parse_rates, slo_attainment
    from splitserve.planning.simulator import simulate

    slos = parse_goodput(args.goodput)
    if not slos:
        raise ValueError("--goodput: a sweep needs the SLOs it is measured against, e.g. ttft:500 tpot:50")
    rates = parse_rates(args.rates)
    work = [(r.prompt, r.output_len) for r in requests]
    results = []
    for rate in rates:
        result, _ = simulate(
            config, work, arrival_offsets(len(work), rate, args.burstiness, args.seed), percentiles, slos
        )
        result = {
            "backend": "simulate",
            "model_id": model_name,
            "dataset": args.dataset,
            "num_prompts": len(work),
            "request_rate": rate,
            "burstiness": args.burstiness,
            "deployment": describe(config),
            **result,
        }
        result["slo_attainment"] = slo_attainment(result)
        results.append(result)
        print(
            f"rate {rate:g}: attainment {result['slo_attainment']:.1%}, p90 TTFT {result['p90_ttft_ms']:.0f} ms, "
            f"p90 TPOT {result['p90_tpot_ms']:.1f} ms, goodput {result['request_goodput'] or 0:.3g} req/s"
        )
    goodput = goodput_rate(rates, [r["slo_attainment"] for r in results], args.target)
    print(describe_goodput(goodput, args.target))
    if args.plot_dir:
        from splitserve.bench.plots import plot_sweep

        out = Path(args.plot_dir)
        out.mkdir(parents=True, exist_ok=True)
        for path in plot_sweep(results, args.target, goodput, out):
            print(f"plot written to {path}", file=sys.stderr)
    if args.save_result:
        path = Path(args.save_result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"results": results, "goodput": goodput, "target": args.target}, indent=2))
    return 0


def used_roles(config) -> list[str]:
    return ["colocated"] if config.mode == "colocated" else ["prefill", "decode"]


def profile_parts(config) -> dict[str, dict[str, str]]:
    """Each role's profile's parts: which were measured (``Profile.parts``)."""
    return {role: dict(getattr(config, role).profile.parts) for role in used_roles(config)}


def unmeasured(config) -> list[str]:
    """A line for each part of a role's profile that was not measured, and what the run did without it."""
    lines = []
    for role in used_roles(config):
        profile = getattr(config, role).profile
        for part, label in profile.parts.items():
            if profile.measured(part):
                continue
            if part == "transfer" and profile.transfer is None:
                use = "not needed: a colocated deployment hands no KV over"  # disaggregated was refused
            elif part == "serving":
                use = "the serving overheads it would hold were taken as 0"
            else:
                use = "its figures were used as they are"
            lines.append(f"{role} profile ({profile.model.name}): {part} {label}; {use}")
    return lines


def describe(config) -> dict:
    roles = {}
    for role in ROLES:
        spec = getattr(config, role)
        if spec is not None and (role == "colocated") == (config.mode == "colocated"):
            roles[role] = {
                "count": spec.count,
                "tensor_parallel_size": spec.tensor_parallel_size,
                "num_blocks": spec.num_blocks,
            }
    return {"mode": config.mode, **roles}


def _rate(rate: float):
    return "inf" if rate == float("inf") else rate


def _losses(items: list[str]) -> tuple[tuple[float, str], ...]:
    out = []
    for item in items:
        worker, sep, when = item.rpartition("@")
        try:
            out.append((float(when), worker))
        except ValueError:
            sep = ""
        if not sep or not worker:
            raise ValueError(f"--lose: expected WORKER@SECONDS such as decode-0@12.5, got {item!r}")
    return tuple(out)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile",
        action="append",
        required=True,
        help="a profile of the device (splitserve profile); give one per tensor-parallel size to search TP",
    )
    p.add_argument("--config", help="the base deployment config whose engine and router settings the plan keeps")
    p.add_argument(
        "--slo", nargs="+", required=True, metavar="KEY:MS", help="ttft:MS and tpot:MS, e.g. ttft:500 tpot:50"
    )
    p.add_argument("--attainment", type=float, default=0.9, help="the fraction of requests that must meet the SLOs")
    p.add_argument("--devices", type=int, default=None, help="the budget: devices (GPUs, or CPU sockets) in all")
    p.add_argument("--devices-per-node", type=int, default=8, help="a worker's ranks stay on one node")
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="the inverse question: the fewest devices that serve this rate (req/s) within the SLOs",
    )
    p.add_argument(
        "--local-prefill",
        default="",
        help="conditional disaggregation thresholds to consider (router.local_prefill_max_tokens), e.g. 256,1024; "
        "auto: the one the profile gives for the TPOT SLO (plan.local_prefill_threshold)",
    )
    p.add_argument(
        "--min-duration",
        type=float,
        default=30.0,
        help="seconds of arrivals each simulation spans at least (the workload is repeated, its copies made "
        "distinct): what a deployment sustains, not what a burst fits in",
    )
    p.add_argument(
        "--mode",
        choices=["disaggregated", "colocated"],
        help="search only this mode (default: both); colocated needs no KV transfer in the profiles",
    )
    p.add_argument("--out", help="write the winner as a deployment config (splitserve serve --config)")
    p.add_argument("--top", type=int, default=8, help="candidates to print")
    p.add_argument("--json", action="store_true", help="print the ranked candidates as JSON")
    add_workload_arguments(p)


def run_plan(args: argparse.Namespace) -> int:
    import yaml

    from splitserve.bench.datasets import TokenRange, make_requests
    from splitserve.bench.metrics import parse_goodput
    from splitserve.deploy.config import DeploymentConfig
    from splitserve.deploy.profile import Profile
    from splitserve.planning import plan

    profiles = {}
    for path in args.profile:
        profile = Profile.load(path)
        profiles[profile.tensor_parallel_size] = profile
    slos = parse_goodput(args.slo)
    if set(slos) != {"ttft", "tpot"}:
        raise ValueError(f"--slo: give ttft:MS and tpot:MS, got {' '.join(args.slo)}")
    slo = plan.Slo(slos["ttft"], slos["tpot"], args.attainment)
    if (args.devices is None) == (args.rate is None):
        raise ValueError("--devices, --rate: give one (the best use of a budget, or the fewest devices for a rate)")
    base_raw = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    base = DeploymentConfig.from_dict(base_raw or {})
    modes = (args.mode,) if args.mode else plan.MODES
    first = next(iter(profiles.values()))
    options = dataset_options(args, first.model.max_position_embeddings)
    workload = [(r.prompt, r.output_len) for r in make_requests(options, TokenRange.for_vocab(first.model.vocab_size))]
    if args.rate is not None:
        best = plan.fewest_devices(
            base,
            profiles,
            workload,
            slo,
            args.rate,
            args.devices_per_node,
            seed=args.seed,
            min_duration_s=args.min_duration,
            modes=modes,
        )
        if best is None:
            print(f"no deployment of up to 4096 devices serves {args.rate} req/s within the SLOs", file=sys.stderr)
            return 1
        ranked = [best]
        print(f"fewest devices for {args.rate} req/s: {best.devices} ({best.describe()})")
    else:
        thresholds = []
        for x in (x.strip() for x in args.local_prefill.split(",") if x.strip()):
            if x == "auto":
                threshold = plan.local_prefill_threshold(profiles[min(profiles)], slo.tpot_ms)
                print(f"local prefill threshold from the profile at TPOT {slo.tpot_ms:g} ms: {threshold} tokens")
                thresholds.append(threshold)
            else:
                thresholds.append(int(x))
        budget = plan.Budget(args.devices, args.devices_per_node)
        ranked = plan.search(
            base,
            profiles,
            workload,
            slo,
            budget,
            args.seed,
            local_prefill=thresholds,
            min_duration_s=args.min_duration,
            modes=modes,
        )
    rows = [
        {
            "deployment": c.describe(),
            "mode": c.mode,
            "counts": c.counts,
            "tp": c.tp,
            "local_prefill_max_tokens": c.local_prefill_max_tokens,
            "devices": c.devices,
            "predicted_rate": c.rate,
            "checked_rate": c.checked_rate,
            "checked_attainment": c.checked_attainment,
            "goodput_per_device": c.goodput_per_device,
        }
        for c in ranked
    ]
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"{'rank':>4}  {'deployment':<40} {'devices':>7} {'rate':>9} {'checked':>9} {'per device':>10}")
        for i, row in enumerate(rows[: args.top], 1):
            checked = "-" if row["checked_rate"] is None else f"{row['checked_rate']:.3g}"
            print(
                f"{i:>4}  {row['deployment']:<40} {row['devices']:>7} {row['predicted_rate']:>9.3g} "
                f"{checked:>9} {row['goodput_per_device']:>10.3g}"
            )
    if args.out and ranked:
        Path(args.out).write_text(plan.to_yaml(plan.deployment_config(base, ranked[0]), base_raw))
        print(f"the winner written to {args.out}", file=sys.stderr)
    return 0
