"""Real worker processes for KV-transfer tests.

Each worker is a spawned process that owns a paged KV cache, a block manager for its blocks, and a
``KVSender`` or a ``KVReceiver`` served over gRPC on 127.0.0.1, exactly as a prefill or decode worker
will. The test drives it over a pipe: lease or allocate blocks, start, wait, cancel, release, and read
back block checksums and leak figures.

A worker may be one rank of a tensor-parallel worker (``tp=(size, rank)``): its cache then holds only
that rank's KV heads of ``SPEC``'s, and its fingerprint says which.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import time
from dataclasses import dataclass

SPEC = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 16, "num_blocks": 512, "block_size": 4}


def make_fingerprint(dtype: str, spec: dict, checksum: str = "weights-v1", tp: tuple[int, int] = (1, 0)):
    from splitserve.engine.tp.layout import kv_head_range
    from splitserve.kv_transfer.descriptor import LayoutFingerprint

    heads = kv_head_range(spec["num_kv_heads"], *tp)
    return LayoutFingerprint(
        "test-model",
        dtype,
        spec["block_size"],
        spec["num_layers"],
        spec["num_kv_heads"],
        spec["head_dim"],
        checksum,
        tp_size=tp[0],
        tp_rank=tp[1],
        heads_start=heads.start,
        heads_stop=heads.stop,
    )


def _worker_main(
    conn, role: str, name: str, spec: dict, dtype: str, config, checksum: str, faults=None, tp=(1, 0)
) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from splitserve.engine.kv_cache.block_manager import BlockManager
    from splitserve.engine.kv_cache.cache import KVCache, KVCacheSpec
    from splitserve.engine.tp.layout import HeadRange
    from splitserve.kv_transfer.receiver import KVReceiver
    from splitserve.kv_transfer.sender import KVSender, PeerAddress
    from splitserve.kv_transfer.service import GrpcConnection, serve

    torch.set_num_threads(1)
    torch_dtype = getattr(torch, dtype)
    fp = make_fingerprint(dtype, spec, checksum, tp)
    cache = KVCache(KVCacheSpec(dtype=torch_dtype, **{**spec, "num_kv_heads": fp.heads.count}), "cpu")
    gen = torch.Generator().manual_seed(hash(name) % 2**31)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen).to(torch_dtype))
    blocks = BlockManager(spec["num_blocks"], spec["block_size"], enable_prefix_caching=False)
    # Scatter the free list: allocate one block per dummy request, free them in random order.
    order = list(range(spec["num_blocks"]))
    random.Random(name).shuffle(order)
    for i in order:
        blocks.allocate(f"dummy{i}", 1)
    for i in order:
        blocks.free(f"dummy{i}")
    info: dict = {"pid": os.getpid(), "name": name}
    hooks = faults.arm(name) if faults is not None else None
    if role == "receiver":
        endpoint = KVReceiver(cache, fp, name, config=config, faults=hooks)
        server, port = serve(endpoint)
        info.update(
            receiver_id=name,
            incarnation=endpoint.incarnation,
            control=f"127.0.0.1:{port}",
            store_port=endpoint.store_port,
        )
    else:
        endpoint = KVSender(
            cache, fp, name, connect=lambda peer: GrpcConnection(peer.control), config=config, faults=hooks
        )
        info.update(incarnation=endpoint.incarnation)
    handles = {}

    def checksums(transfer_id: str, count: int) -> list[str]:
        table = blocks.block_table(transfer_id)[:count]
        return [
            hashlib.sha1(cache.tensor[:, b].contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for b in table
        ]

    def head_checksums(transfer_id: str, count: int) -> list[dict[int, str]]:
        """Per block, the checksum of each head this rank holds, keyed by the model's head number."""
        table = blocks.block_table(transfer_id)[:count]
        return [
            {
                fp.heads_start + h: hashlib.sha1(
                    cache.tensor[:, b, :, h].contiguous().view(torch.uint8).numpy()
                ).hexdigest()
                for h in range(fp.heads.count)
            }
            for b in table
        ]

    def expect(transfer_id: str, num_tokens: int, extra_blocks: int = 2, timeout_s=None):
        if not blocks.allocate(transfer_id, num_tokens + extra_blocks * spec["block_size"]):
            raise RuntimeError("out of blocks")
        handles[transfer_id] = endpoint.expect(transfer_id, blocks.block_table(transfer_id), timeout_s)
        return list(blocks.block_table(transfer_id))

    def send(
        transfer_id: str, peer: dict, num_tokens: int, stream: bool = False, commit=None, timeout_s=None, heads=None
    ):
        if not blocks.allocate(transfer_id, num_tokens):
            raise RuntimeError("out of blocks")
        address = PeerAddress(peer["receiver_id"], peer["incarnation"], peer["control"])
        handle = handles[transfer_id] = endpoint.start(
            transfer_id,
            address,
            blocks.block_table(transfer_id),
            num_tokens,
            timeout_s,
            HeadRange(*heads) if heads else None,
        )
        if stream:
            for layers in range(1, spec["num_layers"] + 1):
                endpoint.layers_ready(handle, layers)
        endpoint.finish(handle, commit)
        return list(blocks.block_table(transfer_id))

    def wait(transfer_id: str, timeout_s: float = 20.0):
        handle = handles[transfer_id]
        start = time.monotonic()
        state = handle.wait(timeout_s)
        return {
            "state": state.value,
            "error": handle.error,
            "waited": time.monotonic() - start,
            "commit": getattr(handle, "commit", None),
        }

    def release(transfer_id: str):
        endpoint.release(transfer_id)
        blocks.free(transfer_id)
        handles.pop(transfer_id, None)

    def status():
        blocks.check_integrity()
        return {
            "used_blocks": blocks.num_used_blocks,
            "pairs": endpoint.num_pairs(),
            "live": sorted(t for t, h in handles.items() if not h.terminal),
        }

    commands = {
        "info": lambda: info,
        "expect": expect,
        "send": send,
        "wait": wait,
        "release": release,
        "cancel": lambda transfer_id: endpoint.cancel(transfer_id),
        "checksums": checksums,
        "head_checksums": head_checksums,
        "status": status,
        "state": lambda transfer_id: handles[transfer_id].state.value,
    }
    while True:
        try:
            command, args, kwargs = conn.recv()
        except EOFError:
            return
        if command == "exit":
            endpoint.close()
            conn.send(("ok", None))
            os._exit(0)  # skip interpreter teardown while gloo's and gRPC's threads still run
        try:
            conn.send(("ok", commands[command](*args, **kwargs)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


@dataclass
class Worker:
    role: str
    name: str
    process: mp.Process
    conn: object
    info: dict

    @classmethod
    def start(
        cls,
        role: str,
        name: str,
        config=None,
        dtype: str = "float32",
        spec: dict | None = None,
        checksum: str = "weights-v1",
        faults=None,
        tp: tuple[int, int] = (1, 0),
    ) -> Worker:
        worker = cls.launch(role, name, config, dtype, spec, checksum, faults, tp)
        worker.info = worker.call("info", timeout=60)
        return worker

    @classmethod
    def launch(
        cls,
        role: str,
        name: str,
        config=None,
        dtype: str = "float32",
        spec: dict | None = None,
        checksum: str = "weights-v1",
        faults=None,
        tp: tuple[int, int] = (1, 0),
    ) -> Worker:
        """Spawn the process without waiting for it (``ready`` does): several start in parallel."""
        from splitserve.kv_transfer.config import TransferConfig

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(
            target=_worker_main,
            args=(child, role, name, spec or SPEC, dtype, config or TransferConfig(), checksum, faults, tp),
            daemon=True,
        )
        process.start()
        return cls(role, name, process, parent, {})

    def ready(self) -> Worker:
        self.info = self.call("info", timeout=60)
        return self

    def call(self, command: str, *args, timeout: float = 30.0, **kwargs):
        self.conn.send((command, args, kwargs))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer to {command} within {timeout}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name}.{command}: {value}")
        return value

    @property
    def peer(self) -> dict:
        return {k: self.info[k] for k in ("receiver_id", "incarnation", "control")}

    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit", timeout=10)
            except Exception:
                pass
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
