#!/usr/bin/env python3
"""Soak test: minutes of mixed load with random cancels and one worker killed, then the books checked.

1. ``splitserve serve --config`` in its own process (embedded Ray on loopback): 1 prefill and 2
   decode workers; decode-0 carries a kill point and dies mid-decode once, part-way through (Ray
   restarts it, its streams migrate);
2. ``--concurrency`` clients send requests back to back for ``--duration-s``: random prompt and
   output lengths, greedy or seeded sampling, some sharing prefixes; ``--cancel-fraction`` of them
   are cancelled by the client at a random moment;
3. every second, the resident memory (RSS) of the router and of each worker process is sampled.

Every request must end in one of three ways (anything else fails the soak and is printed):
- finished: its full output (``max_tokens`` tokens, finish reason length; or its own EOS/stop where
  it let one end it);
- cancelled by its client (CANCELLED, only for the ones the client did cancel);
- failed for the kill: UNAVAILABLE with the router's "gave up after N migrations/retries" naming the
  killed worker, for a request in flight around the kill (past ``--max-migrations``; with the
  default of 3 and one kill, none should).
RESOURCE_EXHAUSTED is not one of them: the load is closed (each client waits for its request to end),
so at most ``--concurrency`` requests are in the router, which must not exceed its ``max_queue``.

Half the requests are greedy, drawn from ``--greedy-cases`` fixed (prompt, max_tokens) cases, so each
case is sent many times: every full greedy result is compared with the first full result of its case
and with the offline engine (``engine.LLM``, fp32, greedy, same max_tokens, ignore_eos), moved ones
too (greedy recompute is exact in fp32); any mismatch fails, and there must be comparisons.

Also checked: the worker was killed and came back; ``kv_blocks_in_use`` returns to 0 on every worker
once the load stops; each process's RSS grows less than ``--max-rss-growth`` (10%) from the end of the
warm-up (``--warmup-s`` after the process started serving) to the end.

Writes ``soak.json`` (verdict, counts, RSS per process, the kill and recovery times) to ``--out-dir``.
``make soak`` runs the default (5 minutes); tests/load/test_soak.py runs a short version in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from splitserve.deploy.embedded_ray import use_loopback_ray  # noqa: E402

use_loopback_ray()  # before Ray is imported; every child inherits it

import grpc  # noqa: E402

from splitserve.client.grpc_client import Client, make_request  # noqa: E402
from splitserve.common.arith import ceil_div  # noqa: E402
from splitserve.deploy.config import RouterSettings  # noqa: E402
from splitserve.deploy.sim_cluster import ServeProcess  # noqa: E402
from splitserve.rpc.options import CLIENT_OPTIONS  # noqa: E402
from splitserve.tools.make_model import make_model  # noqa: E402
from splitserve.v1 import splitserve_pb2 as pb  # noqa: E402
from splitserve.v1 import splitserve_pb2_grpc as pb_grpc  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
VICTIM = "decode-0"  # the worker the soak kills


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
    p.add_argument(
        "--kill-after-steps", type=int, default=3000, help="decode-0 dies as its decode step number N+1 starts (once)"
    )
    p.add_argument(
        "--max-migrations",
        type=int,
        default=RouterSettings.max_migrations,
        help="the router's max_migrations: a request moved more often ends UNAVAILABLE",
    )
    p.add_argument("--greedy-cases", type=int, default=16, help="distinct greedy (prompt, max_tokens) cases")
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="results/soak")
    args = p.parse_args(argv)
    if not 1 <= args.concurrency <= RouterSettings.max_queue:
        p.error(
            f"--concurrency: must be 1..{RouterSettings.max_queue} (the router's max_queue), got {args.concurrency}"
        )
    if args.greedy_cases < 1:
        p.error(f"--greedy-cases: must be >= 1, got {args.greedy_cases}")
    return args


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
            row = {
                "pid": pid,
                "name": self.names[pid],
                "samples": len(samples),
                "first_mb": samples[0][1] / 2**20,
                "peak_mb": max(rss for _, rss in samples) / 2**20,
            }
            # Checked only for processes that lived through a warm-up and then at least as long again.
            if len(after) >= 2 and samples[-1][0] - start >= 2 * warmup_s:
                row.update(
                    baseline_mb=after[0] / 2**20,
                    final_mb=after[-1] / 2**20,
                    growth=after[-1] / after[0] - 1,
                    checked=True,
                )
                row["ok"] = row["growth"] < max_growth
            else:
                row.update(checked=False, ok=True)
            rows.append(row)
        return rows


# ---- what happened to each request ------------------------------------------------------------------

FINISH_STOP, FINISH_LENGTH = 1, 2  # pb.FinishReason
OUTCOMES = ("finished", "cancelled_by_client", "failed_by_injected_cause")
# The router's status for a request whose worker was lost once too often (router/generate.py): the loss
# (naming the worker), then "; gave up after N migrations" (tokens were out) or "N retries" (none were).
GAVE_UP = re.compile(r"; gave up after \d+ (migrations|retries)$")
NOTICE_SLACK_S = 1.0  # the router's status may lag the failure of a call by up to its poll interval


@dataclass
class RequestRecord:
    """One request as its client saw it (times on this process's monotonic clock)."""

    max_tokens: int
    ignore_eos: bool
    case: int | None  # its greedy case (an index into the soak's cases); None: sampled
    cancel_after_s: float | None  # when the client meant to cancel it; None: never
    started: float
    ended: float = 0.0
    tokens: list[int] = field(default_factory=list)
    finish: int = 0  # the final message's finish reason; 0: none came
    reprefills: int = 0  # from the final message's timing: times it moved or was re-prefilled
    cancel_fired: bool = False  # the client did cancel it (before it ended on its own)
    status: str = "OK"  # the gRPC status code's name the call ended with
    details: str = ""

    @property
    def full(self) -> bool:
        return self.status == "OK" and self.finish == FINISH_LENGTH and len(self.tokens) == self.max_tokens

    def describe(self) -> str:
        cancel = (
            f", cancel at {self.cancel_after_s:.2f}s {'fired' if self.cancel_fired else 'not fired'}"
            if self.cancel_after_s is not None
            else ""
        )
        return (
            f"{self.status} {self.details!r}: {len(self.tokens)} of {self.max_tokens} tokens, finish reason "
            f"{self.finish}, {self.reprefills} re-prefills, {self.ended - self.started:.2f}s{cancel}"
        )


@dataclass
class KillWindow:
    """When the soak saw its victim die, from status polls (monotonic): ``alive_at`` is when the last poll
    that showed it healthy in its first incarnation was sent, ``gone_at`` when the first that did not was
    answered, ``back_at`` when one first showed a new incarnation healthy. The router marks a worker lost
    before it fails a request for it, so a request the kill ended was sent before ``gone_at`` and ended
    after ``alive_at`` (less NOTICE_SLACK_S)."""

    victim: str
    first_incarnation: str
    alive_at: float
    gone_at: float | None = None
    back_at: float | None = None

    def seen(self, workers, sent: float, answered: float) -> None:
        w = next((w for w in workers if w.worker_id == self.victim), None)
        first_alive = w is not None and w.healthy and w.incarnation == self.first_incarnation
        if self.gone_at is None and first_alive:
            self.alive_at = sent
        elif self.gone_at is None:
            self.gone_at = answered
        if (
            self.gone_at is not None
            and self.back_at is None
            and w is not None
            and w.healthy
            and w.incarnation != self.first_incarnation
        ):
            self.back_at = answered

    def spans(self, record: RequestRecord) -> bool:
        return (
            self.gone_at is not None and record.started < self.gone_at and record.ended > self.alive_at - NOTICE_SLACK_S
        )


def classify(record: RequestRecord, kill: KillWindow) -> str | None:
    """One of OUTCOMES, or None: an outcome the soak cannot explain (it fails the soak).

    - finished: its full ``max_tokens`` (finish reason length), or its own EOS/stop when it let one end it;
    - cancelled_by_client: the client cancelled it and the call ended CANCELLED;
    - failed_by_injected_cause: UNAVAILABLE because the killed worker was lost once too often for it (the
      router's "gave up after" message naming the victim), for a request in flight around the kill.
    Anything else (RESOURCE_EXHAUSTED, a deadline, a short output, CANCELLED nobody asked for) is None."""
    if record.status == "OK":
        own_stop = (
            record.finish == FINISH_STOP and not record.ignore_eos and 0 < len(record.tokens) <= record.max_tokens
        )
        return "finished" if record.full or own_stop else None
    if record.status == "CANCELLED":
        return "cancelled_by_client" if record.cancel_fired else None
    names_victim = re.search(rf"(?<![\w-]){re.escape(kill.victim)}(?![\w-])", record.details) is not None
    if record.status == "UNAVAILABLE" and GAVE_UP.search(record.details) and names_victim and kill.spans(record):
        return "failed_by_injected_cause"
    return None


def compare_greedy(records: list[RequestRecord], reference: list[list[int]]) -> dict:
    """Every full greedy result against the first full result of its case and against the offline
    engine's output for that case; counts the comparisons made and lists the mismatches."""
    firsts: dict[int, list[int]] = {}
    with_first = with_engine = migrated = 0
    mismatches: list[str] = []
    for r in sorted((r for r in records if r.case is not None and r.full), key=lambda r: r.started):
        first = firsts.setdefault(r.case, r.tokens)
        if first is not r.tokens:
            with_first += 1
            if r.tokens != first:
                mismatches.append(f"case {r.case}: a repeat differs from its first result ({r.reprefills} re-prefills)")
        with_engine += 1
        migrated += r.reprefills > 0
        if r.tokens != reference[r.case]:
            mismatches.append(f"case {r.case}: differs from the offline engine ({r.reprefills} re-prefills)")
    return {
        "comparisons": with_first + with_engine,
        "with_first": with_first,
        "with_engine": with_engine,
        "cases": len(firsts),
        "moved_compared": migrated,
        "mismatches": mismatches,
    }


def offline_reference(model: str, cases: list[tuple[list[int], int]]) -> list[list[int]]:
    """The offline engine's greedy outputs for the cases, with the soak's max_tokens and ignore_eos."""
    from splitserve.engine import LLM, SamplingParams

    blocks = sum(ceil_div(len(prompt) + max_tokens + 1, 16) for prompt, max_tokens in cases) + 16  # 16-token blocks
    llm = LLM(model, dtype="float32", num_blocks=blocks, num_threads=1)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True) for _, max_tokens in cases]
    return [o.token_ids for o in llm.generate([prompt for prompt, _ in cases], params)]


# ---- the load ----------------------------------------------------------------------------------------


def make_prompts(rng: random.Random, args) -> list[list[int]]:
    """Prompts that share prefixes in fours (a system prompt and a question), so the prefix cache works too."""
    systems = [[rng.randrange(1, 1000) for _ in range(64)] for _ in range(4)]
    return [systems[i % 4] + [rng.randrange(1, 1000) for _ in range(args.max_input_len)] for i in range(32)]


def make_cases(rng: random.Random, prompts: list[list[int]], args) -> list[tuple[list[int], int]]:
    """The greedy requests: ``--greedy-cases`` (prompt, max_tokens) pairs, each sent again and again."""
    return [
        (
            prompts[rng.randrange(len(prompts))][: rng.randint(8, args.max_input_len)],
            rng.randint(1, args.max_output_len),
        )
        for _ in range(args.greedy_cases)
    ]


async def one_request(stub, rng: random.Random, args, prompts, cases) -> RequestRecord:
    greedy = rng.random() < 0.5
    if greedy:
        case = rng.randrange(len(cases))
        prompt, max_tokens = cases[case]
        sampling = dict(temperature=0.0)
    else:
        case, max_tokens = None, rng.randint(1, args.max_output_len)
        prompt = prompts[rng.randrange(len(prompts))][: rng.randint(8, args.max_input_len)]
        sampling = dict(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 30))
    cancel_after = rng.uniform(0.0, 1.5) if rng.random() < args.cancel_fraction else None
    record = RequestRecord(max_tokens, True, case, cancel_after, time.monotonic())
    call = stub.Generate(
        make_request(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, **sampling),
        timeout=args.request_timeout_s,
    )

    def cancel() -> None:
        record.cancel_fired = True
        call.cancel()

    canceller = asyncio.get_running_loop().call_later(cancel_after, cancel) if cancel_after is not None else None
    try:
        async for message in call:
            record.tokens.extend(message.token_ids)
            if message.finish_reason:
                record.finish, record.reprefills = message.finish_reason, message.timing.reprefills
    except asyncio.CancelledError:  # grpc.aio's way to end a call this side cancelled
        if not record.cancel_fired:
            raise
        record.status = "CANCELLED"
    except grpc.aio.AioRpcError as e:
        record.status, record.details = e.code().name, e.details() or ""
    finally:
        record.ended = time.monotonic()
        if canceller is not None:
            canceller.cancel()
    return record


async def load(address: str, args, watch: MemoryWatch, kill: KillWindow, prompts, cases) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    deadline = time.monotonic() + args.duration_s
    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        stub = pb_grpc.SplitServeStub(channel)

        async def client(seed: int) -> None:
            own = random.Random(seed)
            while time.monotonic() < deadline:
                records.append(await one_request(stub, own, args, prompts, cases))

        async def sampler() -> None:
            while time.monotonic() < deadline:
                watch.sample()
                await asyncio.sleep(1.0)

        async def kill_watch() -> None:  # often until the victim is back, then once a second
            while time.monotonic() < deadline:
                sent = time.monotonic()
                try:
                    status = await stub.GetStatus(pb.GetStatusRequest(), timeout=5)
                    kill.seen(status.workers, sent, time.monotonic())
                except grpc.aio.AioRpcError as e:
                    log(f"status poll failed: {e.code().name}")
                await asyncio.sleep(0.2 if kill.back_at is None else 1.0)

        await asyncio.gather(sampler(), kill_watch(), *(client(args.seed * 1000 + i) for i in range(args.concurrency)))
    return records


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.TemporaryDirectory(prefix="soak")
    model = args.model or str(make_model("tiny", Path(tmp.name) / "tiny", dtype="float32", seed=0))
    rng = random.Random(args.seed)
    prompts = make_prompts(rng, args)
    cases = make_cases(rng, prompts, args)
    config = {
        "model": model,
        "dtype": "float32",
        "port": 0,
        "prefill": {"threads": 1},
        "decode": {"replicas": 2, "threads": 1},
        "router": {"max_migrations": args.max_migrations},
        "faults": {"kill": [{"target": VICTIM, "at": "decode", "after": args.kill_after_steps}]},
    }
    log("starting serve")
    served = ServeProcess(config, Path(tmp.name) / "soak.yaml")
    verdict: dict = {"args": vars(args)}
    try:
        try:
            with Client(served.address) as client:
                first = {w.worker_id: w.incarnation for w in client.status().workers}
            kill = KillWindow(VICTIM, first[VICTIM], alive_at=time.monotonic())
            watch = MemoryWatch(served.proc.pid)
            log(f"ready on {served.address} in {served.ready_s:.1f}s; {args.duration_s:.0f}s of load")
            started = time.monotonic()
            records = asyncio.run(load(served.address, args, watch, kill, prompts, cases))
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
        finally:
            verdict["serve_exit"] = served.stop()
        log("the offline engine's greedy outputs, for the comparisons")  # with serve stopped: no contention
        greedy = compare_greedy(records, offline_reference(model, cases))
    finally:
        tmp.cleanup()
    memory = watch.report(args.warmup_s, args.max_rss_growth)
    classes = [(r, classify(r, kill)) for r in records]
    outcomes = {name: sum(c == name for _, c in classes) for name in OUTCOMES}
    unclassified = [r.describe() for r, c in classes if c is None]
    outcomes["unclassified"] = len(unclassified)
    since = lambda t: None if t is None else t - started  # noqa: E731
    checks = {
        "every request finished, was cancelled by its client or failed for the kill": not unclassified,
        "greedy results equal their case's first result and the offline engine": greedy["comparisons"] > 0
        and not greedy["mismatches"],
        f"{VICTIM} was killed and came back": now.get(VICTIM) not in (None, first[VICTIM]) and kill.back_at is not None,
        "kv_blocks_in_use back to 0": blocks_zero_s is not None,
        f"RSS grew < {args.max_rss_growth:.0%} after warm-up": all(r["ok"] for r in memory),
        "some requests were served": outcomes["finished"] > 0,
    }
    verdict.update(
        passed=all(checks.values()),
        checks=checks,
        seconds=elapsed,
        requests=len(records),
        requests_per_s=len(records) / elapsed,
        outcomes=outcomes,
        unclassified=unclassified,
        injected=[r.describe() for r, c in classes if c == "failed_by_injected_cause"][:20],
        moved=sum(r.reprefills > 0 for r in records),
        greedy=greedy,
        kill={
            "victim": VICTIM,
            "seen_alive_s": since(kill.alive_at),
            "seen_gone_s": since(kill.gone_at),
            "back_after_kill_s": None if kill.back_at is None or kill.gone_at is None else kill.back_at - kill.gone_at,
        },
        blocks_zero_after_s=blocks_zero_s,
        memory=memory,
        workers_final=[
            {
                "worker_id": w.worker_id,
                "kv_blocks_in_use": w.kv_blocks_in_use,
                "kv_blocks_cached": w.kv_blocks_cached,
                "incarnation": w.incarnation,
            }
            for w in workers
        ],
    )
    (out / "soak.json").write_text(json.dumps(verdict, indent=1, default=str))
    log(f"{len(records)} requests in {elapsed:.1f}s: {outcomes}; {verdict['moved']} moved or re-prefilled")
    for line in unclassified:
        log(f"  unclassified: {line}")
    for line in verdict["injected"]:
        log(f"  failed for the kill: {line}")
    log(
        f"  greedy: {greedy['comparisons']} comparisons ({greedy['with_first']} with the case's first result, "
        f"{greedy['with_engine']} with the offline engine) over {greedy['cases']} cases, "
        f"{greedy['moved_compared']} of the results moved; {len(greedy['mismatches'])} mismatches"
    )
    for line in greedy["mismatches"][:20]:
        log(f"  mismatch: {line}")
    k = verdict["kill"]
    if k["seen_gone_s"] is not None:
        back = "not back" if k["back_after_kill_s"] is None else f"back {k['back_after_kill_s']:.1f}s later"
        log(
            f"  {VICTIM} last seen alive {k['seen_alive_s']:.1f}s and first seen gone {k['seen_gone_s']:.1f}s "
            f"into the load; {back}"
        )
    for row in memory:
        growth = f"{row['growth']:+.1%}" if row["checked"] else "not checked (short-lived)"
        log(f"  {row['name']} pid {row['pid']}: first {row['first_mb']:.0f} MB, peak {row['peak_mb']:.0f} MB, {growth}")
    for name, ok in checks.items():
        log(f"  {'PASS' if ok else 'FAIL'} {name}")
    print(
        json.dumps(
            {k: verdict.get(k) for k in ("passed", "requests", "requests_per_s", "outcomes")}
            | {"greedy_comparisons": greedy["comparisons"], "greedy_mismatches": len(greedy["mismatches"])}
        )
    )
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
