"""Run the router alone, in front of workers started as plain processes (for debugging)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from splitserve.observability.logs import configure_logging
from splitserve.router.config import POLICIES, RouterConfig
from splitserve.router.server import Router
from splitserve.router.workers import WorkerAddress


async def _run(args: argparse.Namespace) -> None:
    workers = [WorkerAddress("prefill", a) for a in args.prefill] + [WorkerAddress("decode", a) for a in args.decode]
    router = Router(
        RouterConfig(
            model_dir=args.model,
            host=args.host,
            port=args.port,
            block_size=args.block_size,
            routing_policy=args.policy,
            metrics_port=args.metrics_port,
            openai_port=args.openai_port,
        ),
        workers,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    address = await router.start()
    if router.openai_address:
        print(f"splitserve OpenAI API on http://{router.openai_address}/v1", flush=True)
    print(f"splitserve ready on {address}", flush=True)
    await stop.wait()
    await router.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitserve.router", description=__doc__)
    p.add_argument("--model", required=True, help="the workers' model folder (for its tokenizer and config)")
    p.add_argument("--prefill", action="append", required=True, help="a prefill worker's host:port (repeatable)")
    p.add_argument("--decode", action="append", required=True, help="a decode worker's host:port (repeatable)")
    p.add_argument("--host", default=RouterConfig.host)
    p.add_argument("--port", type=int, default=RouterConfig.port)
    p.add_argument("--openai-port", type=int, default=None, help="also serve the OpenAI API here (0: any free port)")
    p.add_argument("--block-size", type=int, default=RouterConfig.block_size)
    p.add_argument("--policy", default=RouterConfig.routing_policy, choices=POLICIES)
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here (0: any free port)")
    p.add_argument("--log-format", choices=["text", "json"], default="text")
    args = p.parse_args(argv)
    configure_logging(args.log_format)
    asyncio.run(_run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
