#!/usr/bin/env python3
"""The tensor-parallel engine on this machine's devices: rank 0 drives (``tensor_parallel_step="plan"``),
the other ranks follow, and rank 0's greedy output must equal the unsharded engine's token for token.

- ``--device cuda``: one rank per visible GPU, joined by NCCL; on a one-GPU machine two ranks share
  cuda:0 over gloo (NCCL refuses two ranks on one device), which still exercises the sharded loader onto
  the GPU, the step channel and the all-reduce on GPU tensors. The table says which.
- ``--device cpu``: two ranks over gloo on the CPU (CI's rehearsal of this script).

Each rank is a spawned process on 127.0.0.1 meeting at a store this process hosts. Printed: one table
(ranks, backend, devices, weights checksum equal to TP 1's, greedy tokens equal to TP 1's, the steps the
followers ran, decode ms/step at TP t and at TP 1). The model is the ``small`` preset (8 heads, 2 KV
heads: replicated from 4 ranks up) in fp32, written on the spot.

    python scripts/gpu_tp_check.py --device cuda [--model DIR] [--json-out FILE]
Exits 1 when the outputs or checksums differ.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # spawned ranks inherit it

HOST = "127.0.0.1"
SETUP_TIMEOUT_S = 120.0
GROUP_TIMEOUT_S = 60.0
PROMPT_LENGTHS = (7, 60, 200)
NEW_TOKENS = 24


def prompts() -> list[list[int]]:
    import random

    rng = random.Random(3)
    return [[rng.randrange(30000) for _ in range(n)] for n in PROMPT_LENGTHS]


def engine_options(device: str) -> dict:
    return {"dtype": "float32", "device": device, "block_size": 16, "num_blocks": 512, "decode_path": "dynamic"}


def generate(llm) -> tuple[list[list[int]], float]:
    """Greedy tokens of the prompts, and decode ms/step (the steps after every prompt's first token)."""
    from splitserve.engine import SamplingParams

    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [llm.add_request(p, sp) for p in prompts()]
    tokens: dict[str, list[int]] = {}
    decode_s, decode_steps = 0.0, 0
    while llm.has_unfinished_requests():
        decoding = all(r.num_output_tokens > 0 for r in llm.scheduler.running) and not llm.scheduler.waiting
        _sync(llm.device)
        start = time.perf_counter()
        for out in llm.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
        _sync(llm.device)
        if decoding:
            decode_s += time.perf_counter() - start
            decode_steps += 1
    return [tokens[i] for i in ids], decode_s / max(decode_steps, 1) * 1e3


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank_main(model_dir: str, rank: int, size: int, backend: str, device: str, port: int, results) -> None:
    try:
        import torch

        from splitserve.engine import LLM
        from splitserve.engine.core import EngineConfig, EngineCore
        from splitserve.engine.tp.distributed import TPGroup, connect_store
        from splitserve.engine.tp.step import follow

        torch.set_num_threads(1)
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        store = connect_store(HOST, port, SETUP_TIMEOUT_S)
        group = TPGroup.join(
            backend, store, "tp/", rank, size, HOST, GROUP_TIMEOUT_S, SETUP_TIMEOUT_S, torch.device(device)
        )
        options = {
            **engine_options(device),
            "tensor_parallel_size": size,
            "tensor_parallel_rank": rank,
            "tensor_parallel_step": "plan",
        }
        if rank == 0:
            with LLM(model_dir, tp_group=group, **options) as llm:
                tokens, ms = generate(llm)
                llm.check_integrity()
                results.put((0, True, {"tokens": tokens, "ms": ms, "checksum": llm.weights_checksum}))
        else:
            core = EngineCore(EngineConfig(model_dir=model_dir, **options), tp_group=group)
            steps = follow(core, group)
            results.put((rank, True, {"steps": steps, "checksum": core.weights_checksum}))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(model_dir: str, size: int, backend: str, devices: list[str]) -> dict[int, dict]:
    import torch.multiprocessing as mp

    from splitserve.engine.tp.distributed import bind_store

    store, port = bind_store(HOST, 0, SETUP_TIMEOUT_S)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(model_dir, r, size, backend, devices[r], port, results))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    deadline = time.monotonic() + 420
    try:
        while len(got) < size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                    raise RuntimeError(f"ranks {sorted(set(range(size)) - set(got))} did not report") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--model", help="a checkpoint folder; default: the small preset written to a temp folder")
    parser.add_argument("--json-out", help="also write the row as JSON here")
    args = parser.parse_args()

    import torch

    from splitserve.engine import LLM

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus == 0:
        raise SystemExit("--device cuda but torch sees no GPU")
    if gpus > 1:
        size, backend, devices = gpus, "nccl", [f"cuda:{r}" for r in range(gpus)]
        how = f"{gpus} GPUs, one rank each, NCCL"
    elif gpus == 1:
        size, backend, devices = 2, "gloo", ["cuda:0", "cuda:0"]
        how = "1 GPU: 2 ranks share cuda:0 over gloo (NCCL needs a GPU per rank)"
    else:
        size, backend, devices = 2, "gloo", ["cpu", "cpu"]
        how = "CPU rehearsal: 2 ranks over gloo"
    model_dir = args.model
    if model_dir is None:
        from splitserve.tools.make_model import make_model

        model_dir = str(make_model("small", Path(tempfile.mkdtemp()) / "small", dtype="float32", seed=0))

    reference = LLM(model_dir, **engine_options(devices[0]))
    ref_tokens, ref_ms = generate(reference)
    ref_checksum = reference.weights_checksum
    del reference
    if args.device == "cuda":
        torch.cuda.empty_cache()

    ranks = run_ranks(model_dir, size, backend, devices)
    lead = ranks[0]
    checksums_equal = all(r["checksum"] == ref_checksum for r in ranks.values())
    tokens_equal = lead["tokens"] == ref_tokens
    follower_steps = sorted({r["steps"] for rank, r in ranks.items() if rank})
    row = {
        "ranks": size,
        "backend": backend,
        "devices": how,
        "checksum_equal_tp1": checksums_equal,
        "greedy_equal_tp1": tokens_equal,
        "follower_steps": follower_steps,
        "decode_ms_per_step_tp": round(lead["ms"], 3),
        "decode_ms_per_step_tp1": round(ref_ms, 3),
    }
    print("| ranks | backend | devices | checksum = TP 1 | greedy = TP 1 | follower steps | decode ms/step TP | TP 1 |")
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {size} | {backend} | {how} | {'yes' if checksums_equal else 'NO'} | {'yes' if tokens_equal else 'NO'} "
        f"| {follower_steps} | {row['decode_ms_per_step_tp']} | {row['decode_ms_per_step_tp1']} |"
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(row, indent=1))
    if not (checksums_equal and tokens_equal):
        first = next((i for i, (a, b) in enumerate(zip(lead["tokens"], ref_tokens)) if a != b), None)
        print(
            f"MISMATCH: prompt {first}: {lead['tokens'][first] if first is not None else ''} vs TP 1", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
