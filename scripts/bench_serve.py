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

Measurements alternate between the systems (best of --repeats each) so that this machine's drift
hits all alike. `--json` prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.launch import use_loopback_ray  # noqa: E402

use_loopback_ray()  # before Ray is imported

import torch  # noqa: E402

from engine.hardware import print_header  # noqa: E402


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def served_single(address: str, prompt: list[int], new: int) -> dict:
    from splitserve.client import Client

    with Client(address) as client:
        result = client.generate(token_ids=prompt, max_tokens=new, temperature=0.0, ignore_eos=True)
    decode_s = (sum(result.itl_ms) / 1e3) / (len(result.token_ids) - 1)
    return {"ttft_ms": result.ttft_ms, "tpot_ms": decode_s * 1e3, "decode_tok_s": 1 / decode_s}


def served_concurrent(address: str, batch: list[list[int]], new: int) -> dict:
    from splitserve.client import Client

    with Client(address) as client, ThreadPoolExecutor(len(batch)) as pool:
        start = time.perf_counter()
        results = list(pool.map(lambda p: client.generate(token_ids=p, max_tokens=new, temperature=0.0,
                                                          ignore_eos=True), batch))  # fmt: skip
        elapsed = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    return {"output_tok_s": tokens / elapsed, "seconds": elapsed,
            "mean_ttft_ms": sum(r.ttft_ms for r in results) / len(results)}  # fmt: skip


def offline_single(llm, prompt: list[int], new: int) -> dict:
    from engine import SamplingParams

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
    from engine import SamplingParams

    start = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    elapsed = time.perf_counter() - start
    return {"output_tok_s": sum(len(o.token_ids) for o in outs) / elapsed, "seconds": elapsed}


def hf_times(model, batch: int, prompt_len: int, new: int) -> dict:
    ids = torch.tensor(prompts(batch, prompt_len, model.config.vocab_size, seed=batch))

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, min_new_tokens=n,
                           max_new_tokens=n, eos_token_id=None, pad_token_id=0)  # fmt: skip
        return time.perf_counter() - start

    t1, tn = run(1), run(new)
    return {"decode_tok_s": batch * (new - 1) / (tn - t1), "tpot_ms": (tn - t1) / (new - 1) * 1e3,
            "output_tok_s": batch * new / tn, "seconds": tn}  # fmt: skip


def best(runs: list[dict], key: str, higher: bool = True) -> dict:
    return max(runs, key=lambda r: r[key]) if higher else min(runs, key=lambda r: r[key])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "qwen2.5-0.5b")
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each worker and of the baselines")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    machine = print_header(args.dtype, args.threads, "cpu", to_stderr=args.json)
    if not (args.model / "config.json").is_file():
        from splitserve.make_model import make_model

        log(f"writing the {args.preset} preset to {args.model} ...")
        make_model(args.preset, args.model, dtype=args.dtype, overwrite=True)
    from transformers import AutoModelForCausalLM

    from engine import LLM
    from splitserve.deploy_config import DeploymentConfig
    from splitserve.launch import Deployment

    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    single = prompts(1, args.prompt_len, vocab, seed=1)[0]
    batch = prompts(args.streams, args.prompt_len, vocab, seed=2)
    log("starting 1 prefill + 1 decode worker ...")
    deployment = Deployment(DeploymentConfig.from_dict({
        "model": str(args.model), "dtype": args.dtype, "port": 0,
        "prefill": {"threads": args.threads, "max_inflight": args.streams},
        "decode": {"threads": args.threads}, "engine": {"kv_cache_bytes": 512 << 20},
    }))  # fmt: skip
    address = deployment.start()
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    runs: dict[str, list] = {"served_single": [], "served_concurrent": [], "hf_1": [], "hf_n": []}
    try:
        served_single(address, single, 4)  # warm-up
        for r in range(args.repeats):
            log(f"round {r + 1}/{args.repeats} ...")
            runs["served_single"].append(served_single(address, single, args.new_tokens))
            runs["hf_1"].append(hf_times(hf, 1, args.prompt_len, args.new_tokens))
            runs["served_concurrent"].append(served_concurrent(address, batch, args.new_tokens))
            runs["hf_n"].append(hf_times(hf, args.streams, args.prompt_len, args.new_tokens))
    finally:
        deployment.stop()
    del hf
    gc.collect()
    log("offline engine ...")
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=False)
    offline_single(llm, single, 4)
    off_single = best([offline_single(llm, single, args.new_tokens) for _ in range(args.repeats)], "decode_tok_s")
    off_conc = best([offline_concurrent(llm, batch, args.new_tokens) for _ in range(args.repeats)], "output_tok_s")
    s1 = best(runs["served_single"], "decode_tok_s")
    sn = best(runs["served_concurrent"], "output_tok_s")
    h1, hn = best(runs["hf_1"], "decode_tok_s"), best(runs["hf_n"], "output_tok_s")
    result = {
        "model": str(args.model), "dtype": args.dtype, "threads": args.threads, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "streams": args.streams, "machine": machine,
        "served_single": s1, "served_concurrent": sn, "transformers_batch1": h1,
        f"transformers_batch{args.streams}": hn, "offline_single": off_single, "offline_concurrent": off_conc,
        "ratios": {
            "single_decode_vs_transformers_batch1": s1["decode_tok_s"] / h1["decode_tok_s"],
            "concurrent_output_vs_transformers_batch": sn["output_tok_s"] / hn["output_tok_s"],
            "served_vs_offline_single_decode": s1["decode_tok_s"] / off_single["decode_tok_s"],
            "served_vs_offline_ttft": off_single["ttft_ms"] / s1["ttft_ms"],
            "served_vs_offline_concurrent": sn["output_tok_s"] / off_conc["output_tok_s"],
        },
    }  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return 0
    r = result["ratios"]
    print(f"model {args.model} ({args.dtype}), {args.threads} threads per worker and baseline, prompts of "
          f"{args.prompt_len} tokens, {args.new_tokens} new tokens\n")  # fmt: skip
    print("| | splitserve (1P+1D) | offline engine | transformers | served / transformers |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| one stream: TTFT ms | {s1['ttft_ms']:.0f} | {off_single['ttft_ms']:.0f} | - | - |")
    print(f"| one stream: decode ms/token | {s1['tpot_ms']:.1f} | {off_single['tpot_ms']:.1f} | {h1['tpot_ms']:.1f} (batch 1) "
          f"| {r['single_decode_vs_transformers_batch1']:.2f}x |")  # fmt: skip
    print(f"| {args.streams} streams: output tok/s | {sn['output_tok_s']:.1f} | {off_conc['output_tok_s']:.1f} | "
          f"{hn['output_tok_s']:.1f} (batch {args.streams}) | {r['concurrent_output_vs_transformers_batch']:.2f}x |")  # fmt: skip
    print(f"\nserving vs offline engine: decode speed {r['served_vs_offline_single_decode']:.2f}x, TTFT "
          f"{r['served_vs_offline_ttft']:.2f}x, {args.streams}-stream throughput {r['served_vs_offline_concurrent']:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
