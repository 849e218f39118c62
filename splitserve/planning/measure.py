"""``splitserve profile``: measure a model's steps on its device through the real engine, and the real KV
transfer between two processes, then fit ``splitserve.deploy.profile.Profile``.

Steps are timed as a worker's engine takes them (``worker_common.local_engine.LocalEngine.run``): schedule, run
the model, apply the results, on an ``EngineCore`` built as the workers build theirs. Grids:

- prefill: ``tokens`` new prompt tokens of one request over ``contexts`` tokens already in its cache;
- decode: ``batches`` sequences of ``contexts`` tokens each, one new token each, several steps;
- mixed (a colocated worker's steps): a prompt chunk beside running decodes.

A step with context does not compute that context first: its blocks are allocated and zeroed and the
scheduler admits the request as holding them (``Scheduler.add_running``), since what a step costs does
not depend on the values in the cache. The KV transfer runs the real ``KVSender`` here and a real
``KVReceiver`` behind its gRPC service in a spawned process, on the model's KV layout, for several sizes
(or, ``transfer_in_process``, both in this process with the control stream in memory: where the gRPC
service is not importable). A transfer whose fit the samples do not determine is left out of the
profile, its samples kept and ``parts["transfer"]`` saying why; none is ever filled in.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime

from splitserve.deploy.profile import (
    MEASURED,
    NOT_MEASURED,
    ModelShape,
    Profile,
    StepSample,
    StepShape,
    TransferCost,
    TransferFitError,
    TransferSample,
    fit_steps,
    fit_transfer,
)
from splitserve.planning.ranks import HOST, TP_GROUP_TIMEOUT_S, TP_SETUP_TIMEOUT_S, end_followers, spawn_followers


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
    # Where the largest of transfer_tokens moves fewer bytes, one more size that moves this many: on a
    # small model every size above takes about the fixed cost, and the bandwidth would not show.
    transfer_min_bytes: int = 32 << 20

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
            self.transfer_min_bytes,
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
        from splitserve.engine.sampling.params import SamplingParams
        from splitserve.engine.scheduler.request import Request

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
        from splitserve.engine.scheduler.request import FinishReason

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
        return ModelShape.of(self.core.model_config, name)


# ---- the KV transfer, between two processes ---------------------------------------------------------


def _receiver_main(conn, spec: dict, dtype: str) -> None:
    """A spawned process: a KVReceiver behind its gRPC service; answers expect / received commands."""
    import torch

    from splitserve.engine.kv_cache.cache import KVCache, KVCacheSpec
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
            conn.send(_received(receiver, handles.pop(args[0])))
        else:
            server.stop(0)
            conn.send(True)
            return


def _received(receiver, handle) -> tuple[str, str | None, float | None]:
    """(state, error, finished_at) of a receive handle once it ends (within 120 s); its blocks released."""
    handle.wait(120)
    receiver.release(handle.transfer_id)
    return handle.state.value, handle.error, handle.finished_at


def _fingerprint(spec: dict, dtype: str):
    from splitserve.kv_transfer.descriptor import LayoutFingerprint

    return LayoutFingerprint(
        "profile", dtype, spec["block_size"], spec["num_layers"], spec["num_kv_heads"], spec["head_dim"], "profile"
    )


def transfer_sizes(model: ModelShape, dtype_bytes: int, block_size: int, grid: Grid) -> tuple[int, ...]:
    """Tokens of each transfer measured: the grid's, and one more where the largest of them moves fewer than
    ``grid.transfer_min_bytes`` (that many bytes, in whole blocks)."""
    from splitserve.common.arith import ceil_div

    per_token = model.kv_elements_per_token * dtype_bytes
    sizes = tuple(grid.transfer_tokens)
    if max(sizes) * per_token < grid.transfer_min_bytes:
        sizes += (ceil_div(ceil_div(grid.transfer_min_bytes, per_token), block_size) * block_size,)
    return sizes


class _SpawnedReceiver:
    """The receiver in a spawned process behind its gRPC service; the control stream is gRPC."""

    path = "two processes on this host: gRPC control stream, gloo payload, both KV caches in host memory"

    def __init__(self, spec: dict, dtype: str) -> None:
        from splitserve.kv_transfer.sender import PeerAddress

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_receiver_main, args=(child, spec, dtype), daemon=True)
        self.process.start()
        if not self.conn.poll(120):
            self.close()
            raise TimeoutError("the profile's KV receiver did not start within 120 s")
        self.peer = PeerAddress(*self.conn.recv())

    def connect(self, peer):
        from splitserve.kv_transfer.service import GrpcConnection

        return GrpcConnection(peer.control)

    def expect(self, tid: str, blocks: list[int]) -> None:
        self.conn.send(("expect", tid, blocks))
        self.conn.recv()

    def received(self, tid: str) -> tuple[str, str | None, float | None]:
        self.conn.send(("received", tid))
        return self.conn.recv()

    def stop(self) -> None:
        self.conn.send(("exit",))
        self.conn.recv()

    def close(self) -> None:
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()


class _LocalReceiver:
    """The receiver in this process, its control stream in memory (``splitserve.kv_transfer.local``): for a
    machine without the gRPC service. The payload is gloo's (NCCL refuses two ranks on one GPU)."""

    def __init__(self, spec: dict, dtype: str, device) -> None:
        import torch

        from splitserve.engine.kv_cache.cache import KVCache, KVCacheSpec
        from splitserve.kv_transfer.config import TransferConfig
        from splitserve.kv_transfer.receiver import KVReceiver
        from splitserve.kv_transfer.sender import PeerAddress

        self.config = TransferConfig(backend="gloo")
        cache = KVCache(KVCacheSpec(dtype=getattr(torch, dtype), **spec), device)
        self.receiver = KVReceiver(cache, _fingerprint(spec, dtype), "profile-receiver", config=self.config)
        self.peer = PeerAddress("profile-receiver", self.receiver.incarnation, "in-process")
        self.handles = {}
        where = "host memory" if cache.device.type == "cpu" else f"{cache.device} (payload staged through host memory)"
        self.path = f"one process: control stream in memory (no gRPC), gloo payload, both KV caches in {where}"

    def connect(self, peer):
        from splitserve.kv_transfer.local import LocalConnection

        return LocalConnection(self.receiver.serve_pair)

    def expect(self, tid: str, blocks: list[int]) -> None:
        self.handles[tid] = self.receiver.expect(tid, blocks)

    def received(self, tid: str) -> tuple[str, str | None, float | None]:
        return _received(self.receiver, self.handles.pop(tid))

    def stop(self) -> None:
        pass  # nothing to tell: close ends it

    def close(self) -> None:
        self.receiver.close()


def measure_transfers(
    model: ModelShape, dtype: str, block_size: int, grid: Grid, device: str = "cpu", in_process: bool = False
) -> tuple[list[TransferSample], str]:
    """The real transfer path (gather, control stream, gloo payload, scatter) from here to a receiver: in a
    spawned process behind gRPC with both caches in host memory, or (``in_process``) in this process with
    both caches on ``device``. The samples (median of ``grid.repeats`` each), and the path they took."""
    import torch

    from splitserve.common.arith import ceil_div
    from splitserve.engine.kv_cache.cache import KVCache, KVCacheSpec
    from splitserve.kv_transfer.sender import KVSender

    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    sizes = transfer_sizes(model, element, block_size, grid)
    spec = {
        "num_layers": model.num_layers,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "num_blocks": ceil_div(max(sizes), block_size) + 8,
        "block_size": block_size,
    }
    place = torch.device(device) if in_process else torch.device("cpu")
    receiver = _LocalReceiver(spec, dtype, place) if in_process else _SpawnedReceiver(spec, dtype)
    try:
        cache = KVCache(KVCacheSpec(dtype=getattr(torch, dtype), **spec), place)
        config = {"config": receiver.config} if in_process else {}
        sender = KVSender(cache, _fingerprint(spec, dtype), "profile-sender", connect=receiver.connect, **config)
        samples = []
        for tokens in sizes:
            blocks = list(range(ceil_div(tokens, block_size)))
            times = []
            for r in range(grid.repeats + 1):  # the first builds the pair group
                tid = f"profile-{tokens}-{r}"
                receiver.expect(tid, blocks)
                start = time.monotonic()
                handle = sender.start(tid, receiver.peer, blocks, tokens)
                sender.finish(handle)
                handle.wait(120)
                sender.release(tid)
                state, error, finished = receiver.received(tid)
                if state != "done":
                    raise RuntimeError(f"profile transfer of {tokens} tokens failed: {error or handle.error}")
                if r:
                    times.append(finished - start)
            nbytes = len(blocks) * block_size * model.kv_elements_per_token * element
            samples.append(TransferSample(nbytes, statistics.median(times)))
        sender.close()
        receiver.stop()
        return samples, receiver.path
    finally:
        receiver.close()


def fit_transfer_part(samples: list[TransferSample]) -> tuple[TransferCost | None, str]:
    """The transfer fit and its label: (fit, "measured"), or (None, why not) when the samples do not determine
    one (``fit_transfer`` refused: the profile holds no transfer rather than a made-up one)."""
    try:
        return fit_transfer(samples), MEASURED
    except TransferFitError as e:
        return None, f"not measured: the samples did not determine a fit ({e})"


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
    from splitserve.deploy.config import DeploymentConfig
    from splitserve.deploy.deployment import Deployment

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


def with_serving(profile: Profile, serving: dict[str, float]) -> Profile:
    """``profile`` with ``measure_serving``'s figures in its notes, its serving part labelled measured."""
    from dataclasses import replace

    return replace(profile, notes={**profile.notes, **serving}, parts={**profile.parts, "serving": MEASURED})


def _bench(address: str, concurrency: int):
    import math

    from splitserve.bench.config import BenchConfig

    return BenchConfig(addr=address, max_concurrency=concurrency, request_rate=math.inf, progress=False)


# ---- the whole profile ------------------------------------------------------------------------------


# ---- a tensor-parallel engine: rank 0 measures, the other ranks follow its plans -------------------


def _follower_main(measurer: dict, port: int, rank: int, size: int, errors) -> None:
    """A spawned rank: join the group, build its shard as rank 0's engine is built, follow until Stop."""
    try:
        import torch

        from splitserve.engine.core import EngineCore
        from splitserve.engine.tp.distributed import TPGroup, connect_store
        from splitserve.engine.tp.step import follow

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

    from splitserve.engine.tp.distributed import TPGroup

    store, _, procs, errors = spawn_followers(
        size, _follower_main, lambda port, rank, errors: (measurer_args, port, rank, size, errors)
    )
    device = torch.device(measurer_args["device"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        device = torch.device("cuda:0")
    group = TPGroup.join(backend, store, "tp/", 0, size, HOST, TP_GROUP_TIMEOUT_S, TP_SETUP_TIMEOUT_S, device)
    measurer = Measurer(**measurer_args, tp_group=group)

    def close() -> None:
        measurer.core.close()  # Stop: the followers return
        end_followers(procs, errors)

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
    transfer_in_process: bool = False,
    backend: str = "splitserve",
) -> Profile:
    """Measure and fit; a CPU profile's ``threads`` is the torch threads of each rank it stands for. At
    ``tensor_parallel_size`` > 1 the steps are a TP engine's whose rank 0 drives (its ranks spawned here,
    one per GPU on CUDA); the KV transfer is one rank's part. ``transfers`` False: no transfer is measured
    and the profile has none (``parts["transfer"]`` "not measured"); ``transfer_in_process``: see
    ``measure_transfers``. ``backend`` "vllm": a vllm-backend worker's steps (``measure_vllm.VllmMeasurer``),
    and the transfer at vLLM's block size."""
    from pathlib import Path

    from splitserve.engine.hardware import describe_machine

    grid = grid or Grid()
    args = {"model_dir": model_dir, "dtype": dtype, "device": device, "threads": threads, "grid": grid}
    block_size = 16
    if backend == "vllm":
        from splitserve.planning.measure_vllm import VllmMeasurer

        measurer = VllmMeasurer(**args, tensor_parallel_size=tensor_parallel_size)
        close, block_size = measurer.close, measurer.block_size
    elif tensor_parallel_size > 1:
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
    notes = {"machine": machine, "pid": os.getpid(), "backend": backend, "block_size": block_size}
    transfer, transfer_part, transfer_samples = None, NOT_MEASURED, []
    if transfers:
        transfer_samples, notes["transfer_path"] = measure_transfers(
            shape, dtype_name, block_size, grid, device, transfer_in_process
        )
        transfer, transfer_part = fit_transfer_part(transfer_samples)
    return Profile(
        model=shape,
        dtype=dtype_name,
        dtype_bytes=dtype_bytes,
        device=measurer_device(device),
        device_name=device_name,
        threads=threads_used,
        tensor_parallel_size=tensor_parallel_size,
        step_coefficients=fit_steps(steps),
        transfer=transfer,
        steps=tuple(steps),
        transfers=tuple(transfer_samples),
        source="measured",
        created=datetime.now().isoformat(timespec="seconds"),
        notes=notes,
        parts={"steps": MEASURED, "transfer": transfer_part, "serving": NOT_MEASURED},
    )


def measurer_device(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


def _device_name(device, machine: dict) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return str(machine.get("cpu_model") or "cpu")
