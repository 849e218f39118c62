"""``splitserve profile``: measure a model's steps on its device through the real engine, and the real KV
transfer between two processes, then fit ``splitserve.planning.profile.Profile``.

Steps are timed as a worker takes them (``worker_common.batch.Batch``): schedule, run the model, apply the
results, on an ``EngineCore`` built as the workers build theirs. Grids:

- prefill: ``tokens`` new prompt tokens of one request over ``contexts`` tokens already in its cache;
- decode: ``batches`` sequences of ``contexts`` tokens each, one new token each, several steps;
- mixed (a colocated worker's steps): a prompt chunk beside running decodes.

A step with context does not compute that context first: its blocks are allocated and zeroed and the
scheduler admits the request as holding them (``Scheduler.add_running``), since what a step costs does
not depend on the values in the cache. The KV transfer runs the real ``KVSender`` here and a real
``KVReceiver`` behind its gRPC service in a spawned process, on the model's KV layout, for several sizes.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime

from splitserve.planning.profile import (
    ModelShape,
    Profile,
    StepSample,
    StepShape,
    TransferSample,
    fit_steps,
    fit_transfer,
)


@dataclass(frozen=True)
class Grid:
    prefill_tokens: tuple[int, ...] = (16, 64, 256, 1024, 2048)
    prefill_contexts: tuple[int, ...] = (0, 1024)
    decode_batches: tuple[int, ...] = (1, 4, 16, 32, 64)
    decode_contexts: tuple[int, ...] = (64, 512, 2048)
    mixed: tuple[tuple[int, int, int], ...] = ((256, 8, 256), (64, 16, 128))  # (prompt tokens, decodes, context)
    transfer_tokens: tuple[int, ...] = (16, 256, 2048)
    repeats: int = 3
    decode_steps: int = 4

    def scaled(self, factor: float) -> Grid:
        """A smaller grid (factor < 1) for a quick profile: fewer and shorter points."""

        def cut(values: tuple[int, ...]) -> tuple[int, ...]:
            kept = tuple(v for v in values if v <= max(values) * factor) or values[:1]
            return kept

        return Grid(
            cut(self.prefill_tokens),
            self.prefill_contexts,
            cut(self.decode_batches),
            self.decode_contexts,
            self.mixed,
            cut(self.transfer_tokens),
            max(1, round(self.repeats * factor)),
            self.decode_steps,
        )


def engine_config(
    model_dir: str,
    dtype: str,
    device: str,
    threads: int | None,
    block_size: int,
    grid: Grid,
    size: int = 1,
    rank: int = 0,
):
    """The engine a profile measures, on every rank alike (the same cache size: block ids are rank 0's)."""
    from splitserve.engine.core import EngineConfig

    largest = max(
        max(grid.prefill_tokens) + max(grid.prefill_contexts),
        max(grid.decode_batches) * (max(grid.decode_contexts) + 2 * grid.decode_steps + 8),
        max(t + b * (c + 8) for t, b, c in grid.mixed),
    )
    return EngineConfig(
        model_dir=model_dir,
        dtype=dtype,
        device=device,
        num_threads=threads,
        block_size=block_size,
        num_blocks=largest // block_size + 64,
        max_num_seqs=max(max(grid.decode_batches), max(b for _, b, _ in grid.mixed)) + 1,
        max_num_batched_tokens=max(grid.prefill_tokens) + max(grid.decode_batches) + 64,
        enable_prefix_caching=False,
        max_model_len=largest + 64,
        tensor_parallel_size=size,
        tensor_parallel_rank=rank,
        tensor_parallel_step="plan" if size > 1 else "lockstep",
    )


@dataclass
class Measurer:
    """One engine, stepped by hand."""

    model_dir: str
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None
    block_size: int = 16
    grid: Grid = field(default_factory=Grid)
    tp_group: object | None = None  # rank 0's TPGroup of a tensor-parallel engine (the others follow_ranks)

    def __post_init__(self) -> None:
        import torch

        from splitserve.engine.core import EngineCore

        if self.threads:
            torch.set_num_threads(self.threads)
        size = self.tp_group.size if self.tp_group is not None else 1
        config = engine_config(self.model_dir, self.dtype, self.device, self.threads, self.block_size, self.grid, size)
        self.core = EngineCore(config, tp_group=self.tp_group)
        self.core.kv_cache.tensor.zero_()
        self.scheduler = self.core.make_scheduler()
        self.torch = torch
        self._ids = 0
        self._vocab = self.core.model_config.vocab_size

    # ---- one step -----------------------------------------------------------------------------

    def _request(self, prompt_len: int, max_tokens: int, computed: int | None):
        """A request holding the KV of its first ``computed`` tokens (None: all but the last), admitted."""
        from splitserve.engine.request import Request
        from splitserve.engine.sampling_params import SamplingParams

        self._ids += 1
        rid = f"profile-{self._ids}"
        prompt = [(7 + 31 * i + self._ids) % (self._vocab - 1) for i in range(prompt_len)]
        request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        assert self.core.blocks.allocate(rid, prompt_len + 1), "the profile's cache is too small"
        self.scheduler.add_running(request, computed)
        return request

    def _step(self) -> tuple[StepShape, float]:
        """One step as a worker takes it: schedule, run, apply; its shape and seconds."""
        sync = self.torch.cuda.synchronize if self.core.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        output = self.scheduler.schedule()
        sampled = self.core.runner.execute(output)
        self.scheduler.update(output, sampled)
        sync()
        seconds = time.perf_counter() - start
        # As the model runner sees them: an item of one new token decodes, any other is a prompt chunk.
        chunks = [(s.request.num_computed_tokens - s.num_new_tokens, s.num_new_tokens) for s in output.scheduled]
        prefill = [(c, n) for c, n in chunks if n > 1]
        decodes = [c + 1 for c, n in chunks if n == 1]
        return StepShape.of(prefill, decodes), seconds

    def _clear(self) -> None:
        from splitserve.engine.request import FinishReason

        for rid in list(self.scheduler.requests):
            self.scheduler.finish(rid, FinishReason.ABORT)
        assert self.core.blocks.num_used_blocks == 0

    # ---- the grid -----------------------------------------------------------------------------

    def warm_up(self) -> None:
        for _ in range(2):
            self._request(64, 2, 0)
            self._step()
            self._step()
            self._clear()

    def prefill(self, tokens: int, context: int) -> StepSample:
        times = []
        for _ in range(self.grid.repeats):
            self._request(context + tokens, 1, context)
            shape, seconds = self._step()
            times.append(seconds)
            self._clear()
        return StepSample(shape, statistics.median(times))

    def decode(self, batch: int, context: int) -> StepSample:
        for _ in range(batch):
            self._request(context, self.grid.decode_steps + 2, None)
        self._step()  # the first step after admission: warm
        samples = [self._step() for _ in range(self.grid.decode_steps)]
        self._clear()
        shape = samples[len(samples) // 2][0]
        return StepSample(shape, statistics.median(s for _, s in samples))

    def mixed(self, tokens: int, batch: int, context: int) -> StepSample:
        times, shape = [], None
        for _ in range(self.grid.repeats):
            for _ in range(batch):
                self._request(context, 4, None)
            self._request(tokens, 1, 0)
            shape, seconds = self._step()
            times.append(seconds)
            self._clear()
        return StepSample(shape, statistics.median(times))

    def steps(self) -> list[StepSample]:
        g = self.grid
        self.warm_up()
        samples = [self.prefill(t, c) for c in g.prefill_contexts for t in g.prefill_tokens]
        samples += [self.decode(b, c) for c in g.decode_contexts for b in g.decode_batches]
        samples += [self.mixed(t, b, c) for t, b, c in g.mixed]
        return samples

    def model_shape(self, name: str) -> ModelShape:
        m = self.core.model_config
        return ModelShape(
            name=name,
            architecture=m.architecture,
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            intermediate_size=m.intermediate_size,
            vocab_size=m.vocab_size,
            max_position_embeddings=m.max_position_embeddings,
        )


# ---- the KV transfer, between two processes ---------------------------------------------------------


def _receiver_main(conn, spec: dict, dtype: str) -> None:
    """A spawned process: a KVReceiver behind its gRPC service; answers expect / received commands."""
    import torch

    from splitserve.engine.kv_cache import KVCache, KVCacheSpec
    from splitserve.kv_transfer.receiver import KVReceiver
    from splitserve.kv_transfer.service import serve

    torch.set_num_threads(1)
    torch_dtype = getattr(torch, dtype)
    cache = KVCache(KVCacheSpec(dtype=torch_dtype, **spec), torch.device("cpu"))
    receiver = KVReceiver(cache, _fingerprint(spec, dtype), "profile-receiver")
    server, port = serve(receiver)
    conn.send(("profile-receiver", receiver.incarnation, f"127.0.0.1:{port}"))
    handles = {}
    while True:
        command, *args = conn.recv()
        if command == "expect":
            handles[args[0]] = receiver.expect(args[0], args[1])
            conn.send(True)
        elif command == "received":
            handle = handles.pop(args[0])
            handle.wait(120)
            receiver.release(args[0])
            conn.send((handle.state.value, handle.error, handle.finished_at))
        else:
            server.stop(0)
            conn.send(True)
            return


def _fingerprint(spec: dict, dtype: str):
    from splitserve.kv_transfer.descriptor import LayoutFingerprint

    return LayoutFingerprint(
        "profile", dtype, spec["block_size"], spec["num_layers"], spec["num_kv_heads"], spec["head_dim"], "profile"
    )


def measure_transfers(model: ModelShape, dtype: str, block_size: int, grid: Grid) -> list[TransferSample]:
    """The real transfer path (gather, gRPC control, gloo payload, scatter) from here to a spawned receiver."""
    import torch

    from splitserve.common.arith import ceil_div
    from splitserve.engine.kv_cache import KVCache, KVCacheSpec
    from splitserve.kv_transfer.sender import KVSender, PeerAddress
    from splitserve.kv_transfer.service import GrpcConnection

    most = ceil_div(max(grid.transfer_tokens), block_size)
    spec = {
        "num_layers": model.num_layers,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "num_blocks": most + 8,
        "block_size": block_size,
    }
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_receiver_main, args=(child, spec, dtype), daemon=True)
    process.start()
    try:
        if not conn.poll(120):
            raise TimeoutError("the profile's KV receiver did not start within 120 s")
        peer = PeerAddress(*conn.recv())
        cache = KVCache(KVCacheSpec(dtype=getattr(torch, dtype), **spec), torch.device("cpu"))
        sender = KVSender(
            cache, _fingerprint(spec, dtype), "profile-sender", connect=lambda p: GrpcConnection(p.control)
        )
        samples = []
        for tokens in grid.transfer_tokens:
            blocks = list(range(ceil_div(tokens, block_size)))
            times = []
            for r in range(grid.repeats + 1):  # the first builds the pair group
                tid = f"profile-{tokens}-{r}"
                conn.send(("expect", tid, blocks))
                conn.recv()
                start = time.monotonic()
                handle = sender.start(tid, peer, blocks, tokens)
                sender.finish(handle)
                handle.wait(120)
                sender.release(tid)
                conn.send(("received", tid))
                state, error, finished = conn.recv()
                if state != "done":
                    raise RuntimeError(f"profile transfer of {tokens} tokens failed: {error or handle.error}")
                if r:
                    times.append(finished - start)
            nbytes = len(blocks) * block_size * model.kv_elements_per_token * cache.tensor.element_size()
            samples.append(TransferSample(nbytes, statistics.median(times)))
        sender.close()
        conn.send(("exit",))
        conn.recv()
        return samples
    finally:
        process.join(5)
        if process.is_alive():
            process.kill()


# ---- what serving adds: a real deployment at no load --------------------------------------------------


def measure_serving(
    profile: Profile,
    model_dir: str,
    threads: int | None,
    requests: int = 8,
    roles: dict | None = None,
    mode: str = "disaggregated",
) -> dict[str, float]:
    """One prefill and one decode worker (or, ``mode`` colocated, one colocated worker) on an embedded Ray,
    each with ``threads``, through the router:
    what a first token waits beyond its prefill step (the router, the gRPC calls, the lease), and what a
    serving worker's step costs beyond the engine's: a fixed part (its loop) and a part per token it
    streams (an event, a protobuf message, a gRPC stream write, and the router and client relaying it on
    the same machine). Requests one at a time, then ``requests`` at once; medians, in seconds. ``roles``:
    the deployment's ``prefill:`` and ``decode:`` sections (e.g. pinned cores), instead of ``threads``."""

    from splitserve.bench.datasets import BenchRequest
    from splitserve.bench.runner import benchmark
    from splitserve.deploy_config import DeploymentConfig
    from splitserve.launch import Deployment

    role = {"threads": threads} if threads else {}
    roles = roles or ({"prefill": role, "decode": role} if mode == "disaggregated" else {"colocated": role})
    config = DeploymentConfig.from_dict({"model": model_dir, "dtype": profile.dtype, "port": 0, "mode": mode, **roles})
    prompt_len, output_len = 64, 32
    # The long prompt's step must dwarf the noise of a first token's wait (milliseconds), or the slope
    # below is noise: the longest of these that the profile says prefills within a second (at least 512).
    fits = [n for n in (1024, 2048) if n <= profile.model.max_position_embeddings // 2]
    long_len = max([512] + [n for n in fits if profile.step_s(StepShape.of([(0, n)])) <= 1.0])
    vocab = profile.model.vocab_size

    def batch(n: int, salt: int, length: int = prompt_len) -> list[BenchRequest]:
        return [
            BenchRequest([(11 + 97 * (i + salt) + 13 * j) % (vocab - 1) for j in range(length)], output_len)
            for i in range(n)
        ]

    deployment = Deployment(config)
    try:
        deployment.start()
        address = deployment.address
        one = benchmark(batch(requests + 1, 0), [0.0] * (requests + 1), _bench(address, 1))
        many = benchmark(batch(requests, 1000), [0.0] * requests, _bench(address, requests))
        long = benchmark(batch(requests // 2 + 1, 2000, long_len), [0.0] * (requests // 2 + 1), _bench(address, 1))
    finally:
        deployment.stop()
    ttfts = one["ttfts"][1:]  # the first request warms up
    # A prompt's step as the serving worker takes it may cost more than the engine's alone (its transfer
    # threads, the other worker, the router on the same cores): the slope of TTFT against the profile's
    # prefill step, from prompts of two lengths one at a time, scales the prompt part of a step.
    short_step = profile.step_s(StepShape.of([(0, prompt_len)]))
    long_step = profile.step_s(StepShape.of([(0, long_len)]))
    factor = (statistics.median(long["ttfts"][1:]) - statistics.median(ttfts)) / (long_step - short_step)
    factor = min(max(factor, 1.0), 3.0)
    alone = statistics.median(gap for gaps in one["itls"][1:] for gap in gaps)
    together = statistics.median(gap for gaps in many["itls"] for gap in gaps[2:])  # once all decode together
    context = prompt_len + output_len // 2
    extra_alone = alone - profile.step_s(StepShape.of([], [context]))
    extra_together = together - profile.step_s(StepShape.of([], [context] * requests))
    per_token = max(0.0, (extra_together - extra_alone) / (requests - 1))
    return {
        "ttft_overhead_s": max(0.0, statistics.median(ttfts) - factor * short_step),
        "prefill_factor": factor,
        "step_overhead_s": max(0.0, extra_alone - per_token),
        "token_overhead_s": per_token,
        "serving_ttft_s": statistics.median(ttfts),
        "serving_itl_s": alone,
        f"serving_itl_{requests}_s": together,
    }


def _bench(address: str, concurrency: int):
    import math

    from splitserve.bench.config import BenchConfig

    return BenchConfig(addr=address, max_concurrency=concurrency, request_rate=math.inf, progress=False)


# ---- the whole profile ------------------------------------------------------------------------------


# ---- a tensor-parallel engine: rank 0 measures, the other ranks follow its plans -------------------

HOST = "127.0.0.1"
TP_SETUP_TIMEOUT_S = 120.0
TP_GROUP_TIMEOUT_S = 60.0


def _follower_main(measurer: dict, port: int, rank: int, size: int, errors) -> None:
    """A spawned rank: join the group, build its shard as rank 0's engine is built, follow until Stop."""
    try:
        import torch

        from splitserve.engine.core import EngineCore
        from splitserve.engine.distributed import TPGroup, connect_store
        from splitserve.engine.tp_step import follow

        args = dict(measurer)
        if args["threads"]:
            torch.set_num_threads(args["threads"])
        device = torch.device(args["device"])
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            device = torch.device(f"cuda:{rank}")
            torch.cuda.set_device(device)
            args["device"] = str(device)
        store = connect_store(HOST, port, TP_SETUP_TIMEOUT_S)
        group = TPGroup.join(backend, store, "tp/", rank, size, HOST, TP_GROUP_TIMEOUT_S, TP_SETUP_TIMEOUT_S, device)
        core = EngineCore(engine_config(**args, block_size=16, size=size, rank=rank), tp_group=group)
        core.kv_cache.tensor.zero_()
        follow(core, group)
    except BaseException as e:  # reported to rank 0, which fails the profile
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")


def _measure_tp(measurer_args: dict, size: int):
    """Rank 0's ``Measurer`` of a TP-``size`` engine, with ranks 1.. spawned and following; and a closer."""
    import torch
    import torch.multiprocessing as mp

    from splitserve.engine.distributed import TPGroup, bind_store

    store, port = bind_store(HOST, 0, TP_SETUP_TIMEOUT_S)
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_follower_main, args=(measurer_args, port, r, size, errors)) for r in range(1, size)]
    for process in procs:
        process.start()
    device = torch.device(measurer_args["device"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        device = torch.device("cuda:0")
    group = TPGroup.join(backend, store, "tp/", 0, size, HOST, TP_GROUP_TIMEOUT_S, TP_SETUP_TIMEOUT_S, device)
    measurer = Measurer(**measurer_args, tp_group=group)

    def close() -> None:
        measurer.core.close()  # Stop: the followers return
        for process in procs:
            process.join(30)
            if process.is_alive():
                process.kill()
        if not errors.empty():
            raise RuntimeError(errors.get())

    return measurer, close, store


def measure_profile(
    model_dir: str,
    dtype: str = "float32",
    device: str = "cpu",
    threads: int | None = None,
    grid: Grid | None = None,
    name: str | None = None,
    transfers: bool = True,
    tensor_parallel_size: int = 1,
) -> Profile:
    """Measure and fit; a CPU profile's ``threads`` is the torch threads of each rank it stands for. At
    ``tensor_parallel_size`` > 1 the steps are a TP engine's whose rank 0 drives (its ranks spawned here,
    one per GPU on CUDA); the KV transfer is one rank's part."""
    from pathlib import Path

    from splitserve.engine.hardware import describe_machine

    grid = grid or Grid()
    args = {"model_dir": model_dir, "dtype": dtype, "device": device, "threads": threads, "grid": grid}
    if tensor_parallel_size > 1:
        measurer, close, _store = _measure_tp(args, tensor_parallel_size)
    else:
        measurer, close = Measurer(**args), (lambda: None)
    shape = measurer.model_shape(name or Path(model_dir).name)
    try:
        steps = measurer.steps()
    finally:
        close()
    dtype_name = str(measurer.core.dtype).removeprefix("torch.")
    dtype_bytes = measurer.core.kv_cache.tensor.element_size()
    machine = describe_machine(probe_torch=True)
    device_name = _device_name(measurer.core.device, machine)
    threads_used = measurer.torch.get_num_threads()
    del measurer
    transfer_samples = measure_transfers(shape, dtype_name, 16, grid) if transfers else []
    latency, bandwidth = fit_transfer(transfer_samples) if transfer_samples else (0.0, 1e12)
    return Profile(
        model=shape,
        dtype=dtype_name,
        dtype_bytes=dtype_bytes,
        device=measurer_device(device),
        device_name=device_name,
        threads=threads_used,
        tensor_parallel_size=tensor_parallel_size,
        step_coefficients=fit_steps(steps),
        transfer_latency_s=latency,
        transfer_bytes_per_s=bandwidth,
        steps=tuple(steps),
        transfers=tuple(transfer_samples),
        source="measured",
        created=datetime.now().isoformat(timespec="seconds"),
        notes={"machine": machine, "pid": os.getpid()},
    )


def measurer_device(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


def _device_name(device, machine: dict) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return str(machine.get("cpu_model") or "cpu")
