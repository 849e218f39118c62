"""Run one worker as a plain process (for debugging): ``python -m splitserve.prefill_worker --model DIR``.

It serves until SIGINT or SIGTERM. Point a router at it with ``python -m splitserve.router --prefill ADDR
--decode ADDR --model DIR``.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

from splitserve.common.validate import field_default
from splitserve.engine.core import EngineConfig
from splitserve.engine.model.linear_tuner import LINEAR_KERNELS
from splitserve.observability.logs import LOG_FORMATS, configure_logging
from splitserve.worker_common.affinity import parse_cpu_list, thread_count
from splitserve.worker_common.base import WorkerBase
from splitserve.worker_common.config import MAX_INFLIGHT, WorkerConfig


def main(role: str, worker_class: type[WorkerBase], argv: list[str] | None = None) -> int:
    """Parse ``argv`` and serve ``worker_class`` until a signal. Each worker's ``__main__`` passes its own
    class: this package sits below both worker packages and may not import them (docs/architecture.md)."""
    p = argparse.ArgumentParser(prog=f"python -m splitserve.{role}_worker", description=__doc__)
    p.add_argument("--model", required=True, help="local Hugging Face model folder")
    p.add_argument("--worker-id", default=f"{role}-0")
    # Defaults come from the configs themselves (one place each).
    p.add_argument("--host", default=field_default(WorkerConfig, "host"), help="address to bind and advertise")
    p.add_argument("--port", type=int, default=field_default(WorkerConfig, "port"))
    p.add_argument("--dtype", default=field_default(EngineConfig, "dtype"))
    p.add_argument("--device", default=field_default(EngineConfig, "device"))
    p.add_argument("--block-size", type=int, default=field_default(EngineConfig, "block_size"))
    p.add_argument("--num-blocks", type=int, default=field_default(EngineConfig, "num_blocks"))
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: one per --cpus cpu, else torch's)"
    )
    p.add_argument(
        "--cpus",
        type=_cpu_list,
        default=None,
        help="pin the process to these cpus before torch starts its threads: '0,1' or '0-1'",
    )
    p.add_argument(
        "--linear-kernel",
        choices=LINEAR_KERNELS,
        default=field_default(EngineConfig, "linear_kernel"),
        help="CPU linear-layer kernel; auto: timed per weight shape at load (engine/model/linear_tuner.py)",
    )
    p.add_argument(
        "--max-inflight",
        type=int,
        default=MAX_INFLIGHT[role],
        help="prefill: requests before their first token; decode: leases held",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=field_default(WorkerConfig, "metrics_port"),
        help="serve Prometheus /metrics here (0: any free port)",
    )
    p.add_argument("--log-format", choices=LOG_FORMATS, default=field_default(WorkerConfig, "log_format"))
    args = p.parse_args(argv)
    threads = thread_count(args.threads, args.cpus)
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for what this process starts; torch is told directly
    configure_logging(args.log_format, static={"worker_id": args.worker_id, "role": role})
    engine = EngineConfig(
        model_dir=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        num_threads=threads,
        linear_kernel=args.linear_kernel,
        enable_prefix_caching=role == "prefill",
    )
    try:  # a bad setting (cpus not on this machine, too many threads for them) is a usage error
        worker = worker_class(
            WorkerConfig(
                role=role,
                worker_id=args.worker_id,
                engine=engine,
                host=args.host,
                port=args.port,
                max_inflight=args.max_inflight,
                metrics_port=args.metrics_port,
                log_format=args.log_format,
                cpus=args.cpus,
            )
        )
    except ValueError as e:
        p.error(str(e))
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    print(f"{role} worker {args.worker_id} ready on {worker.start()}", flush=True)
    stop.wait()
    worker.stop()
    return 0


def _cpu_list(text: str) -> tuple[int, ...]:
    try:
        return parse_cpu_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
