"""The ``splitserve`` command line: a thin shell over the packages, no serving logic here."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from splitserve.client.flags import add_client_security_arguments, client_security

log = logging.getLogger("splitserve.cli")

DEFAULT_PROMPTS = (
    "The quick brown fox",
    "Disaggregated serving splits prefill and decode because",
    "def fibonacci(n):",
)


DTYPE_HELP = "auto (the checkpoint's), bfloat16/bf16, float16/half/fp16, float32/float/fp32 (vLLM's names)"


def dtype_arg(text: str) -> str:
    """The argparse type of every --dtype: any of vLLM's names -> the canonical one ("bf16" -> "bfloat16")."""
    from splitserve.engine.model.loader import canonical_dtype

    try:
        return canonical_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def checkpoint_dtype_arg(text: str) -> str:
    """As dtype_arg, without "auto": a dtype to write weights in."""
    name = dtype_arg(text)
    if name == "auto":
        raise argparse.ArgumentTypeError("dtype: 'auto' names no dtype to write; use bfloat16, float16 or float32")
    return name


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a random-weight Hugging Face checkpoint of a preset")
    p.add_argument("--preset", required=True, choices=["tiny", "small", "qwen2.5-0.5b", "llama3.1-8b"])
    p.add_argument("--out", required=True, help="output folder (must be empty or absent)")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        type=checkpoint_dtype_arg,
        help="bfloat16/bf16, float16/half/fp16 or float32/float/fp32",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", type=int, default=None, metavar="BYTES", help="shard the safetensors")
    p.add_argument(
        "--config-format",
        default="legacy",
        choices=["legacy", "current"],
        help="legacy: rope_theta/rope_scaling; current: rope_parameters",
    )
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--config-only", action="store_true", help="write config and tokenizer, no weights")
    p.set_defaults(func=_make_model)


def _make_model(args: argparse.Namespace) -> int:
    from splitserve.tools.make_model import make_model

    start = time.perf_counter()
    out = make_model(
        args.preset,
        args.out,
        dtype=args.dtype,
        seed=args.seed,
        max_shard_bytes=args.max_shard_size,
        config_format=args.config_format,
        overwrite=args.overwrite,
        config_only=args.config_only,
    )
    print(f"wrote {args.preset} ({args.dtype}) to {out} in {time.perf_counter() - start:.1f}s")
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="stream a completion from a running server (or, with --model, the offline engine)"
    )
    p.add_argument("--addr", default="127.0.0.1:50051", help="the router's host:port")
    p.add_argument("--model", help="run the offline engine on this local model folder instead of a server")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable with --model)")
    p.add_argument("--token-ids", help="prompt as comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole call")
    p.add_argument("--json", action="store_true", help="print one JSON object (last line of stdout)")
    p.add_argument("--dtype", default="auto", type=dtype_arg, help=f"with --model: {DTYPE_HELP}")
    p.add_argument("--device", default="cpu", help="with --model")
    p.add_argument("--threads", type=int, default=None, help="with --model")
    add_client_security_arguments(p)
    p.set_defaults(func=_generate)


def _sampling_args(args: argparse.Namespace) -> dict:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "stop": args.stop,
    }


def _generate(args: argparse.Namespace) -> int:
    token_ids = [int(t) for t in args.token_ids.split(",")] if args.token_ids else None
    if args.model:
        return _generate_offline(args, token_ids)
    import grpc

    from splitserve.client.grpc_client import Client
    from splitserve.engine.wire import finish_label

    if bool(args.prompt) == bool(token_ids) or (args.prompt and len(args.prompt) > 1):
        raise ValueError("give exactly one --prompt or --token-ids")
    with Client(args.addr, timeout_s=args.timeout, **client_security(args)) as client:
        try:
            if args.json:
                result = client.generate(
                    args.prompt[0] if args.prompt else None, token_ids=token_ids, **_sampling_args(args)
                )
                print(json.dumps(result.to_json()))
                return 0
            start = time.monotonic()
            for message in client.stream(
                args.prompt[0] if args.prompt else None, token_ids=token_ids, **_sampling_args(args)
            ):
                sys.stdout.write(message.text)
                sys.stdout.flush()
                if message.finish_reason:
                    u = message.usage
                    print(
                        f"\n[{finish_label(message.finish_reason)}; {u.prompt_tokens} prompt, {u.completion_tokens} "
                        f"completion, {u.cached_tokens} cached tokens; {time.monotonic() - start:.2f}s]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as e:
            print(f"splitserve generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def _generate_offline(args: argparse.Namespace, token_ids: list[int] | None) -> int:
    from splitserve.engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, num_threads=args.threads)
    defaults = {"max_tokens": 32, "temperature": 0.0}
    values = {k: v for k, v in _sampling_args(args).items() if v is not None}
    sampling = SamplingParams(**{**defaults, **values, "stop": tuple(values.get("stop") or ())})
    prompts = [token_ids] if token_ids else (args.prompt or list(DEFAULT_PROMPTS))
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        if args.json:
            print(
                json.dumps(
                    {"prompt": prompt, "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}
                )
            )
        else:
            print(f"--- {prompt!r}\n{out.text!r}  [{len(out.token_ids)} tokens, {out.finish_reason}]")
    total = sum(len(o.token_ids) for o in outputs)
    print(
        f"{len(outputs)} prompts, {total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s); "
        f"kv blocks {llm.kv_status()}",
        file=sys.stderr,
    )
    llm.check_integrity()
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the router and its workers (on an embedded Ray unless --ray-address)")
    p.add_argument("--config", help="deployment config (YAML); flags override it")
    p.add_argument("--model", help="local model folder; default: the tiny demo checkpoint")
    p.add_argument("--num-prefill", type=int, default=None)
    p.add_argument("--num-decode", type=int, default=None)
    p.add_argument(
        "--mode",
        choices=["disaggregated", "colocated"],
        default=None,
        help="colocated: workers that run both phases in one batch (the baseline)",
    )
    p.add_argument("--num-colocated", type=int, default=None)
    for role in ("prefill", "decode", "colocated"):
        p.add_argument(
            f"--{role}-cpus",
            default=None,
            metavar="CPUS",
            help=f"pin each {role} worker to these cpus: '0-1' (all share it) or '0-1|2-3' (one set per "
            f"replica); the config's {role}.cpus",
        )
    p.add_argument("--host", default=None, help="address to bind and advertise (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="router port (default 50051)")
    p.add_argument(
        "--openai-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API on this port (0: any free port; default: off)",
    )
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (e.g. auto) instead of starting one")
    p.add_argument("--dtype", default=None, type=dtype_arg, help=f"{DTYPE_HELP}; default: the config's (auto)")
    p.add_argument("--device", default=None)
    p.add_argument(
        "--backend",
        choices=["splitserve", "vllm"],
        default=None,
        help="the engine every role runs (the config's engine.backend; vllm: `make setup-vllm`, docs/engine.md)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics on this port (0: any free port), and on every worker (docs/metrics.md)",
    )
    p.add_argument("--metrics-host", default=None, help="address the router's /metrics binds (default: --host)")
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=None,
        help="json: one JSON object a line, with request_id (router and workers)",
    )
    g = p.add_argument_group("security (the config's security section; docs/security.md)")
    g.add_argument("--tls-cert", metavar="PEM", help="TLS on the public port: its certificate chain")
    g.add_argument("--tls-key", metavar="PEM", help="TLS on the public port: its key")
    g.add_argument("--tls-client-ca", metavar="PEM", help="require client certificates signed by this CA")
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="accept this bearer token on the API (repeatable; $SPLITSERVE_API_KEY adds one; "
        "other local users can read command lines: prefer --api-key-file)",
    )
    g.add_argument("--api-key-file", metavar="FILE", help="accept the tokens in this file, one a line")
    g.add_argument("--internal-tls-cert", metavar="PEM", help="mTLS on internal links: this process's certificate")
    g.add_argument("--internal-tls-key", metavar="PEM", help="mTLS on internal links: its key")
    g.add_argument("--internal-tls-ca", metavar="PEM", help="mTLS on internal links: the CA that signs them all")
    g.add_argument(
        "--cluster-token-file",
        metavar="FILE",
        help="require this shared secret on internal calls ($SPLITSERVE_CLUSTER_TOKEN: the value)",
    )
    p.set_defaults(func=_serve)


def _security_overrides(args: argparse.Namespace, config):
    """The security flags and variables of ``serve`` on top of the config file's section."""
    from dataclasses import replace

    from splitserve.rpc.security import API_KEY_ENV, CLUSTER_TOKEN_ENV

    s = config.security
    flags = {
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "tls_client_ca": args.tls_client_ca,
        "api_key_file": args.api_key_file,
        "internal_tls_cert": args.internal_tls_cert,
        "internal_tls_key": args.internal_tls_key,
        "internal_tls_ca": args.internal_tls_ca,
    }
    values = {k: v for k, v in flags.items() if v is not None}
    keys = (*s.api_keys, *(args.api_key or ()), *([os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV) else []))
    values["api_keys"] = tuple(dict.fromkeys(keys))
    if args.cluster_token_file:
        values |= {"cluster_token_file": args.cluster_token_file, "cluster_token": None}
    elif os.environ.get(CLUSTER_TOKEN_ENV) and not (s.cluster_token or s.cluster_token_file):
        values["cluster_token"] = os.environ[CLUSTER_TOKEN_ENV]
    return replace(config, security=replace(s, **values))


def _serve(args: argparse.Namespace) -> int:
    from splitserve.deploy.config import DeploymentConfig
    from splitserve.deploy.deployment import Deployment
    from splitserve.deploy.embedded_ray import use_loopback_ray
    from splitserve.observability.logs import configure_logging

    config = DeploymentConfig.from_file(args.config) if args.config else DeploymentConfig()
    config = config.with_overrides(
        model=args.model,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        mode=args.mode,
        num_colocated=args.num_colocated,
        prefill_cpus=args.prefill_cpus,
        decode_cpus=args.decode_cpus,
        colocated_cpus=args.colocated_cpus,
        host=args.host,
        port=args.port,
        openai_port=args.openai_port,
        ray_address=args.ray_address,
        dtype=args.dtype,
        device=args.device,
        backend=args.backend,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        log_format=args.log_format,
    )
    config = _security_overrides(args, config)
    configure_logging(config.log_format)
    if not config.ray_address:
        use_loopback_ray()  # before Ray is imported
    deployment = Deployment(config)
    stopping = _Stopping(deployment)
    stopping.catch_signals()
    failure: Exception | None = None
    try:
        address = deployment.start()
        # Ray installs its own SIGTERM handler when it starts: take the signals back.
        stopping.catch_signals()
        stopping.starting = False
        if deployment.openai_address:
            scheme = "https" if config.security.tls_cert else "http"
            print(f"splitserve OpenAI API on {scheme}://{deployment.openai_address}/v1", flush=True)
        print(f"splitserve ready on {address}", flush=True)
        if deployment.router.metrics_address:
            print(f"metrics on http://{deployment.router.metrics_address}/metrics", flush=True)
        while not stopping.requested.wait(0.5):
            pass
    except (_StopRequested, SystemExit):  # a signal while starting (Ray's SIGTERM handler raises SystemExit)
        pass
    except Exception as e:  # the start failed (a worker did not start, or did not register in time)
        failure = e
    finally:
        code = stopping.stop()
        if failure is not None:
            print(f"splitserve serve: error: {failure}", file=sys.stderr, flush=True)
            code = code or 2
        print("splitserve stopped", flush=True)
    _exit_now(code)


# Deployment.stop's steps have deadlines that add up to a few seconds; this one catches the unforeseen.
STOP_DEADLINE_S = 6.0


class _StopRequested(Exception):
    pass


class _Stopping:
    """How ``serve`` stops. The first SIGINT or SIGTERM (to the pid or to the whole process group)
    stops the deployment, each step with a deadline (``Deployment.stop``); a stop that takes over
    ``STOP_DEADLINE_S`` is cut short (``Deployment.abort``) and exits 1. A second signal while
    stopping exits at once with 128 + its number, after ``Deployment.abort`` (SIGKILL the recorded
    Ray processes, remove the temp folder). Either way the last line is "splitserve stopped"."""

    def __init__(self, deployment) -> None:
        self.deployment = deployment
        self.requested = threading.Event()
        self.starting = True  # a signal now interrupts the start
        self.signal_name = ""  # of the first signal

    def catch_signals(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        if self.requested.is_set():
            log.warning("second %s while stopping: exiting at once", signal.Signals(signum).name)
            self.deployment.abort()
            print("splitserve stopped", flush=True)
            _exit_now(128 + signum)
        self.signal_name = signal.Signals(signum).name
        self.requested.set()
        if self.starting:
            raise _StopRequested(signum)

    def stop(self) -> int:
        """Run ``Deployment.stop`` on a thread, so that the main thread stays free to take a second
        signal; returns the exit code."""
        self.requested.set()  # from here on, any signal is a second one
        self.starting = False
        log.info("stopping%s", f" on {self.signal_name}" if self.signal_name else "")
        done = threading.Event()

        def run() -> None:
            try:
                self.deployment.stop()
                done.set()
            except Exception:
                log.exception("stop failed")

        stopper = threading.Thread(target=run, name="splitserve-stop", daemon=True)
        stopper.start()
        stopper.join(STOP_DEADLINE_S)
        if done.is_set():
            return 0
        if stopper.is_alive():
            log.warning("stop took over %.0fs: killing what is left", STOP_DEADLINE_S)
        self.deployment.abort()
        return 1


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: with torch, Ray and gRPC loaded, collecting every
    module takes seconds on a busy machine, and nothing is left for it to clean."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="workers, nodes, health, load and KV usage of a running server")
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--json", action="store_true", help="the whole GetStatus reply as one JSON object")
    add_client_security_arguments(p)
    p.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    import grpc

    from splitserve.client.grpc_client import Client
    from splitserve.client.status_view import format_status, status_json

    with Client(args.addr, **client_security(args)) as client:
        try:
            status = client.status()
        except grpc.RpcError as e:
            print(f"splitserve status: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(json.dumps(status_json(status)) if args.json else format_status(status, args.addr))
    return 0


def _add_scale(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scale", help="change the number of prefill and decode workers of a running server")
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--prefill", type=int, default=None, help="target number of prefill workers")
    p.add_argument("--decode", type=int, default=None, help="target number of decode workers")
    p.add_argument("--colocated", type=int, default=None, help="target number of colocated workers (mode colocated)")
    p.add_argument("--timeout", type=float, default=600.0)
    add_client_security_arguments(p)
    p.add_argument(
        "--cluster-token-file",
        metavar="FILE",
        help="the deployment's cluster token, which scaling needs when it has one "
        "(default: $SPLITSERVE_CLUSTER_TOKEN; without either, --api-key is sent)",
    )
    p.set_defaults(func=_scale)


def _scale(args: argparse.Namespace) -> int:
    import grpc

    from splitserve.rpc import workers_pb2 as wpb
    from splitserve.rpc import workers_pb2_grpc as wpb_grpc

    targets = {
        role: getattr(args, role) for role in ("prefill", "decode", "colocated") if getattr(args, role) is not None
    }
    if not targets:
        raise ValueError("give --prefill, --decode or --colocated")
    from splitserve.rpc.security import CLUSTER_TOKEN_ENV, ClientSecurity, read_token_file

    request = wpb.ScaleRequest(**targets)
    if args.cluster_token_file:
        token = read_token_file(args.cluster_token_file, "--cluster-token-file")[0]
    else:
        token = os.environ.get(CLUSTER_TOKEN_ENV) or None
    security = ClientSecurity(**{**client_security(args), **({"api_key": token} if token else {})})
    with security.channel(args.addr) as channel:
        try:
            reply = wpb_grpc.AdminStub(channel).Scale(request, timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"splitserve scale: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    counts = [f"{getattr(reply, role)} {role}" for role in ("prefill", "decode", "colocated") if getattr(reply, role)]
    print(f"{' and '.join(counts)} workers")
    return 0


def _add_make_certs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-certs", help="write a throwaway CA and server and client certificates (for trying TLS)")
    p.add_argument("--out", required=True, help="output folder (must hold no .pem or .key yet)")
    p.add_argument(
        "--host",
        action="append",
        default=[],
        help="another name or address the server certificate is valid for (repeatable)",
    )
    p.add_argument("--days", type=int, default=30, help="validity")
    p.set_defaults(func=_make_certs)


def _make_certs(args: argparse.Namespace) -> int:
    from splitserve.tools.certs import make_certs

    out = make_certs(args.out, args.host, args.days)
    print(f"wrote ca.pem, server.pem, client.pem and their keys to {out}")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from splitserve.bench.options import add_bench_arguments

    p = sub.add_parser(
        "bench",
        help="load a running server and measure it as vLLM's benchmark_serving does "
        "(`bench sweep`: over request rates, with goodput and plots)",
    )
    add_bench_arguments(p)
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from splitserve.bench.options import run_bench

    return run_bench(args)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    from splitserve.planning.options import add_profile_arguments

    p = sub.add_parser(
        "profile", help="measure a model's steps and KV transfer on this device and write a profile (JSON)"
    )
    add_profile_arguments(p)
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from splitserve.planning.options import run_profile

    return run_profile(args)


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from splitserve.planning.options import add_simulate_arguments

    p = sub.add_parser(
        "simulate",
        help="simulate a deployment on a workload, timed by profiles; prints what `splitserve bench` would",
    )
    add_simulate_arguments(p)
    p.set_defaults(func=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    from splitserve.planning.options import run_simulate

    return run_simulate(args)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from splitserve.planning.options import add_plan_arguments

    p = sub.add_parser(
        "plan", help="search prefill and decode counts and TP (and colocated) for the most goodput per device"
    )
    add_plan_arguments(p)
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    from splitserve.planning.options import run_plan

    return run_plan(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_model(sub)
    _add_serve(sub)
    _add_generate(sub)
    _add_status(sub)
    _add_scale(sub)
    _add_bench(sub)
    _add_profile(sub)
    _add_simulate(sub)
    _add_plan(sub)
    _add_make_certs(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"splitserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
