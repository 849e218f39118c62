"""The options of ``splitserve bench [sweep]`` and the two commands behind them (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from splitserve.bench import DATASETS
from splitserve.client.flags import add_client_security_arguments, client_security

if TYPE_CHECKING:
    from splitserve.bench.config import BenchConfig
    from splitserve.bench.request import BenchRequest

SWEEP_ONLY = ("rates", "out_dir", "attainment")
RAY_ONLY = ("clients", "client_cpus", "run_timeout")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=["sweep"], help="sweep: one run per --rates, goodput and plots")
    p.add_argument(
        "--backend",
        default="splitserve",
        choices=["splitserve", "openai"],
        help="splitserve: the router's gRPC API at --addr; openai: any OpenAI-compatible server at "
        "--base-url (vLLM, splitserve's --openai-port), streamed /v1/completions",
    )
    p.add_argument("--addr", default="127.0.0.1:50051", help="the router's host:port")
    p.add_argument("--base-url", default=None, help="with --backend openai: http://host:port of the server")
    p.add_argument(
        "--model",
        default=None,
        help="with --backend openai: the served model name (default: the first id of GET /v1/models)",
    )
    p.add_argument(
        "--timeline-addr",
        default=None,
        help="with --backend openai against a splitserve router's OpenAI port: the router's gRPC host:port, to "
        "print where the served time went (--backend splitserve reads it from --addr)",
    )
    add_workload_arguments(p)
    a = p.add_argument_group("load")
    a.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (closed loop)")
    a.add_argument("--temperature", type=float, default=0.0)
    a.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ignore EOS so that every output is exactly as long as asked (default: on)",
    )
    a.add_argument("--request-timeout", type=float, default=600.0, help="deadline of each call, seconds")
    r = p.add_argument_group("results")
    add_result_arguments(r)
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    c = p.add_argument_group("load clients on Ray (docs/benchmarks.md#load-clients-on-ray)")
    c.add_argument(
        "--ray-address",
        default=None,
        help="send the load from client actors on this Ray cluster (host:port), spread over its nodes",
    )
    c.add_argument("--clients", type=int, default=None, help="with --ray-address: client actors (default 1)")
    c.add_argument(
        "--client-cpus", type=float, default=None, help="with --ray-address: Ray CPUs each client reserves (default 1)"
    )
    c.add_argument(
        "--run-timeout",
        type=float,
        default=None,
        help="with --ray-address: deadline of a whole run, seconds (default: last due time + request deadlines + 30)",
    )
    s = p.add_argument_group("sweep (with the action sweep)")
    s.add_argument("--rates", help="comma-separated request rates, e.g. 1,2,4,8")
    s.add_argument("--attainment", type=float, default=None, help="SLO attainment target for goodput (default 0.9)")
    s.add_argument("--out-dir", help="folder for sweep.json, rate_<R>.json and the plots")
    add_client_security_arguments(p)


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The requests and their arrivals: what ``splitserve bench`` sends and ``splitserve simulate`` replays."""
    p.add_argument("--num-prompts", type=int, default=1000, help="requests to send (mooncake: the trace's first N)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", default="random", choices=DATASETS)
    d.add_argument("--dataset-path", help="the trace (JSON lines) for --dataset mooncake")
    d.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="random: mean prompt length (1024); presets: median; shared-prefix: unique suffix (128)",
    )
    d.add_argument("--output-len", type=int, default=None, help="random: mean output length (128); presets: median")
    d.add_argument("--range-ratio", type=float, default=0.0, help="random, shared-prefix: lengths in len*[1-r, 1+r]")
    d.add_argument("--random-prefix-len", type=int, default=0, help="random: a prefix shared by every prompt")
    d.add_argument("--shared-prefix-groups", type=int, default=8, help="shared-prefix: number of system prompts")
    d.add_argument("--shared-prefix-len", type=int, default=1024, help="shared-prefix: system prompt length")
    d.add_argument("--time-scale", type=float, default=1.0, help="mooncake: multiply the trace's gaps (2 = half speed)")
    d.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="cap prompt + output (default: the server's context length, else 2048)",
    )
    d.add_argument(
        "--vocab-size", type=int, default=None, help="draw token ids for this vocabulary (default: the server's)"
    )
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second; inf: all at once")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 Poisson, <1 burstier")
    a.add_argument("--seed", type=int, default=0, help="seeds the dataset, the arrivals and the sampling")


def add_result_arguments(r) -> None:
    r.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:5000")
    r.add_argument("--percentiles", default="90,95,99", help="comma-separated percentiles to report")
    r.add_argument("--save-result", metavar="FILE", help="write the result as JSON (vLLM's keys)")


def dataset_options(args: argparse.Namespace, max_model_len: int | None):
    """The ``DatasetOptions`` of the workload flags; the context is the smaller of --max-model-len and the
    server's (or the model's) ``max_model_len``, else 2048."""
    from splitserve.bench.datasets import DatasetOptions

    limits = [n for n in (args.max_model_len, max_model_len) if n]
    return DatasetOptions(
        name=args.dataset,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        random_prefix_len=args.random_prefix_len,
        shared_prefix_groups=args.shared_prefix_groups,
        shared_prefix_len=args.shared_prefix_len,
        dataset_path=args.dataset_path,
        time_scale=args.time_scale,
        max_model_len=min(limits, default=2048),
        seed=args.seed,
    )


def request_offsets(args: argparse.Namespace, requests: list[BenchRequest]) -> list[float]:
    """When each request is due: a trace's own times, else the arrival process of --request-rate."""
    from splitserve.bench.arrivals import arrival_offsets

    if args.dataset == "mooncake":
        return [r.arrival_s for r in requests]
    return arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)


def run_bench(args: argparse.Namespace) -> int:
    """``splitserve bench`` and ``splitserve bench sweep``."""
    from splitserve.bench.datasets import TokenRange, make_requests
    from splitserve.bench.metrics import parse_goodput, parse_percentiles
    from splitserve.bench.runner import BenchConfig
    from splitserve.rpc.security import ClientSecurity

    sweep = args.action == "sweep"
    if not sweep and (given := [f"--{k.replace('_', '-')}" for k in SWEEP_ONLY if getattr(args, k) is not None]):
        raise ValueError(f"{', '.join(given)}: only with `splitserve bench sweep`")
    if sweep and not (args.rates and args.out_dir):
        raise ValueError("--rates, --out-dir: both required with `splitserve bench sweep`")
    if sweep and args.save_result:
        raise ValueError("--save-result: a sweep writes its results into --out-dir")
    if sweep and args.dataset == "mooncake":
        raise ValueError("--dataset mooncake: a trace keeps its own arrival times; run it at several --time-scale")
    security = ClientSecurity(**client_security(args))
    openai = args.backend == "openai"
    if openai != (args.base_url is not None) or ((args.model or args.timeline_addr) is not None and not openai):
        raise ValueError("--base-url, --model, --timeline-addr: only with --backend openai, which needs --base-url")
    config = BenchConfig(
        addr=args.addr,
        backend=args.backend,
        base_url=args.base_url or "",
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        request_timeout_s=args.request_timeout,
        percentiles=parse_percentiles(args.percentiles),
        goodput=parse_goodput(args.goodput),
        progress=not args.no_progress,
        security=security,
        timeline_addr=args.timeline_addr,
    )
    load = _ray_load(args)
    server = _openai_server(args, security.api_key) if openai else _grpc_server(args, security)
    if server is None:
        return 1
    model_id, max_model_len, vocab_size = server
    if openai:
        config = replace(config, model=model_id)
    vocab_size = args.vocab_size or vocab_size
    if not vocab_size:
        raise ValueError("--vocab-size: the server does not report its vocabulary size; give it")
    options = dataset_options(args, max_model_len)
    tokens = TokenRange.for_vocab(vocab_size)
    run = _run_of(load)
    try:
        if sweep:  # fresh prompts per rate: the prefix cache must not carry over from one rate to the next
            requests = lambda i: make_requests(replace(options, seed=options.seed + i), tokens)  # noqa: E731
            return _sweep(args, requests, config, model_id, run)
        return _single(args, make_requests(options, tokens), config, model_id, run)
    except RuntimeError as e:  # load clients that could not start
        print(f"splitserve bench: {e}", file=sys.stderr)
        return 1
    finally:
        if load is not None:
            from splitserve.bench.ray_clients import disconnect

            disconnect()


def _ray_load(args: argparse.Namespace):
    """The ``RayLoad`` of --ray-address, --clients, --client-cpus, --run-timeout (None without an address)."""
    if not args.ray_address:
        if given := [f"--{k.replace('_', '-')}" for k in RAY_ONLY if getattr(args, k) is not None]:
            raise ValueError(f"{', '.join(given)}: only with --ray-address")
        return None
    from splitserve.bench.ray_clients import RayLoad

    return RayLoad(
        address=args.ray_address,
        clients=1 if args.clients is None else args.clients,
        client_cpus=1.0 if args.client_cpus is None else args.client_cpus,
        run_timeout_s=args.run_timeout,
    )


def _run_of(load) -> Callable[..., dict]:
    """``benchmark(requests, offsets, config, model_id, dataset)``: one process's, or the Ray clients'."""
    if load is None:
        from splitserve.bench.runner import benchmark

        return benchmark
    from functools import partial

    from splitserve.bench.ray_clients import benchmark

    return partial(benchmark, load=load)


def _grpc_server(args: argparse.Namespace, security) -> tuple[str, int, int] | None:
    """(model, max_model_len, vocab_size) from the router's status; None (reported) when unreachable."""
    import grpc

    from splitserve.bench.runner import get_status

    try:
        status = asyncio.run(get_status(args.addr, security=security))
    except grpc.RpcError as e:
        print(
            f"splitserve bench: cannot read the server's status at {args.addr}: {e.code().name}: {e.details()}",
            file=sys.stderr,
        )
        return None
    return status.model, status.max_model_len, status.vocab_size


def _openai_server(args: argparse.Namespace, api_key: str | None) -> tuple[str, int, int] | None:
    """(model, max_model_len, 0) from GET /v1/models: --model (or the first id) and its max_model_len.
    An OpenAI server does not say its vocabulary size: --vocab-size gives it."""
    import aiohttp

    from splitserve.bench.openai_backend import list_models

    try:
        models = asyncio.run(list_models(args.base_url, api_key=api_key))
    except (aiohttp.ClientError, TimeoutError, RuntimeError, KeyError, ValueError) as e:
        print(f"splitserve bench: cannot list the models at {args.base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    ids = [m.get("id") for m in models]
    name = args.model or (ids[0] if ids else None)
    if name not in ids:
        print(f"splitserve bench: {args.base_url} serves {ids}, not {name!r} (--model)", file=sys.stderr)
        return None
    entry = models[ids.index(name)]
    if not args.vocab_size:
        raise ValueError("--vocab-size: needed with --backend openai (an OpenAI server does not report it)")
    return name, int(entry.get("max_model_len") or 0), 0


def _single(
    args: argparse.Namespace,
    requests: list[BenchRequest],
    config: BenchConfig,
    model_id: str,
    run: Callable[..., dict],
) -> int:
    from splitserve.bench.metrics import format_summary
    from splitserve.bench.timeline import format_timeline, timed

    trace = args.dataset == "mooncake"
    offsets = request_offsets(args, requests)
    result = timed(run)(requests, offsets, config, model_id, args.dataset)
    if trace:
        result |= {"request_rate": "trace", "time_scale": args.time_scale}
    print(format_summary(result, config.percentiles))
    if "timeline" in result:
        print(format_timeline(result["timeline"]))
    if args.save_result:
        path = Path(args.save_result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"result written to {path}", file=sys.stderr)
    return 0 if result["completed"] else 1


def _sweep(
    args: argparse.Namespace,
    requests: Callable[[int], list[BenchRequest]],
    config: BenchConfig,
    model_id: str,
    run: Callable[..., dict],
) -> int:
    from splitserve.bench.sweep import parse_rates, run_sweep
    from splitserve.bench.timeline import timed

    target = 0.9 if args.attainment is None else args.attainment
    rates = parse_rates(args.rates)
    sweep = run_sweep(requests, config, rates, target, args.out_dir, model_id, args.dataset, timed(run))
    for row in sweep["results"]:
        print(
            f"rate {row['request_rate']:>8g} req/s  attainment {row['slo_attainment']:6.1%}  "
            f"p99 TTFT {row['p99_ttft_ms']:9.1f} ms  p99 TPOT {row['p99_tpot_ms']:8.1f} ms  failed {row['failed']}"
        )
    print(sweep["goodput"]["text"])
    print(f"sweep written to {Path(args.out_dir) / 'sweep.json'}", file=sys.stderr)
    return 0
