#!/usr/bin/env python3
"""Decode attention per call on one layer's paged cache: the dynamic path's gather, the torch reference
and the CPU kernel that reads the cache in place (engine/attention/cpu_paged_decode.py).

- gather: ``paged_attention._decode`` as the dynamic path runs it (the batch's blocks gathered by
  ``gather_context`` into a padded tensor, then SDPA), with the step's metadata built outside the timing;
- torch: ``paged_decode_torch`` (every row's ``max_blocks`` blocks gathered, masked, one SDPA);
- cpu: ``paged_decode_cpu`` (each row's blocks read in place; built on first use).

Each row's blocks are scattered at random over a cache of --cache-blocks blocks, as a busy cache holds
them. Shapes default to qwen2.5-0.5b's attention (14 query heads, 2 KV heads, head_dim 64); the time is
the median of --iters calls after a warm-up, and x24 is one decode step's attention over 24 layers.
With --cold, 128 MB are read before each timed call, so the call finds the cache's blocks in memory,
not in the CPU's caches, as it does in a step (where a layer's weights pass through them in between).
The CPU's model and its avx2/avx512f/avx512_bf16 flags are printed first: figures from different
machines do not compare.

    python scripts/bench_paged_decode.py [--context 128 512 2048] [--batch 1 16] [--dtype float32]
                                         [--threads 2] [--cold] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from splitserve.engine.attention import cpu_paged_decode
from splitserve.engine.attention.paged_attention import AttentionMetadata, _decode
from splitserve.engine.attention.paged_decode import paged_decode_torch
from splitserve.engine.kv_cache.cache import context_rows

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
COLD_BYTES = 128 << 20  # --cold: read between calls, more than any CPU cache here


def cpu_description() -> str:
    sig = cpu_paged_decode.cpu_signature()
    fields = dict(part.split(": ", 1) for part in sig.split(" | ") if ": " in part)
    flags = set(fields.get("flags", "").split())
    have = " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in FLAGS)
    return f"{fields.get('model name', sig)} ({torch.get_num_threads()} threads; {have})"


def timed(fn, iters: int, flush=None) -> float:
    fn()
    samples = []
    for _ in range(iters):
        if flush is not None:
            flush()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def case(args, batch: int, context: int, dtype: torch.dtype, kernel) -> dict:
    bs, kv_heads, heads, d = args.block_size, args.kv_heads, args.heads, args.head_dim
    per_row = -(-context // bs)
    num_blocks = max(args.cache_blocks, batch * per_row + 1)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(num_blocks, 2, kv_heads, bs, d, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * per_row].view(batch, per_row)
    lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, heads, d, generator=gen).to(dtype)
    scale = d**-0.5
    meta = AttentionMetadata(
        slot_blocks=torch.zeros(batch, dtype=torch.long),
        slot_offsets=torch.zeros(batch, dtype=torch.long),
        num_decodes=batch,
        decode_rows=context_rows(tables.reshape(-1), kv_heads),
        decode_context_lens=lens.tolist(),
    )
    meta.decode_span(None, q.device)
    ref = paged_decode_torch(q, cache, tables, lens, scale, None)
    row = {"batch": batch, "context": context, "dtype": str(dtype).removeprefix("torch."), "cold": args.cold}
    flush = None
    if args.cold:  # a layer's weights pass through the caches between two layers' attention: so does this
        scratch = torch.ones(COLD_BYTES // 4, dtype=torch.float32)

        def flush():  # read, not written: the caches end up holding clean lines, as after a layer's weights
            scratch.sum()

    row["gather_ms"] = timed(lambda: _decode(q, cache, meta, scale, None), args.iters, flush)
    row["torch_ms"] = timed(lambda: paged_decode_torch(q, cache, tables, lens, scale, None), args.iters, flush)
    if kernel is not None:
        out = kernel(q, cache, tables, lens, scale, None)
        row["cpu_max_err"] = float((out.float() - ref.float()).abs().max())
        row["cpu_ms"] = timed(lambda: kernel(q, cache, tables, lens, scale, None), args.iters, flush)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cache-blocks", type=int, default=4096)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cold", action="store_true", help="evict the caches before each timed call (as in a model step)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = cpu_paged_decode.paged_decode_cpu if cpu_paged_decode.load() is not None else None
    print(f"# cpu: {cpu_description()}")
    if kernel is None:
        print(f"# cpu kernel unavailable: {cpu_paged_decode.failure()}")
    rows = [
        case(args, batch, context, getattr(torch, dtype), kernel)
        for dtype in args.dtype
        for batch in args.batch
        for context in args.context
    ]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        f"{'dtype':9} {'batch':>5} {'context':>7} {'gather ms':>10} {'torch ms':>9} {'cpu ms':>8}"
        "  gather/cpu  x24 (gather -> cpu)"
    )
    for r in rows:
        cpu = r.get("cpu_ms")
        tail = (
            f"{r['gather_ms'] / cpu:9.2f}x  {24 * r['gather_ms']:.2f} -> {24 * cpu:.2f} ms" if cpu else "  (no kernel)"
        )
        print(
            f"{r['dtype']:9} {r['batch']:5} {r['context']:7} {r['gather_ms']:10.3f} {r['torch_ms']:9.3f} "
            f"{cpu or float('nan'):8.3f} {tail}"
        )


if __name__ == "__main__":
    main()
