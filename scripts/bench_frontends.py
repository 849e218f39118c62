#!/usr/bin/env python3
"""The OpenAI HTTP API against the gRPC API, and what metrics cost, on one deployment.

Starts ``splitserve serve`` (embedded Ray, 1 prefill + 1 decode worker, the tiny checkpoint unless
``--model``) with ``--openai-port 0 --metrics-port 0``, then sends the same greedy requests one at a
time through gRPC (the baseline) and through ``/v1/completions`` (whole and streamed), alternating, and
prints each one's mean and p50 end-to-end latency and the ratio to gRPC. Then it scrapes the router's
and each worker's ``/metrics`` and prints the time a scrape takes and its size. ``--json`` prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.deploy.embedded_ray import use_loopback_ray  # noqa: E402

use_loopback_ray()

from splitserve.client.grpc_client import Client  # noqa: E402
from splitserve.deploy.sim_cluster import ServeProcess  # noqa: E402
from splitserve.engine.hardware import print_header  # noqa: E402
from splitserve.tools.make_model import make_model  # noqa: E402


def post(url: str, body: dict, stream: bool) -> None:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        if stream:
            for line in response:
                if line.strip() == b"data: [DONE]":
                    return
        else:
            json.load(response)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=40, help="per front end")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    machine = print_header(
        "float32" if args.model is None else "float32 (--model)", "1 per worker", "cpu", to_stderr=args.json
    )
    with tempfile.TemporaryDirectory(prefix="fe") as tmp:
        model = args.model or str(make_model("tiny", Path(tmp) / "tiny", dtype="float32", seed=0))
        served = ServeProcess(
            {
                "model": model,
                "dtype": "float32",
                "port": 0,
                "openai_port": 0,
                "metrics_port": 0,
                "prefill": {"threads": 1},
                "decode": {"threads": 1},
            },
            Path(tmp) / "fe.yaml",
        )
        try:
            with Client(served.address) as client:
                status = client.status()
                name = status.model
                workers = [w.metrics_address for w in status.workers]
                router_metrics = status.metrics_address
            url = f"{served.openai_url}/completions"
            times = {"grpc": [], "openai": [], "openai_stream": []}
            prompts = [[(17 * i + j) % 1000 + 1 for j in range(32)] for i in range(args.requests)]
            with Client(served.address) as client:
                for prompt in prompts[:4]:  # warm up
                    client.generate(token_ids=prompt, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
                for prompt in prompts:
                    body = {
                        "model": name,
                        "prompt": prompt,
                        "max_tokens": args.max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    }
                    for kind in times:
                        start = time.perf_counter()
                        if kind == "grpc":
                            client.generate(
                                token_ids=prompt, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True
                            )
                        else:
                            post(url, {**body, "stream": kind == "openai_stream"}, kind == "openai_stream")
                        times[kind].append(time.perf_counter() - start)
            base = statistics.mean(times["grpc"])
            result = {
                "machine": machine,
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "frontends": {
                    kind: {
                        "mean_ms": statistics.mean(t) * 1e3,
                        "p50_ms": statistics.median(t) * 1e3,
                        "vs_grpc": statistics.mean(t) / base,
                    }
                    for kind, t in times.items()
                },
                "scrapes": {},
            }
            for label, address in [("router", router_metrics), *((f"worker {i}", a) for i, a in enumerate(workers))]:
                durations, size = [], 0
                for _ in range(20):
                    start = time.perf_counter()
                    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
                        size = len(response.read())
                    durations.append(time.perf_counter() - start)
                result["scrapes"][label] = {"p50_ms": statistics.median(durations) * 1e3, "bytes": size}
        finally:
            served.stop()
    if args.json:
        print(json.dumps(result))
        return 0
    for kind, r in result["frontends"].items():
        print(f"{kind:14s} mean {r['mean_ms']:7.1f} ms  p50 {r['p50_ms']:7.1f} ms  {r['vs_grpc']:.2f}x gRPC")
    for label, r in result["scrapes"].items():
        print(f"/metrics {label:9s} p50 {r['p50_ms']:5.1f} ms, {r['bytes']} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
