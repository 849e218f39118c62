#!/usr/bin/env python3
"""KV-transfer benchmark: splitserve's transfer path against a raw send of the same bytes.

Two spawned processes, a sender and a receiver, each with a paged KV cache of the qwen2.5-0.5b preset's
shapes (24 layers, 2 KV heads, head_dim 64, bf16, blocks of 16 tokens: 12 KiB per token). For 128, 1k,
8k and 32k tokens it moves the KV from randomly scattered blocks of the sender's cache to randomly
scattered blocks of the receiver's (gather, gRPC descriptors, gloo payload, scatter), verifies a
checksum of every moved block on both sides, and times a raw gloo send of one contiguous tensor of
the same bytes between the same two processes. Times run from the sender's start to the moment the
receiver holds the data (both processes read the same monotonic clock); best of --repeats.

The layer-group part writes a KV-heavy checkpoint (full multi-head attention), prefills a prompt in
the sender and measures when its KV is complete on the receiver: sent after prefill, or streamed by
layer groups while later layers compute.

    python scripts/bench_transfer.py [--json] [--sizes 128,1024,8192,32768] [--repeats 3]   # make bench-transfer
With --json the last line of stdout is one JSON object; its "results" list holds, per size, tokens,
bytes, seconds, gbps, raw_gbps and ratio.

``--tp P:D`` adds a transfer between tensor-parallel workers: P sender ranks and D receiver ranks, each a
process holding its KV heads of the same preset (docs/kv_transfer.md: one transfer per receiving rank,
each sending rank sending the heads it shares with it, all at once). Its time runs from the first
sender's start to the last receiver's completion, is checked head by head against the senders, and is
reported against the 1:1 transfer of the same tokens (the same logical KV).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

# A benchmark, not part of the installed package: it drives the engine, the checkpoint writer and the
# KV transfer together, which no layer of the package may do (docs/architecture.md).
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # spawned children inherit it

from splitserve.common.arith import ceil_div  # noqa: E402 (after the path line above)

PRESET_SPEC = {"num_layers": 24, "num_kv_heads": 2, "head_dim": 64, "block_size": 16}
# A KV-heavy shape: full multi-head attention, 32 KiB of KV per token.
KV_HEAVY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- the two processes ---------------------------------------------------------------------------


def _process(
    conn, role: str, spec: dict | None, model_dir: str | None, config, threads: int = 1, tp: tuple[int, int] = (1, 0)
) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from splitserve.engine.kv_cache.cache import KVCache, KVCacheSpec
    from splitserve.engine.tp.layout import HeadRange, kv_head_range
    from splitserve.kv_transfer.comm import connect_store, open_communicator
    from splitserve.kv_transfer.descriptor import LayoutFingerprint
    from splitserve.kv_transfer.receiver import KVReceiver
    from splitserve.kv_transfer.sender import KVSender, PeerAddress
    from splitserve.kv_transfer.service import GrpcConnection, serve

    torch.set_num_threads(threads)
    device = torch.device("cpu")
    heads = kv_head_range(spec["num_kv_heads"], *tp)
    llm = None
    if model_dir is not None:
        from splitserve.engine import LLM

        llm = LLM(
            model_dir,
            dtype="bfloat16",
            num_blocks=spec["num_blocks"],
            block_size=spec["block_size"],
            enable_prefix_caching=False,
            num_threads=threads,
        )
        cache = llm.kv_cache
    else:
        cache = KVCache(KVCacheSpec(dtype=torch.bfloat16, **{**spec, "num_kv_heads": heads.count}), device)
    if role == "sender":
        cache.tensor.copy_(torch.randn(cache.tensor.shape, dtype=torch.float32).to(torch.bfloat16))
    fp = LayoutFingerprint(
        "bench",
        "bfloat16",
        spec["block_size"],
        spec["num_layers"],
        spec["num_kv_heads"],
        spec["head_dim"],
        "bench-weights",
        tp_size=tp[0],
        tp_rank=tp[1],
        heads_start=heads.start,
        heads_stop=heads.stop,
    )
    name = f"bench-{role[0]}{tp[1]}"
    state: dict = {}

    def digest(blocks: list[int]) -> str:
        data = cache.tensor[:, torch.tensor(blocks)].contiguous().view(torch.uint8).numpy()
        return hashlib.sha1(memoryview(data)).hexdigest()

    def head_digests(blocks: list[int]) -> dict[int, str]:
        """Per head of this rank (in the model's numbering), a checksum of those blocks."""
        ids = torch.tensor(blocks)
        return {
            heads.start + h: hashlib.sha1(
                memoryview(cache.tensor[:, ids, :, h].contiguous().view(torch.uint8).numpy())
            ).hexdigest()
            for h in range(heads.count)
        }

    if role == "receiver":
        endpoint = KVReceiver(cache, fp, name, config=config)
        server, port = serve(endpoint)
        info = {"peer": (name, endpoint.incarnation, f"127.0.0.1:{port}"), "store_port": endpoint.store_port}
    else:
        endpoint = KVSender(cache, fp, name, connect=lambda peer: GrpcConnection(peer.control), config=config)
        info = {}

    def raw_setup(store_port: int | None = None) -> None:
        def build():
            if role == "receiver":
                store = endpoint.store
            else:
                store = state["raw_store"] = connect_store("127.0.0.1", store_port, 30)
            state["raw"] = open_communicator(
                "gloo", store, "raw/", 1 if role == "receiver" else 0, "127.0.0.1", 60, device
            )

        state["raw_thread"] = threading.Thread(target=build)
        state["raw_thread"].start()

    def raw(nbytes: int) -> float:
        state["raw_thread"].join()
        buf = state.get("raw_buf")
        if buf is None or buf.numel() < nbytes:
            buf = state["raw_buf"] = torch.ones(nbytes, dtype=torch.uint8)
        if role == "sender":
            start = time.monotonic()
            state["raw"].isend(buf[:nbytes]).wait(60)
            return start
        state["raw"].irecv(buf[:nbytes]).wait(60)
        return time.monotonic()

    def copy_cost(blocks: list[int]) -> float:
        """Seconds to gather (sender) or scatter (receiver) these blocks alone, best of 3."""
        ids = torch.tensor(blocks)
        buf = state.get("copy_buf")
        need = len(blocks) * cache.tensor[0, 0].numel() * cache.spec.num_layers
        if buf is None or buf.numel() < need:
            buf = state["copy_buf"] = torch.zeros(need, dtype=cache.tensor.dtype)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            if role == "sender":
                cache.gather_blocks(ids, out=buf)
            else:
                cache.scatter_blocks(ids, buf[:need])
            times.append(time.perf_counter() - start)
        return min(times)

    def expect(tid: str, blocks: list[int]) -> None:
        state[tid] = endpoint.expect(tid, blocks)

    def received(tid: str, count: int) -> dict:
        handle = state.pop(tid)
        handle.wait(120)
        endpoint.release(tid)
        return {
            "state": handle.state.value,
            "error": handle.error,
            "at": handle.finished_at,
            "digest": digest(list(handle.block_ids[:count])),
        }

    def send(tid: str, peer, blocks: list[int], tokens: int) -> dict:
        start = time.monotonic()
        handle = endpoint.start(tid, PeerAddress(*peer), blocks, tokens)
        endpoint.finish(handle)
        handle.wait(120)
        endpoint.release(tid)
        return {"state": handle.state.value, "error": handle.error, "start": start, "digest": digest(blocks)}

    def received_heads(tid: str, count: int) -> dict:
        handle = state.pop(tid)
        handle.wait(120)
        endpoint.release(tid)
        digests = head_digests(list(handle.block_ids[:count]))
        return {"state": handle.state.value, "error": handle.error, "at": handle.finished_at, "digests": digests}

    def send_parts(parts: list, blocks: list[int], tokens: int) -> dict:
        """Start every part (transfer id, peer, heads) this rank sends at once, then wait for all."""
        start = time.monotonic()
        handles = []
        for tid, peer, (h0, h1) in parts:
            handles.append(endpoint.start(tid, PeerAddress(*peer), blocks, tokens, heads=HeadRange(h0, h1)))
            endpoint.finish(handles[-1])
        for handle in handles:
            handle.wait(120)
            endpoint.release(handle.transfer_id)
        errors = [h.error for h in handles if h.state.value != "done"]
        return {"ok": not errors, "error": "; ".join(errors), "start": start, "digests": head_digests(blocks)}

    def prefill(tid: str, peer, blocks: list[int], tokens: int, mode: str) -> dict:
        """Prefill a prompt into ``blocks``; mode none | after (send when done) | streamed (by layer group)."""
        prompt = [random.randrange(1000) for _ in range(tokens)]
        start = time.monotonic()
        handle = endpoint.start(tid, PeerAddress(*peer), blocks, tokens) if mode != "none" else None
        hook = (lambda n: endpoint.layers_ready(handle, n)) if mode == "streamed" else None
        llm.runner.score(prompt, blocks, all_positions=False, on_layer_done=hook)
        prefilled = time.monotonic()
        if handle is not None:
            endpoint.finish(handle)
            handle.wait(120)
            endpoint.release(tid)
        return {"start": start, "prefilled": prefilled, "state": handle.state.value if handle else "done"}

    commands = {
        "info": lambda: info,
        "raw_setup": raw_setup,
        "raw": raw,
        "expect": expect,
        "received": received,
        "send": send,
        "received_heads": received_heads,
        "send_parts": send_parts,
        "prefill": prefill,
        "copy_cost": copy_cost,
    }
    while True:
        command, args = conn.recv()
        if command == "exit":
            conn.send(None)
            os._exit(0)
        conn.send(commands[command](*args))


class _Proc:
    threads = 1

    def __init__(self, role: str, spec: dict, model_dir: str | None, config, tp: tuple[int, int] = (1, 0)) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_process, args=(child, role, spec, model_dir, config, self.threads, tp), daemon=True
        )
        self.process.start()

    def post(self, command: str, *args) -> None:
        self.conn.send((command, args))

    def result(self, timeout: float = 300):
        if not self.conn.poll(timeout):
            raise TimeoutError("benchmark process did not answer")
        return self.conn.recv()

    def call(self, command: str, *args):
        self.post(command, *args)
        return self.result()

    def stop(self) -> None:
        try:
            self.call("exit")
        except Exception:
            pass
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()


# ---- the measurements ----------------------------------------------------------------------------


def measure_sizes(sizes: list[int], repeats: int, config) -> list[dict]:
    bs = PRESET_SPEC["block_size"]
    num_blocks = 2 * ceil_div(max(sizes), bs) + 64
    spec = {**PRESET_SPEC, "num_blocks": num_blocks}
    d, p = _Proc("receiver", spec, None, config), _Proc("sender", spec, None, config)
    try:
        info = d.call("info")
        p.call("info")
        d.post("raw_setup")
        p.post("raw_setup", info["store_port"])
        d.result(), p.result()
        rng = random.Random(0)
        results = []
        per_token = PRESET_SPEC["num_layers"] * 2 * PRESET_SPEC["num_kv_heads"] * PRESET_SPEC["head_dim"] * 2
        for tokens in sizes:
            n = ceil_div(tokens, bs)
            nbytes = n * bs * per_token
            best, best_raw = float("inf"), float("inf")
            for r in range(repeats + 1):  # the first round warms up both paths
                tid = f"bench-{tokens}-{r}"
                src, dst = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
                d.call("expect", tid, dst)
                sent = p.call("send", tid, info["peer"], src, tokens)
                got = d.call("received", tid, n)
                if sent["state"] != "done" or got["state"] != "done":
                    raise RuntimeError(f"transfer failed: {sent['error'] or got['error']}")
                if sent["digest"] != got["digest"]:
                    raise RuntimeError(f"checksum mismatch after moving {tokens} tokens")
                for _ in range(2):  # the raw send is the noisier of the two: give it two tries a round
                    d.post("raw", nbytes)
                    p.post("raw", nbytes)
                    t_end, t_start = d.result(), p.result()
                    if r:
                        best_raw = min(best_raw, t_end - t_start)
                if r:
                    best = min(best, got["at"] - sent["start"])
            gather, scatter = p.call("copy_cost", src), d.call("copy_cost", dst)
            row = {
                "tokens": tokens,
                "bytes": nbytes,
                "seconds": best,
                "gbps": nbytes / best / 1e9,
                "raw_seconds": best_raw,
                "raw_gbps": nbytes / best_raw / 1e9,
                "ratio": best_raw / best,
                "gather_seconds": gather,
                "scatter_seconds": scatter,
                "checksum_verified": True,
            }
            log(
                f"  {tokens:>6} tokens {nbytes / 2**20:8.1f} MiB: {row['gbps']:.2f} GB/s, raw {row['raw_gbps']:.2f} "
                f"GB/s, ratio {row['ratio']:.2f} (gather alone {nbytes / gather / 1e9:.1f} GB/s, scatter alone "
                f"{nbytes / scatter / 1e9:.1f} GB/s)"
            )
            results.append(row)
        return results
    finally:
        p.stop()
        d.stop()


def measure_tp(sizes: list[int], repeats: int, config, sender_tp: int, receiver_tp: int, one_to_one: list[dict]):
    """The same transfers between a TP-``sender_tp`` and a TP-``receiver_tp`` worker, one process per rank."""
    from splitserve.engine.tp.layout import transfer_pairs
    from splitserve.kv_transfer.tp.parts import rank_transfer_id, sends_for

    bs, heads = PRESET_SPEC["block_size"], PRESET_SPEC["num_kv_heads"]
    num_blocks = 2 * ceil_div(max(sizes), bs) + 64
    spec = {**PRESET_SPEC, "num_blocks": num_blocks}
    receivers = [_Proc("receiver", spec, None, config, (receiver_tp, r)) for r in range(receiver_tp)]
    senders = [_Proc("sender", spec, None, config, (sender_tp, s)) for s in range(sender_tp)]
    try:
        peers = [d.call("info")["peer"] for d in receivers]
        for p in senders:
            p.call("info")
        rng = random.Random(1)
        results = []
        baseline = {row["tokens"]: row["seconds"] for row in one_to_one}
        pairs = transfer_pairs(heads, sender_tp, receiver_tp)
        for tokens in sizes:
            n = ceil_div(tokens, bs)
            best = float("inf")
            for r in range(repeats + 1):
                tid = f"tp-{tokens}-{r}"
                src, dst = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
                for rank, d in enumerate(receivers):
                    d.call("expect", rank_transfer_id(tid, rank, receiver_tp), dst)
                for s, p in enumerate(senders):
                    parts = [
                        (
                            rank_transfer_id(tid, q.receiver_rank, receiver_tp),
                            peers[q.receiver_rank],
                            (q.heads.start, q.heads.stop),
                        )
                        for q in sends_for(heads, sender_tp, s, receiver_tp)
                    ]
                    p.post("send_parts", parts, src, tokens)
                sent = [p.result() for p in senders]
                got = [
                    d.call("received_heads", rank_transfer_id(tid, rank, receiver_tp), n)
                    for rank, d in enumerate(receivers)
                ]
                failed = [x["error"] for x in sent if not x["ok"]] + [x["error"] for x in got if x["state"] != "done"]
                if failed:
                    raise RuntimeError(f"TP transfer failed: {failed[0]}")
                for q in pairs:
                    for h in range(q.heads.start, q.heads.stop):
                        if got[q.receiver_rank]["digests"][h] != sent[q.sender_rank]["digests"][h]:
                            raise RuntimeError(f"checksum mismatch of head {h} on receiving rank {q.receiver_rank}")
                if r:
                    best = min(best, max(x["at"] for x in got) - min(x["start"] for x in sent))
            nbytes = n * bs * PRESET_SPEC["num_layers"] * 2 * heads * PRESET_SPEC["head_dim"] * 2
            row = {
                "tokens": tokens,
                "bytes": nbytes,
                "seconds": best,
                "one_to_one_seconds": baseline[tokens],
                "vs_one_to_one": best / baseline[tokens],
                "checksum_verified": True,
            }
            log(
                f"  {tokens:>6} tokens, TP {sender_tp}:{receiver_tp}: {best * 1e3:.1f} ms, 1:1 "
                f"{baseline[tokens] * 1e3:.1f} ms ({row['vs_one_to_one']:.2f}x)"
            )
            results.append(row)
        return results
    finally:
        for proc in (*senders, *receivers):
            proc.stop()


def measure_layer_groups(prompt_len: int, repeats: int, config) -> dict:
    from splitserve.tools.make_model import write_random_checkpoint

    with tempfile.TemporaryDirectory(prefix="ss-kvheavy") as tmp:
        model_dir = str(write_random_checkpoint(tmp + "/model", KV_HEAVY, dtype="bfloat16", seed=0))
        bs = 16
        n = ceil_div(prompt_len, bs)
        spec = {
            "num_layers": KV_HEAVY["num_hidden_layers"],
            "num_kv_heads": KV_HEAVY["num_key_value_heads"],
            "head_dim": KV_HEAVY["hidden_size"] // KV_HEAVY["num_attention_heads"],
            "block_size": bs,
            "num_blocks": n + 8,
        }
        d, p = _Proc("receiver", spec, None, config), _Proc("sender", spec, model_dir, config)
        try:
            info = d.call("info")
            p.call("info")
            best: dict[str, float] = {}
            prefill_only = float("inf")
            for r in range(repeats + 1):
                timing = p.call("prefill", f"none-{r}", info["peer"], list(range(n)), prompt_len, "none")
                if r:
                    prefill_only = min(prefill_only, timing["prefilled"] - timing["start"])
                for mode in ("after", "streamed"):
                    tid = f"{mode}-{r}"
                    d.call("expect", tid, list(range(n)))
                    timing = p.call("prefill", tid, info["peer"], list(range(n)), prompt_len, mode)
                    got = d.call("received", tid, n)
                    if got["state"] != "done":
                        raise RuntimeError(f"{mode} transfer failed: {got['error']}")
                    if r:
                        best[mode] = min(best.get(mode, float("inf")), got["at"] - timing["start"])
            kv_bytes = n * bs * spec["num_layers"] * 2 * spec["num_kv_heads"] * spec["head_dim"] * 2
            out = {
                "prompt_tokens": prompt_len,
                "kv_bytes": kv_bytes,
                "layers": spec["num_layers"],
                "layer_group_size": config.layer_group_size,
                "prefill_seconds": prefill_only,
                "kv_on_receiver_after_prefill_seconds": best["after"],
                "kv_on_receiver_streamed_seconds": best["streamed"],
                "transfer_cost_after_prefill_seconds": best["after"] - prefill_only,
                "transfer_cost_streamed_seconds": best["streamed"] - prefill_only,
            }
            log(
                f"  prefill {prefill_only * 1e3:.0f} ms; KV on the receiver after prefill + send: "
                f"{best['after'] * 1e3:.0f} ms (+{out['transfer_cost_after_prefill_seconds'] * 1e3:.0f}), streamed: "
                f"{best['streamed'] * 1e3:.0f} ms (+{out['transfer_cost_streamed_seconds'] * 1e3:.0f})"
            )
            return out
        finally:
            p.stop()
            d.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="128,1024,8192,32768")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=2048, help="prompt of the layer-group measurement")
    ap.add_argument("--skip-layer-groups", action="store_true")
    ap.add_argument("--message-mib", type=int, default=8, help="max_message_bytes, in MiB")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each of the two processes")
    ap.add_argument("--tp", default="", metavar="P:D", help="also time a TP-P sender to a TP-D receiver")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tp = None
    if args.tp:
        try:
            tp = tuple(int(x) for x in args.tp.split(":"))
            if len(tp) != 2 or min(tp) < 1:
                raise ValueError
            from splitserve.engine.tp.layout import check_tp_size

            for size in tp:
                check_tp_size(size * PRESET_SPEC["num_kv_heads"], PRESET_SPEC["num_kv_heads"], size)
        except ValueError as e:
            ap.error(f"--tp: expected P:D, two sizes the preset's {PRESET_SPEC['num_kv_heads']} KV heads allow ({e})")
    _Proc.threads = args.threads
    from splitserve.engine.hardware import print_header

    machine = print_header(
        "bfloat16 (KV cache and the KV-heavy model)",
        f"{args.threads} in each of the two processes",
        "cpu",
        to_stderr=args.json,
    )

    from splitserve.kv_transfer.config import TransferConfig

    config = TransferConfig(
        op_timeout_s=30.0, transfer_timeout_s=120.0, pair_setup_timeout_s=30.0, max_message_bytes=args.message_mib << 20
    )
    sizes = [int(s) for s in args.sizes.split(",")]
    log("transfer of the qwen2.5-0.5b preset's KV between two processes ...")
    result: dict = {
        "machine": machine,
        "config": {
            "max_message_bytes": config.max_message_bytes,
            "whole_request_bytes": config.whole_request_bytes,
            "layer_group_size": config.layer_group_size,
        },
        "results": measure_sizes(sizes, args.repeats, config),
    }
    if tp is not None:
        log(f"transfer between a TP-{tp[0]} and a TP-{tp[1]} worker, one process per rank ...")
        result["tp"] = {
            "sender_tp": tp[0],
            "receiver_tp": tp[1],
            "results": measure_tp(sizes, args.repeats, config, tp[0], tp[1], result["results"]),
        }
    if not args.skip_layer_groups:
        log(f"layer-group streaming on a KV-heavy model (full MHA), {args.prompt_len}-token prompt ...")
        result["layer_groups"] = measure_layer_groups(args.prompt_len, max(1, args.repeats - 1), config)
    if args.json:
        print(json.dumps(result))
    else:
        print("| tokens | MiB | splitserve GB/s | raw send GB/s | ratio | gather alone GB/s | scatter alone GB/s |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in result["results"]:
            print(
                f"| {r['tokens']} | {r['bytes'] / 2**20:.1f} | {r['gbps']:.2f} | {r['raw_gbps']:.2f} "
                f"| {r['ratio']:.2f} "
                f"| {r['bytes'] / r['gather_seconds'] / 1e9:.1f} | {r['bytes'] / r['scatter_seconds'] / 1e9:.1f} |"
            )
        if "tp" in result:
            t = result["tp"]
            print(f"\n| tokens | TP {t['sender_tp']}:{t['receiver_tp']} ms | 1:1 ms | TP / 1:1 |")
            print("| --- | --- | --- | --- |")
            for r in t["results"]:
                print(
                    f"| {r['tokens']} | {r['seconds'] * 1e3:.1f} | {r['one_to_one_seconds'] * 1e3:.1f} "
                    f"| {r['vs_one_to_one']:.2f} |"
                )
        if "layer_groups" in result:
            lg = result["layer_groups"]
            print(
                f"\nKV-heavy model, {lg['prompt_tokens']}-token prompt ({lg['kv_bytes'] / 2**20:.0f} MiB of KV, "
                f"{lg['layers']} layers, groups of {lg['layer_group_size']}): "
                f"prefill {lg['prefill_seconds'] * 1e3:.0f} ms; "
                f"transfer adds {lg['transfer_cost_after_prefill_seconds'] * 1e3:.0f} ms when sent after prefill, "
                f"{lg['transfer_cost_streamed_seconds'] * 1e3:.0f} ms when streamed by layer group"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
