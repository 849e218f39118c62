"""Sends the requests over ``grpc.aio`` (or, with ``backend="openai"``, over any OpenAI-compatible HTTP
server: splitserve.bench.openai_backend) and times every streamed message.

Each request is a task that sleeps until it is due (its arrival offset), waits for a slot when
``max_concurrency`` is set, and only then counts as sent: TTFT, ITL and E2EL start there, and the
wait before it is the request's client-side queue time. Every call carries a deadline
(``request_timeout_s``), so a run always ends; a failed call is recorded with its status code.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Sequence
from datetime import datetime

import grpc

from splitserve.bench.config import BenchConfig
from splitserve.bench.datasets import BenchRequest
from splitserve.bench.metrics import SERVER_TIMINGS, RequestRecord, per_request_lists, summarize
from splitserve.bench.progress import Progress, run_timed
from splitserve.client.grpc_client import make_request
from splitserve.engine.hardware import describe_machine
from splitserve.rpc.options import CLIENT_OPTIONS
from splitserve.rpc.security import ClientSecurity
from splitserve.v1 import splitserve_pb2 as pb
from splitserve.v1 import splitserve_pb2_grpc as pb_grpc


async def get_status(
    addr: str, timeout_s: float = 10.0, security: ClientSecurity | None = None
) -> pb.GetStatusResponse:
    async with (security or ClientSecurity()).channel(addr, CLIENT_OPTIONS, aio=True) as channel:
        return await pb_grpc.SplitServeStub(channel).GetStatus(pb.GetStatusRequest(), timeout=timeout_s)


async def _send(
    stub: pb_grpc.SplitServeStub,
    message: pb.GenerateRequest,
    record: RequestRecord,
    start: float,
    config: BenchConfig,
    slots: asyncio.Semaphore | None,
    progress: Progress,
) -> None:
    await asyncio.sleep(max(0.0, start + record.due_s - time.perf_counter()))
    async with slots if slots is not None else contextlib.nullcontext():
        sent = last = time.perf_counter()
        record.sent_s = sent - start
        try:
            async for response in stub.Generate(message, timeout=config.request_timeout_s):
                now = time.perf_counter()
                if response.token_ids:
                    if record.output_len == 0:
                        record.ttft_s = now - sent
                    else:
                        record.itls_s.append(now - last)
                    last = now
                    record.output_len += len(response.token_ids)
                if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    record.cached_tokens = response.usage.cached_tokens
                    t = response.timing
                    record.server_timing = {key: getattr(t, key) for key in (*SERVER_TIMINGS, "reprefills")}
            record.e2el_s = time.perf_counter() - sent
        except grpc.aio.AioRpcError as e:
            record.error_code, record.error = e.code().name, f"{e.code().name}: {e.details()}"
        except Exception as e:  # noqa: BLE001  (a client-side failure is a failed request, not a crash)
            record.error_code, record.error = type(e).__name__, f"{type(e).__name__}: {e}"
    record.finished = True
    progress.update(record.success)


def new_records(requests: Sequence[BenchRequest], offsets_s: Sequence[float]) -> list[RequestRecord]:
    """One empty record per request, due at its offset."""
    return [RequestRecord(r.prompt_len, r.output_len, due_s=o) for r, o in zip(requests, offsets_s, strict=True)]


async def run_requests(
    requests: Sequence[BenchRequest],
    offsets_s: Sequence[float],
    config: BenchConfig,
    *,
    seeds: Sequence[int] | None = None,
    start_at: float | None = None,
    records: list[RequestRecord] | None = None,
    progress: Progress | None = None,
) -> tuple[list[RequestRecord], float]:
    """Sends request i at ``offsets_s[i]`` after the start; returns the records and the duration (s).

    A load client on Ray sends a share of a run: ``seeds`` are its requests' sampling seeds (default
    ``config.seed + i``), ``start_at`` the common start in its clock (``progress.run_timed``), and
    ``records`` (from ``new_records``) the list it fills, which the client reads while the run goes on."""
    records = new_records(requests, offsets_s) if records is None else records
    seeds = [config.seed + i for i in range(len(requests))] if seeds is None else seeds
    # Built before the clock starts: serializing long prompts must not delay the requests due first.
    messages = [
        make_request(
            token_ids=r.prompt,
            max_tokens=r.output_len,
            temperature=config.temperature,
            ignore_eos=config.ignore_eos,
            seed=seed,
        )
        for r, seed in zip(requests, seeds, strict=True)
    ]
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    progress = Progress(len(requests), config.progress) if progress is None else progress
    async with config.security.channel(config.addr, CLIENT_OPTIONS, aio=True) as channel:
        stub = pb_grpc.SplitServeStub(channel)
        duration = await run_timed(
            lambda start: (_send(stub, m, rec, start, config, slots, progress) for m, rec in zip(messages, records)),
            progress,
            start_at,
        )
    return records, duration


def benchmark(
    requests: Sequence[BenchRequest],
    offsets_s: Sequence[float],
    config: BenchConfig,
    model_id: str = "",
    dataset: str = "",
) -> dict:
    """One run: vLLM's result keys, the per-request lists and the run's settings."""
    if config.backend == "openai":
        from splitserve.bench import openai_backend

        check_openai_model(config)
        progress = Progress(len(requests), config.progress)
        run = openai_backend.run_requests(requests, offsets_s, config, config.model, progress)
    else:
        run = run_requests(requests, offsets_s, config)
    records, duration = asyncio.run(run)
    return result_of(records, duration, config, model_id, dataset)


def check_openai_model(config: BenchConfig) -> None:
    if config.backend == "openai" and not config.model:
        raise ValueError("--model: backend openai sends a model name with every request")


def result_of(
    records: Sequence[RequestRecord], duration_s: float, config: BenchConfig, model_id: str = "", dataset: str = ""
) -> dict:
    """The result of a run from its records (in request order) and its duration; every run's keys, one
    client's or many merged (``splitserve.bench.ray_clients``)."""
    rate = config.request_rate
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": config.backend,
        "model_id": model_id or config.model,
        "dataset": dataset,
        "addr": config.base_url if config.backend == "openai" else config.addr,
        "num_prompts": len(records),
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "temperature": config.temperature,
        "ignore_eos": config.ignore_eos,
        # The load generator's machine (torch is not imported); the workers' is in their benchmark's header.
        "client_machine": describe_machine(probe_torch=False),
        **summarize(records, duration_s, config.percentiles, config.goodput),
        **per_request_lists(records),
    }
