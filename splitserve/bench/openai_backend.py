"""``splitserve bench --backend openai``: the same load and the same records over any OpenAI-compatible
HTTP server (vLLM's ``vllm serve``, splitserve's own ``--openai-port``), so one client measures both.

Each request is a streamed ``POST /v1/completions`` with the prompt as token ids, ``max_tokens``,
``temperature``, ``ignore_eos`` (vLLM's extension; splitserve's API takes it too), ``seed`` and
``stream_options.include_usage``. As vLLM's own ``benchmark_serving`` client counts them, every
server-sent chunk that carries a choice is a token arrival (the first one is TTFT, the gaps between
them are ITLs), and the output length is the usage chunk's ``completion_tokens`` (the chunk count when a
server sends no usage). Where a finished choice carries splitserve's ``timing`` object, it fills the
same server timings the gRPC backend reads from the router.

Every call has a deadline: the whole request ``request_timeout_s``, the model listing ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import aiohttp

from splitserve.bench.metrics import SERVER_TIMINGS, RequestRecord
from splitserve.bench.progress import Progress, run_timed

if TYPE_CHECKING:
    from splitserve.bench.config import BenchConfig
    from splitserve.bench.request import BenchRequest


def completions_url(base_url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> ``.../v1/completions``."""
    base = base_url.rstrip("/")
    return f"{base if base.endswith('/v1') else base + '/v1'}/completions"


async def list_models(base_url: str, timeout_s: float = 10.0, api_key: str | None = None) -> list[dict]:
    """The entries of ``GET /v1/models`` (each with "id"; vLLM and splitserve add "max_model_len")."""
    url = completions_url(base_url).removesuffix("/completions") + "/models"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.get(url, headers=_headers(api_key)) as response:
            if response.status != 200:
                raise RuntimeError(f"GET {url}: HTTP {response.status}: {(await response.text())[:200]}")
            return (await response.json())["data"]


def request_body(request: BenchRequest, model: str, config: BenchConfig, seed: int) -> dict:
    return {
        "model": model,
        "prompt": list(request.prompt),
        "max_tokens": request.output_len,
        "temperature": config.temperature,
        "ignore_eos": config.ignore_eos,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    record: RequestRecord,
    sent: float,
    timeout_s: float,
    api_key: str | None,
) -> None:
    """Fills ``record`` from one streamed completion; raises on an HTTP error or a broken stream."""
    last, chunks, completion_tokens = sent, 0, None
    async with session.post(
        url, json=body, headers=_headers(api_key), timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as response:
        if response.status != 200:
            raise _HTTPError(response.status, (await response.text())[:300])
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:") :].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            now = time.perf_counter()
            if choices := chunk.get("choices"):
                if chunks == 0:
                    record.ttft_s = now - sent
                else:
                    record.itls_s.append(now - last)
                last, chunks = now, chunks + 1
                if timing := choices[0].get("timing"):
                    record.server_timing = {k: float(timing.get(k, 0.0)) for k in (*SERVER_TIMINGS, "reprefills")}
            if usage := chunk.get("usage"):
                completion_tokens = usage.get("completion_tokens")
                record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    record.output_len = completion_tokens if completion_tokens is not None else chunks
    record.e2el_s = time.perf_counter() - sent


class _HTTPError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    record: RequestRecord,
    start: float,
    config: BenchConfig,
    slots: asyncio.Semaphore | None,
    progress: Progress,
) -> None:
    await asyncio.sleep(max(0.0, start + record.due_s - time.perf_counter()))
    async with slots if slots is not None else contextlib.nullcontext():
        sent = time.perf_counter()
        record.sent_s = sent - start
        try:
            await _stream(session, url, body, record, sent, config.request_timeout_s, config.security.api_key)
        except _HTTPError as e:
            record.error_code, record.error = f"HTTP_{e.status}", str(e)
        except TimeoutError:
            record.error_code, record.error = "DEADLINE_EXCEEDED", f"no answer within {config.request_timeout_s} s"
        except Exception as e:  # noqa: BLE001  (a client-side failure is a failed request, not a crash)
            record.error_code, record.error = type(e).__name__, f"{type(e).__name__}: {e}"
    record.finished = True
    progress.update(record.success)


async def run_requests(
    requests: Sequence[BenchRequest],
    offsets_s: Sequence[float],
    config: BenchConfig,
    model: str,
    progress: Progress,
    *,
    seeds: Sequence[int] | None = None,
    start_at: float | None = None,
    records: list[RequestRecord] | None = None,
) -> tuple[list[RequestRecord], float]:
    """As ``runner.run_requests``, over HTTP: request i is sent ``offsets_s[i]`` after the start (``seeds``,
    ``start_at`` and ``records`` as there)."""
    if records is None:
        records = [RequestRecord(r.prompt_len, r.output_len, due_s=o) for r, o in zip(requests, offsets_s, strict=True)]
    seeds = [config.seed + i for i in range(len(requests))] if seeds is None else seeds
    bodies = [request_body(r, model, config, seed) for r, seed in zip(requests, seeds, strict=True)]
    url = completions_url(config.base_url)
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    # No connection limit below the concurrency: aiohttp's default pool (100) would queue requests itself.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        duration = await run_timed(
            lambda start: (
                _send(session, url, b, rec, start, config, slots, progress) for b, rec in zip(bodies, records)
            ),
            progress,
            start_at,
        )
    return records, duration
