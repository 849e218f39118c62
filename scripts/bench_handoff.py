#!/usr/bin/env python3
"""The KV hand-off per request on the vllm engine backend against the splitserve engine's, on the same bytes.

One 1P+1D deployment per backend on an embedded Ray (loopback), one at a time, on the same checkpoint, dtype and
cores; --requests sequential requests of --prompt-len tokens (a multiple of both backends' block sizes, 16 and
vLLM's 128 on CPU, so both move the same bytes) and 2 new tokens, greedy. Per request the router's
``timing.transfer_ms`` (the prefill worker's first token until the KV had fully landed on the decode worker) and
``prefill_ms``; the median of each, and vllm / splitserve. Prints the ISA header first; `--json` prints one JSON
object as the last line.

    python scripts/bench_handoff.py --model models/qwen2.5-0.5b --dtype float32 --prompt-len 512 --requests 12
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.deploy.embedded_ray import use_loopback_ray  # noqa: E402

use_loopback_ray()  # before Ray is imported

from splitserve.engine.hardware import print_header  # noqa: E402

VLLM_BLOCK = 128  # vLLM's CPU block size (docs/engine.md)


def measure(args, backend: str, prompts: list[list[int]]) -> dict:
    from splitserve.client.grpc_client import Client
    from splitserve.deploy.config import DeploymentConfig
    from splitserve.deploy.deployment import Deployment

    config = DeploymentConfig.from_dict(
        {
            "model": str(args.model),
            "dtype": args.dtype,
            "port": 0,
            "prefill": {"threads": args.threads},
            "decode": {"threads": args.threads},
            "engine": {"backend": backend, "kv_cache_bytes": 512 << 20},
        }
    )
    deployment = Deployment(config)
    deployment.start()
    try:
        transfer, prefill = [], []
        with Client(deployment.address) as client:
            client.generate(token_ids=prompts[0], max_tokens=2, temperature=0.0, ignore_eos=True)  # warm: pairs
            for prompt in prompts[1:]:
                done = client.generate(token_ids=prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
                transfer.append(done.timing["transfer_ms"])
                prefill.append(done.timing["prefill_ms"])
    finally:
        deployment.stop()
    return {
        "transfer_ms_median": statistics.median(transfer),
        "transfer_ms": transfer,
        "prefill_ms_median": statistics.median(prefill),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "qwen2.5-0.5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.prompt_len % VLLM_BLOCK:
        ap.error(f"--prompt-len: a multiple of {VLLM_BLOCK}, so both backends move whole blocks of the same bytes")
    machine = print_header(args.dtype, args.threads, "cpu", to_stderr=args.json)
    config = json.loads((args.model / "config.json").read_text())
    rng = random.Random(5)
    prompts = [[rng.randrange(config["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(args.requests + 1)]
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    element = 4 if args.dtype == "float32" else 2
    nbytes = 2 * config["num_hidden_layers"] * heads * head_dim * element * args.prompt_len
    result = {"machine": machine, "prompt_len": args.prompt_len, "kv_bytes": nbytes, "requests": args.requests}
    for backend in ("splitserve", "vllm"):
        print(f"1P+1D on the {backend} backend ...", file=sys.stderr, flush=True)
        result[backend] = measure(args, backend, prompts)
    result["vllm_over_splitserve"] = result["vllm"]["transfer_ms_median"] / result["splitserve"]["transfer_ms_median"]
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"KV hand-off of {args.prompt_len}-token prompts ({nbytes / 1e6:.1f} MB each), median of {args.requests}:")
    for backend in ("splitserve", "vllm"):
        r = result[backend]
        print(f"  {backend:10s} transfer {r['transfer_ms_median']:.1f} ms, prefill {r['prefill_ms_median']:.0f} ms")
    print(f"  vllm / splitserve transfer: {result['vllm_over_splitserve']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
