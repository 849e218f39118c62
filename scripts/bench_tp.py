#!/usr/bin/env python3
"""Tensor parallelism on this CPU, measured: TP 1 with 2 torch threads against TP 2 with one thread per rank.

For each preset (random-weight checkpoints written with `splitserve make-model` when missing, float32):

- TP 1: one process, one ``LLM``, 2 torch threads, bound to the first two usable cores;
- TP 2: two processes on 127.0.0.1 forming a gloo ``TPGroup``, one ``LLM`` rank each, one torch thread each,
  rank r bound to usable core r (no binding on a machine with fewer than 2 usable cores);
- prefill tok/s: one prompt of --prompt-len tokens, one output token, best of --repeats (prefix caching
  off, so a repeat computes the whole prompt again);
- decode tok/s at each --decode-batches (default 1 and 8): prompts of --decode-prompt-len tokens,
  --new-tokens output tokens each, only the steps in which every request of the batch decodes are timed;
- the ratio TP2/TP1 of every figure (above 1: TP 2 is faster);
- at TP 2, the all-reduce's share of a step: the time the benchmark spends inside ``TPGroup.all_reduce``
  (the benchmark wraps the group's method with a timer; the engine is unchanged) over the steps' wall
  time, averaged over the ranks. It includes the wait for the slower rank, which is part of TP's cost.

Both configurations run in child processes of their own, one after the other, so they never share
cores or memory. At TP 2 every rank runs the same calls in lockstep; a figure's time is the slowest
rank's.

    python scripts/bench_tp.py [--presets small,qwen2.5-0.5b] [--prompt-len 512] [--new-tokens 32]
                               [--decode-batches 1,8] [--repeats 3] [--json]      # make bench-tp
With --json the last line of stdout is one JSON object: "presets" maps each preset to its "tp1" and
"tp2" figures (prefill_tok_s, decode_tok_s by batch), "ratio" (TP2/TP1, same keys) and
"all_reduce_share" (prefill and decode by batch, plus all_reduce_calls_per_step).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import sys
import time
import traceback
from pathlib import Path

# A benchmark, not part of the installed package: it drives the engine, its process group and the
# checkpoint writer together (docs/architecture.md).
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # spawned ranks inherit it

HOST = "127.0.0.1"
SETUP_TIMEOUT_S = 60.0  # ranks finish importing torch seconds apart on busy cores
GROUP_TIMEOUT_S = 60.0  # one collective: generous, a shared machine may stall a rank for seconds
PRESETS = ("small", "qwen2.5-0.5b")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_model(path: Path, preset: str) -> Path:
    if not (path / "config.json").is_file():
        from splitserve.tools.make_model import make_model

        log(f"writing the {preset} preset to {path} ...")
        make_model(preset, path, dtype="float32", overwrite=True)
    return path


def core_plan(usable: list[int], tp: int) -> list[list[int]]:
    """The cores each process is bound to: TP 1 gets the first two, TP 2 rank r gets core r; no binding
    (empty lists) when fewer than 2 cores are usable."""
    if len(usable) < 2:
        return [[] for _ in range(tp)]
    return [usable[:2]] if tp == 1 else [[usable[r]] for r in range(tp)]


# ---- one process: one rank (or the whole engine at TP 1) -----------------------------------------


class AllReduceTimer:
    """Wraps a ``TPGroup``'s ``all_reduce`` (an instance attribute shadows the method): time and calls."""

    def __init__(self, group) -> None:
        self.seconds, self.calls = 0.0, 0
        inner = group.all_reduce

        def timed(tensor):
            start = time.perf_counter()
            try:
                return inner(tensor)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        group.all_reduce = timed

    def read(self) -> tuple[float, int]:
        return self.seconds, self.calls


def make_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    # The same seed on every rank: the ranks must run the same requests.
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def measure(llm, timer: AllReduceTimer | None, args: dict) -> dict:
    """Prefill and decode figures of this process: seconds and tokens, and the all-reduce seconds inside them."""
    from splitserve.engine import SamplingParams

    vocab = llm.model_config.vocab_size
    reduce_time = (lambda: timer.read()) if timer is not None else (lambda: (0.0, 0))
    out: dict = {}

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = make_prompts(vocab, [args["prompt_len"]], seed=1)
    llm.generate(prompt, one)  # warm-up: first-call allocations and kernel choices
    best = None
    for _ in range(args["repeats"]):
        r0, c0 = reduce_time()
        start = time.perf_counter()
        llm.generate(prompt, one)
        seconds = time.perf_counter() - start
        r1, c1 = reduce_time()
        if best is None or seconds < best["seconds"]:
            best = {"seconds": seconds, "tokens": args["prompt_len"], "reduce_s": r1 - r0, "calls": c1 - c0}
    out["prefill"] = best

    sp = SamplingParams(max_tokens=args["new_tokens"], temperature=0.0, ignore_eos=True)
    for batch in args["decode_batches"]:
        prompts = make_prompts(vocab, [args["decode_prompt_len"]] * batch, seed=100 + batch)
        for p in prompts:
            llm.add_request(p, sp)
        seconds, tokens, steps, reduce_s, calls = 0.0, 0, 0, 0.0, 0
        while llm.has_unfinished_requests():
            running = llm.scheduler.running
            decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
            pure_decode = not llm.scheduler.waiting and len(decoding) == len(running) == batch
            r0, c0 = reduce_time()
            start = time.perf_counter()
            llm.step()
            elapsed = time.perf_counter() - start
            r1, c1 = reduce_time()
            if pure_decode:
                seconds += elapsed
                tokens += batch
                steps += 1
                reduce_s += r1 - r0
                calls += c1 - c0
        llm.check_integrity()
        out[f"decode_b{batch}"] = {
            "seconds": seconds,
            "tokens": tokens,
            "steps": steps,
            "reduce_s": reduce_s,
            "calls": calls,
        }
    return out


def _process_main(model_dir: str, rank: int, size: int, cores: list[int], port: int, args: dict, results) -> None:
    try:
        import torch

        if cores:
            os.sched_setaffinity(0, cores)
        threads = 2 if size == 1 else 1
        torch.set_num_threads(threads)
        from splitserve.engine import LLM

        group, timer = None, None
        if size > 1:
            from splitserve.engine.tp.distributed import TPGroup, connect_store, timeout_delta

            store = connect_store(HOST, port, SETUP_TIMEOUT_S)
            store.set(f"ready/{rank}", "1")
            store.wait([f"ready/{r}" for r in range(size)], timeout_delta(SETUP_TIMEOUT_S))
            group = TPGroup.create("gloo", store, "tp/", rank, size, HOST, GROUP_TIMEOUT_S, torch.device("cpu"))
            timer = AllReduceTimer(group)
        llm = LLM(
            model_dir,
            tp_group=group,
            tensor_parallel_size=size,
            tensor_parallel_rank=rank,
            dtype="float32",
            num_threads=threads,
            block_size=16,
            num_blocks=args["num_blocks"],
            enable_prefix_caching=False,
        )
        results.put((rank, True, measure(llm, timer, args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_config(model_dir: Path, size: int, cores: list[list[int]], args: dict, timeout_s: float) -> list[dict]:
    """Spawn ``size`` processes (one per rank) and return each rank's ``measure`` result, rank order."""
    import torch.multiprocessing as mp

    from splitserve.engine.tp.distributed import bind_store

    store, port = bind_store(HOST, 0, SETUP_TIMEOUT_S) if size > 1 else (None, 0)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_process_main, args=(str(model_dir), rank, size, cores[rank], port, args, results))
        for rank in range(size)
    ]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    raise RuntimeError(f"TP {size}: a rank exited without a result") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"TP {size}: ranks did not finish within {timeout_s:.0f}s") from None
                continue
            if not ok:
                raise RuntimeError(f"TP {size} rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    return [got[r] for r in range(size)]


# ---- figures -------------------------------------------------------------------------------------


def throughput(ranks: list[dict], key: str) -> float:
    """tok/s of one figure: the ranks run in lockstep, so the slowest rank's time is the figure's."""
    return ranks[0][key]["tokens"] / max(r[key]["seconds"] for r in ranks)


def reduce_share(ranks: list[dict], key: str) -> float:
    return sum(r[key]["reduce_s"] for r in ranks) / sum(r[key]["seconds"] for r in ranks)


def summarize(tp1: list[dict], tp2: list[dict], decode_batches: list[int]) -> dict:
    keys = ["prefill"] + [f"decode_b{b}" for b in decode_batches]
    names = {"prefill": "prefill_tok_s", **{f"decode_b{b}": f"decode_b{b}_tok_s" for b in decode_batches}}
    one = {names[k]: throughput(tp1, k) for k in keys}
    two = {names[k]: throughput(tp2, k) for k in keys}
    decode_calls = tp2[0][keys[-1]]["calls"] / tp2[0][keys[-1]]["steps"]
    return {
        "tp1": one,
        "tp2": two,
        "ratio": {name: two[name] / one[name] for name in one},
        "all_reduce_share": {
            **{k: reduce_share(tp2, k) for k in keys},
            "all_reduce_calls_per_step": decode_calls,
        },
    }


def print_table(presets: dict, decode_batches: list[int]) -> None:
    cols = ["prefill"] + [f"decode b{b}" for b in decode_batches]
    keys = ["prefill_tok_s"] + [f"decode_b{b}_tok_s" for b in decode_batches]
    shares = ["prefill"] + [f"decode_b{b}" for b in decode_batches]
    print(f"{'preset':<14} {'figure':<26}" + "".join(f"{c:>14}" for c in cols))
    for name, r in presets.items():
        rows = [
            ("TP1, 2 threads (tok/s)", [f"{r['tp1'][k]:.1f}" for k in keys]),
            ("TP2, 1 thread/rank (tok/s)", [f"{r['tp2'][k]:.1f}" for k in keys]),
            ("TP2/TP1", [f"{r['ratio'][k]:.2f}" for k in keys]),
            ("all-reduce share at TP2", [f"{100 * r['all_reduce_share'][k]:.1f}%" for k in shares]),
        ]
        for i, (label, cells) in enumerate(rows):
            print(f"{name if i == 0 else '':<14} {label:<26}" + "".join(f"{c:>14}" for c in cells))
        calls = r["all_reduce_share"]["all_reduce_calls_per_step"]
        print(f"{'':<14} all-reduces per decode step: {calls:.0f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=",".join(PRESETS), help="comma-separated make-model presets")
    ap.add_argument("--models-dir", type=Path, default=ROOT / "models", help="checkpoints live in DIR/PRESET")
    ap.add_argument("--prompt-len", type=int, default=512, help="prefill: one prompt of this many tokens")
    ap.add_argument("--decode-prompt-len", type=int, default=64, help="decode: each prompt's length")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode: output tokens per request")
    ap.add_argument("--decode-batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=3, help="prefill: best of this many")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for one configuration of one preset")
    ap.add_argument("--json", action="store_true", help="print one JSON object with every figure, last line")
    args = ap.parse_args()
    for field in ("prompt_len", "decode_prompt_len", "new_tokens", "repeats"):
        if getattr(args, field) < 1:
            ap.error(f"--{field.replace('_', '-')}: must be at least 1, got {getattr(args, field)}")
    if args.new_tokens < 2:
        ap.error("--new-tokens: must be at least 2 (the first output token comes from the prefill step)")
    presets = [p for p in args.presets.split(",") if p]
    decode_batches = [int(b) for b in args.decode_batches.split(",")]

    from splitserve.engine.hardware import print_header

    usable = sorted(os.sched_getaffinity(0))
    machine = print_header("float32", "TP1: 2; TP2: 1 per rank", "cpu", to_stderr=args.json)
    plan = {1: core_plan(usable, 1), 2: core_plan(usable, 2)}
    log(f"cores: TP1 {plan[1][0] or 'unbound'}, TP2 ranks {[c or 'unbound' for c in plan[2]]}")
    blocks_per_request = -(-(max(args.prompt_len, args.decode_prompt_len + args.new_tokens)) // 16)
    options = {
        "prompt_len": args.prompt_len,
        "decode_prompt_len": args.decode_prompt_len,
        "new_tokens": args.new_tokens,
        "decode_batches": decode_batches,
        "repeats": args.repeats,
        "num_blocks": blocks_per_request * max(decode_batches) + 8,
    }
    figures: dict = {}
    for preset in presets:
        model_dir = ensure_model(args.models_dir / preset, preset)
        log(f"{preset}: TP 1 ...")
        tp1 = run_config(model_dir, 1, plan[1], options, args.timeout)
        log(f"{preset}: TP 2 ...")
        tp2 = run_config(model_dir, 2, plan[2], options, args.timeout)
        figures[preset] = summarize(tp1, tp2, decode_batches)

    print_table(figures, decode_batches)
    if args.json:
        result = {
            "machine": machine,
            "cores": {"tp1": plan[1], "tp2": plan[2]},
            **{k: v for k, v in options.items() if k != "num_blocks"},
            "dtype": "float32",
            "presets": figures,
        }
        print(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
