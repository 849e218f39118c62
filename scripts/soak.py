#!/usr/bin/env python3
"""Soak test: minutes of mixed load with random cancels and one worker killed, then the books checked.

1. ``splitserve serve --config`` in its own process (embedded Ray on loopback): 1 prefill and 2
   decode workers; decode-0 carries a kill point and dies mid-decode once, part-way through (Ray
   restarts it, its streams migrate);
2. ``--concurrency`` clients send requests back to back for ``--duration-s``: random prompt and
   output lengths, greedy or seeded sampling, some sharing prefixes; ``--cancel-fraction`` of them
   are cancelled by the client at a random moment;
3. every second, the resident memory (RSS) of the router and of each worker process is sampled.

Checks (exit status 0 only when all pass):
- every request ended with its full output (``max_tokens`` tokens, finish reason length) or a clear
  error: a gRPC status with a message (CANCELLED only for the ones the client cancelled), never a
  deadline (a hang);
- greedy outputs of the same prompt agree (a migrated stream continues exactly);
- the worker was killed and came back;
- ``kv_blocks_in_use`` returns to 0 on every worker once the load stops;
- each process's RSS grows less than ``--max-rss-growth`` (10%) from the end of the warm-up
  (``--warmup-s`` after the process started serving) to the end.

Writes ``soak.json`` (verdict, counts, RSS per process, the kill and recovery times) to ``--out-dir``.
``make soak`` runs the default (5 minutes); tests/load/test_soak.py runs a short version in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.launch import use_loopback_ray  # noqa: E402

use_loopback_ray()  # before Ray is imported; every child inherits it

import grpc  # noqa: E402

from splitserve.client import Client, make_request  # noqa: E402
from splitserve.rpc.options import CLIENT_OPTIONS  # noqa: E402
from splitserve.make_model import make_model  # noqa: E402
from splitserve.sim_cluster import ServeProcess  # noqa: E402
from splitserve.v1 import splitserve_pb2_grpc as pb_grpc  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def log(message: str) -> None:
    print(f"soak: {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: a tiny random-weight one)")
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--warmup-s", type=float, default=30.0, help="RSS is compared from this long after ready")
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--max-input-len", type=int, default=200)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--kill-after-steps", type=int, default=3000,
                   help="decode-0 dies as its decode step number N+1 starts (once)")  # fmt: skip
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="results/soak")
    return p.parse_args(argv)


# ---- processes and their memory --------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def serving_processes(root: int) -> dict[int, str]:
    """pid -> name: the serve process (the router) and its descendant worker actor processes."""
    tree, found, stack = _children(), {root: "router"}, list(_children().get(root, []))
    while stack:
        pid = stack.pop()
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "WorkerActor" in cmdline:
            found[pid] = "worker"
        stack.extend(tree.get(pid, []))
    return found


def rss_bytes(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return None


class MemoryWatch:
    """RSS samples of every serving process, by pid (a restarted worker is a new pid)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.samples: dict[int, list[tuple[float, int]]] = {}
        self.names: dict[int, str] = {}

    def sample(self) -> None:
        now = time.monotonic()
        for pid, name in serving_processes(self.root).items():
            rss = rss_bytes(pid)
            if rss is not None:
                self.samples.setdefault(pid, []).append((now, rss))
                self.names.setdefault(pid, name)

    def report(self, warmup_s: float, max_growth: float) -> list[dict]:
        rows = []
        for pid, samples in self.samples.items():
            start = samples[0][0]
            after = [rss for t, rss in samples if t >= start + warmup_s]
            row = {"pid": pid, "name": self.names[pid], "samples": len(samples), "first_mb": samples[0][1] / 2**20,
                   "peak_mb": max(rss for _, rss in samples) / 2**20}  # fmt: skip
            # Checked only for processes that lived through a warm-up and then at least as long again.
            if len(after) >= 2 and samples[-1][0] - start >= 2 * warmup_s:
                row.update(baseline_mb=after[0] / 2**20, final_mb=after[-1] / 2**20,
                           growth=after[-1] / after[0] - 1, checked=True)  # fmt: skip
                row["ok"] = row["growth"] < max_growth
            else:
                row.update(checked=False, ok=True)
            rows.append(row)
        return rows


# ---- the load ----------------------------------------------------------------------------------------


async def one_request(stub, rng: random.Random, args, prompts: list[list[int]], books: dict) -> None:
    greedy = rng.random() < 0.5
    prompt_index = rng.randrange(len(prompts))
    prompt = prompts[prompt_index][: rng.randint(8, args.max_input_len)]
    max_tokens = rng.randint(1, args.max_output_len)
    cancel_after = rng.uniform(0.0, 1.5) if rng.random() < args.cancel_fraction else None
    sampling = dict(temperature=0.0) if greedy else dict(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 30))
    request = make_request(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, **sampling)
    tokens, finish = [], 0
    call = stub.Generate(request, timeout=args.request_timeout_s)
    canceller = None
    if cancel_after is not None:
        canceller = asyncio.get_running_loop().call_later(cancel_after, call.cancel)
    try:
        async for message in call:
            tokens.extend(message.token_ids)
            finish = message.finish_reason or finish
        if len(tokens) == max_tokens and finish == 2:  # FINISH_REASON_LENGTH
            books["outcomes"]["full"] += 1
            if greedy:
                books["greedy"].setdefault((prompt_index, len(prompt)), []).append(tokens)
        else:
            books["outcomes"]["short"] += 1
            books["problems"].append(f"{len(tokens)} of {max_tokens} tokens, finish reason {finish}")
    except asyncio.CancelledError:
        if cancel_after is None:
            raise
        books["outcomes"]["cancelled"] += 1
    except grpc.aio.AioRpcError as e:
        code = e.code()
        if code == grpc.StatusCode.CANCELLED and cancel_after is not None:
            books["outcomes"]["cancelled"] += 1
        elif code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED) and e.details():
            books["outcomes"][f"error:{code.name}"] += 1
            books["errors"].append(f"{code.name}: {e.details()}")
        else:  # a deadline is a hang; anything else is not a clear error
            books["outcomes"][f"bad:{code.name}"] += 1
            books["problems"].append(f"{code.name}: {e.details()}")
    finally:
        if canceller is not None:
            canceller.cancel()


async def load(address: str, args, watch: MemoryWatch) -> dict:
    rng = random.Random(args.seed)
    # Prompts share prefixes in pairs (a system prompt and a question), so the prefix cache works too.
    systems = [[rng.randrange(1, 1000) for _ in range(64)] for _ in range(4)]
    prompts = [systems[i % 4] + [rng.randrange(1, 1000) for _ in range(args.max_input_len)] for i in range(32)]
    books = {"outcomes": Counter(), "greedy": {}, "errors": [], "problems": []}
    deadline = time.monotonic() + args.duration_s
    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        stub = pb_grpc.SplitServeStub(channel)

        async def client(seed: int) -> None:
            own = random.Random(seed)
            while time.monotonic() < deadline:
                await one_request(stub, own, args, prompts, books)

        async def sampler() -> None:
            while time.monotonic() < deadline:
                watch.sample()
                await asyncio.sleep(1.0)

        await asyncio.gather(sampler(), *(client(args.seed * 1000 + i) for i in range(args.concurrency)))
    return books


def greedy_disagreements(greedy: dict) -> int:
    """Outputs of the same greedy prompt must be prefixes of one another."""
    bad = 0
    for outputs in greedy.values():
        longest = max(outputs, key=len)
        bad += sum(o != longest[: len(o)] for o in outputs)
    return bad


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.TemporaryDirectory(prefix="soak")
    model = args.model or str(make_model("tiny", Path(tmp.name) / "tiny", dtype="float32", seed=0))
    config = {"model": model, "dtype": "float32", "port": 0, "prefill": {"threads": 1},
              "decode": {"replicas": 2, "threads": 1},
              "faults": {"kill": [{"target": "decode-0", "at": "decode", "after": args.kill_after_steps}]}}  # fmt: skip
    log("starting serve")
    served = ServeProcess(config, Path(tmp.name) / "soak.yaml")
    verdict: dict = {"args": vars(args)}
    try:
        with Client(served.address) as client:
            first = {w.worker_id: w.incarnation for w in client.status().workers}
        watch = MemoryWatch(served.proc.pid)
        log(f"ready on {served.address} in {served.ready_s:.1f}s; {args.duration_s:.0f}s of load")
        started = time.monotonic()
        books = asyncio.run(load(served.address, args, watch))
        elapsed = time.monotonic() - started
        log("load over; waiting for every block to come back")
        blocks_zero_s = None
        wait_start = time.monotonic()
        while time.monotonic() - wait_start < 30:
            with Client(served.address) as client:
                workers = list(client.status().workers)
            if workers and all(w.kv_blocks_in_use == 0 for w in workers):
                blocks_zero_s = time.monotonic() - wait_start
                break
            time.sleep(0.5)
        watch.sample()
        now = {w.worker_id: w.incarnation for w in workers}
        memory = watch.report(args.warmup_s, args.max_rss_growth)
        outcomes = dict(books["outcomes"])
        total = sum(outcomes.values())
        checks = {
            "every request ended in full or with a clear error": not books["problems"],
            "greedy outputs agree": greedy_disagreements(books["greedy"]) == 0,
            "decode-0 was killed and came back": now.get("decode-0") not in (None, first["decode-0"]),
            "kv_blocks_in_use back to 0": blocks_zero_s is not None,
            f"RSS grew < {args.max_rss_growth:.0%} after warm-up": all(r["ok"] for r in memory),
            "some requests were served": outcomes.get("full", 0) > 0,
        }
        verdict.update(passed=all(checks.values()), checks=checks, seconds=elapsed, requests=total,
                       requests_per_s=total / elapsed, outcomes=outcomes, errors=books["errors"][:20],
                       problems=books["problems"][:20], blocks_zero_after_s=blocks_zero_s, memory=memory,
                       greedy_groups=len(books["greedy"]), workers_final=[
                           {"worker_id": w.worker_id, "kv_blocks_in_use": w.kv_blocks_in_use,
                            "kv_blocks_cached": w.kv_blocks_cached, "incarnation": w.incarnation} for w in workers])  # fmt: skip
    finally:
        verdict["serve_exit"] = served.stop()
        tmp.cleanup()
    (out / "soak.json").write_text(json.dumps(verdict, indent=1, default=str))
    log(f"{verdict.get('requests', 0)} requests: {verdict.get('outcomes')}")
    for row in verdict.get("memory", []):
        growth = f"{row['growth']:+.1%}" if row["checked"] else "not checked (short-lived)"
        log(f"  {row['name']} pid {row['pid']}: first {row['first_mb']:.0f} MB, peak {row['peak_mb']:.0f} MB, {growth}")
    for name, ok in verdict.get("checks", {}).items():
        log(f"  {'PASS' if ok else 'FAIL'} {name}")
    print(json.dumps({k: verdict.get(k) for k in ("passed", "requests", "requests_per_s", "outcomes")}))
    return 0 if verdict.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
