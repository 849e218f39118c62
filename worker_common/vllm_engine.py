"""``VllmEngine``: vLLM's engine core, in this process, behind the workers' ``Engine`` interface
(``splitserve.worker_common.engine_api``), for ``engine.backend: vllm`` (docs/engine.md), in any role.

The worker keeps everything it has on the splitserve backend: its gRPC service, status, metrics, health,
drain, cancel and the router contract. Only the engine changes: vLLM's ``EngineCore`` (its scheduler, KV
cache manager, model runner and sampler) runs in the worker's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
the single-process executor), on the worker's cores, with no HTTP server and no placement group of its own;
a colocated CPU worker's model runner and sampler run in a process of their own, as under `vllm serve`
(``model_process``).

One step, as the worker takes it, maps onto vLLM's own step (``EngineCore.step``):

    schedule()  ->  scheduler.schedule()                       (under the worker's lock)
    run()       ->  executor.execute_model / sample_tokens     (no lock: the model runs)
                    scheduler.update_from_output               (under the lock)

Requests stay this repository's ``Request`` objects: the engine appends the tokens vLLM sampled and sets the
finish reason, so the worker streams them exactly as it does its own engine's. vLLM sees token ids only (the
router detokenizes and matches stop strings, for both backends), and a request's sampling parameters map
one to one (``vllm_sampling``). A request finished while its step runs (a cancel) is aborted after the model
returns and before the results apply, as ``EngineCore`` does with aborts that arrive mid-step.

A prefill and a decode worker move the KV as they do on the splitserve engine, with their KV sender and
receiver over the same pair groups, reading and writing vLLM's paged cache (``kv_cache``: vLLM's per-layer
blocks seen as one region); vLLM's scheduler learns of it through splitserve's KV connector
(``splitserve.kv_transfer.vllm_connector``):

* prefill: a request enters vLLM capped at its first token and marked to hand off; vLLM finishes it there and
  the connector holds its blocks until the worker's ``free`` (its transfer ended), which reports it sent.
* decode: ``allocate`` (a lease) adds the request to vLLM with the prompt's KV to arrive from outside and a
  placeholder for the first token; vLLM's scheduler allocates its blocks on the loop thread, and
  ``block_table`` waits for that (``LEASE_ADMIT_S``). ``add_running`` (the KV landed, the first token known)
  puts the first token in the placeholder's place and reports the load done; vLLM then computes the first
  token's KV and samples on. ``free`` of a lease that never ran aborts it and reports the load over, so vLLM
  frees its blocks at once.

A tensor-parallel worker runs one vLLM engine per rank (``build_vllm`` with ``VllmRanks``: vLLM's external-launcher
executor, its process group formed on the worker's own rendezvous store). Rank 0 is this class: its scheduler
makes every step, and ``_execute`` sends the step to the other ranks on the plan channel (``Foreign``) before its
own forward; each other rank is a ``VllmRank``, whose model runner runs that step (docs/kv_transfer.md,
"Tensor-parallel vLLM workers").

vllm is imported only here and by the connector, and only when a worker builds this engine: ``import
splitserve`` and the router never import it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from splitserve.engine.core import EngineConfig
from splitserve.engine.kv_cache.block_manager import BlockEvent
from splitserve.engine.kv_cache.cache import KVCache, KVCacheSpec
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.loader import checkpoint_files
from splitserve.engine.sampling.params import SamplingParams, TokenLogprobs
from splitserve.engine.scheduler.request import FinishReason, Request, RequestStatus
from splitserve.engine.tp.distributed import CollectiveError
from splitserve.engine.tp.layout import kv_head_range
from splitserve.engine.tp.step import Foreign, PlanChannel
from splitserve.worker_common.engine_api import ModelFacts, StepKind, StepResult
from splitserve.worker_common.loop_clock import LoopClock
from splitserve.worker_common.metrics import WorkerMetrics
from splitserve.worker_common.tp.rank_link import Ranks
from splitserve.worker_common.vllm_prefix_events import VllmPrefixEvents

logger = logging.getLogger(__name__)

LEASE_ADMIT_S = 10.0  # decode: how long a lease waits for vLLM's scheduler to allocate its blocks
PLACEHOLDER_TOKEN = 0  # decode: the first token's place until it arrives with the KV
# The connector's kv_transfer_params keys (splitserve.kv_transfer.vllm_connector's EXTERNAL_TOKENS, HAND_OFF).
EXTERNAL_KEY = "splitserve_external_tokens"
HAND_OFF_KEY = "splitserve_hand_off"
CONNECTOR = {
    "kv_connector": "SplitserveConnector",
    "kv_connector_module_path": "splitserve.kv_transfer.vllm_connector",
}

# vLLM's finish reasons (vllm.v1.engine.FinishReason's names) -> ours.
_FINISH = {"STOP": FinishReason.STOP, "LENGTH": FinishReason.LENGTH, "ABORT": FinishReason.ABORT}

# EngineArgs this module sets from the engine config; ``engine.vllm_args`` may not set them again.
_OWNED_ARGS = frozenset(
    {
        "model",
        "dtype",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_prefix_caching",
        "max_model_len",
        "tensor_parallel_size",
        "distributed_executor_backend",
        "kv_cache_memory_bytes",
        "num_gpu_blocks_override",
        "kv_transfer_config",
        "worker_extension_cls",
    }
)


def vllm_sampling(request: Request, hand_off: bool = False, lease: bool = False) -> Any:
    """The request's sampling parameters as vLLM's ``SamplingParams``, meaning the same as ours: the seed is
    the request's effective seed (so an unseeded request is as random on both backends, and a seeded one
    repeats on each, not across them); a request resumed with output tokens asks for the tokens it still
    lacks. Stop strings are the router's on both backends, so vLLM never sees them. ``hand_off``: a prefill
    worker's request, capped at its first token (vLLM finishes it there; the decode worker samples the rest).
    ``lease``: a decode worker's, whose first token comes with the KV (it is not one vLLM samples)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp: SamplingParams = request.sampling
    done = request.num_output_tokens + (1 if lease else 0)
    max_tokens = max(1, sp.max_tokens - done)
    min_tokens = max(0, sp.min_tokens - done)
    if hand_off:
        max_tokens, min_tokens = 1, min(1, min_tokens)
    return VllmSamplingParams(
        n=1,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        seed=request.seed,
        repetition_penalty=sp.repetition_penalty,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        # Both of the raw logits on both backends (vLLM's default logprobs_mode, raw_logprobs).
        logprobs=sp.logprobs,
        prompt_logprobs=sp.prompt_logprobs if request.wants_prompt_logprobs and not lease else None,
    )


def token_logprobs(ids, logprobs, rank: int, k: int) -> TokenLogprobs:
    """One position's entry from vLLM's row: column 0 the token there, then the most likely ones."""
    top = tuple((int(t), float(v)) for t, v in zip(ids[1 : k + 1], logprobs[1 : k + 1], strict=True))
    return TokenLogprobs(int(ids[0]), float(logprobs[0]), int(rank), top)


def vllm_environment(config: EngineConfig, cpus: Iterable[int] | None) -> dict[str, str]:
    """The environment vLLM reads at import and start-up, for a worker (or a rank of one) of this config on these
    cores: the engine core in this process, vLLM's OpenMP threads bound to the worker's cores (all of them: vLLM's
    default keeps one for a front end this worker does not run), its CPU platform on a CPU device. A rank of a
    tensor-parallel worker that is not pinned takes its own share of the cores it may run on (rank r: the r-th
    ``num_threads``), so that the ranks' threads do not pile onto the first cores. Values the operator set already
    are kept."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if config.device == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
        if cpus is not None:
            cores = sorted(cpus)
            if config.num_threads:
                cores = cores[: config.num_threads]
        else:
            usable = sorted(os.sched_getaffinity(0))
            size, rank = config.tensor_parallel_size, config.tensor_parallel_rank
            n = config.num_threads or max(1, len(usable) // size)
            cores = [usable[(rank * n + i) % len(usable)] for i in range(min(n, len(usable)))]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(set(cores)))
    return env


@dataclass(frozen=True)
class VllmRanks:
    """Where the ranks of a tensor-parallel vLLM worker meet: rank 0's rendezvous store (the one the worker's own
    ``TPGroup`` formed on) and the group's id. vLLM's ranks form their process group there too (the external
    launcher's ``env://``, every rank a client of that store: ``TORCHELASTIC_USE_AGENT_STORE``), and the group's
    id names their CPU shared-memory all-reduce, so that two tensor-parallel vLLM workers on one node never share
    one (vLLM names it after the init method, which is ``env://`` for every external launch)."""

    host: str
    port: int
    group_id: str

    def environment(self, rank: int, size: int) -> dict[str, str]:
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(size),
            "LOCAL_WORLD_SIZE": str(size),
            "MASTER_ADDR": self.host,
            "MASTER_PORT": str(self.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }


def ranks_executor(ranks: VllmRanks, rank: int) -> type:
    """vLLM's external-launcher executor (one process per rank, each with its own engine) for a rank of a
    splitserve tensor-parallel worker: rank 0 schedules, and every other rank runs the steps rank 0 sends it
    (``VllmRank``) instead of scheduling its own."""
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    ident = "splitserve-" + "".join(c if c.isalnum() else "-" for c in ranks.group_id)

    class SplitserveRanksExecutor(ExecutorWithExternalLauncher):
        def _distributed_args(self) -> tuple[str, int, int]:
            # env:// with the group's id after it: vLLM's CPU worker names the group's shared memory after the
            # part of the init method past its last ':'; torch's env:// rendezvous reads the environment only.
            return f"env://:{ident}", rank, rank

    return SplitserveRanksExecutor


# ---- a step on the plan channel: vLLM's scheduler output as msgpack, never pickled ----------------------------

_TUPLE, _SET, _SAMPLING = "__tuple__", "__set__", "__sampling_params__"
# Fields of vLLM's scheduler output that carry objects of features a tensor-parallel vLLM worker here does not
# run (multimodal inputs, LoRA, pooling, prompt embeddings, encoder caches): a step that uses one is refused.
_UNSUPPORTED_STEP = ("mm_features", "pooling_params", "lora_request", "prompt_embeds")


def _plain(value: Any, where: str) -> Any:
    """``value`` as msgpack's types, tuples and sets tagged; vLLM's ``SamplingParams`` as msgspec's bytes of it."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, tuple):
        return {_TUPLE: [_plain(v, where) for v in value]}
    if isinstance(value, set | frozenset):
        return {_SET: [_plain(v, where) for v in sorted(value)]}
    if isinstance(value, dict):
        return {str(k): _plain(v, where) for k, v in value.items()}
    if type(value).__name__ == "SamplingParams":
        import msgspec

        return {_SAMPLING: msgspec.msgpack.encode(value)}
    raise ValueError(f"{where}: a {type(value).__name__} cannot go to the other ranks (not supported with TP > 1)")


def _unplain(value: Any) -> Any:
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and _TUPLE in value:
            return tuple(_unplain(v) for v in value[_TUPLE])
        if len(value) == 1 and _SET in value:
            return {_unplain(v) for v in value[_SET]}
        if len(value) == 1 and _SAMPLING in value:
            import msgspec
            from vllm import SamplingParams

            return msgspec.msgpack.decode(value[_SAMPLING], type=SamplingParams)
        return {k: _unplain(v) for k, v in value.items()}
    return value


def _fields(obj: Any, where: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    import dataclasses

    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in skip:
            continue
        if f.name in _UNSUPPORTED_STEP and value:
            raise ValueError(f"{where}.{f.name}: not supported on a tensor-parallel vllm worker")
        out[f.name] = _plain(value, f"{where}.{f.name}")
    return out


def encode_step(output: Any, grammar: Any) -> bytes:
    """One step of rank 0's scheduler for the other ranks: its scheduler output as msgpack (plain values, the
    requests' ``SamplingParams`` by msgspec). The KV connector's metadata stays behind (each rank builds its own)."""
    import msgpack

    if grammar is not None:
        raise ValueError("grammar: structured output is not supported on a tensor-parallel vllm worker")
    body = _fields(output, "step", skip=("scheduled_new_reqs", "scheduled_cached_reqs", "kv_connector_metadata"))
    body["scheduled_new_reqs"] = [_fields(r, "step.new_request") for r in output.scheduled_new_reqs]
    body["scheduled_cached_reqs"] = _fields(output.scheduled_cached_reqs, "step.cached_requests")
    return msgpack.packb(body, use_bin_type=True)


def decode_step(payload: bytes, connector_metadata: Any = None) -> Any:
    """``encode_step``'s scheduler output, with this rank's KV connector metadata."""
    import msgpack
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    body = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    if not isinstance(body, dict):
        raise ValueError("payload: not a scheduler output")
    body = {k: _unplain(v) for k, v in body.items()}
    body["scheduled_new_reqs"] = [NewRequestData(**r) for r in body["scheduled_new_reqs"]]
    body["scheduled_cached_reqs"] = CachedRequestData(**body["scheduled_cached_reqs"])
    return SchedulerOutput(**body, kv_connector_metadata=connector_metadata)


def build_vllm(
    config: EngineConfig, role: str, engine_id: str, cpus: Iterable[int] | None, ranks: VllmRanks | None
) -> tuple[Any, bool]:
    """vLLM's ``LLMEngine`` for this engine config in this role (a rank of a tensor-parallel worker with
    ``ranks``); returns it and whether it publishes prefix-cache events."""
    for key, value in vllm_environment(config, cpus).items():
        os.environ.setdefault(key, value)
    size = config.tensor_parallel_size
    if size > 1:
        if ranks is None:
            raise ValueError("tensor_parallel_size: a tensor-parallel vllm worker needs its ranks' rendezvous")
        os.environ.update(ranks.environment(config.tensor_parallel_rank, size))
    import torch
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    # vLLM's CPU worker replaces torch.set_num_threads with a no-op once it binds its threads; the worker's
    # loop thread, which runs the model, sets its own thread count (OpenMP's is per thread), so it is kept.
    set_num_threads = torch.set_num_threads

    # engine.block_size is this package's page: vLLM's attention backends take their own (CPU: multiples of
    # 32), so vLLM picks its platform's unless vllm_args sets one; the block size in use is the model facts'.
    extra = dict(config.vllm_args or {})
    owned = sorted(_OWNED_ARGS & extra.keys())
    if owned:
        raise ValueError(f"vllm_args: {', '.join(owned)} set from the engine's own settings; set those instead")
    executor = model_process(config, role)
    args = {
        "model": config.model_dir,
        "dtype": config.dtype,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_prefix_caching": config.enable_prefix_caching,
        # Unset: the model's, or as long as the KV cache holds one request of (vLLM's auto-fit, -1), where
        # vLLM would otherwise refuse to start; this engine's own cache has no such floor.
        "max_model_len": config.max_model_len if config.max_model_len is not None else -1,
        "tensor_parallel_size": size,
        "distributed_executor_backend": ranks_executor(ranks, config.tensor_parallel_rank) if size > 1 else executor,
        "disable_log_stats": True,
        **extra,
    }
    if extra.get("enforce_eager", True):  # eager unless vllm_args asks otherwise: no minutes of compiling
        args["enforce_eager"] = True
        args.setdefault("compilation_config", {"mode": 0})
    if config.num_blocks is not None:
        args["num_gpu_blocks_override"] = config.num_blocks
    else:
        args["kv_cache_memory_bytes"] = config.kv_cache_bytes
    if role in ("prefill", "decode"):
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        args["kv_transfer_config"] = KVTransferConfig(**CONNECTOR, kv_role=kv_role, engine_id=engine_id)
        args["disable_hybrid_kv_cache_manager"] = True
    # Prefix-cache events for the router (prefill and colocated workers, which it routes by prefix): vLLM's
    # own events, translated to the router's hashes by VllmPrefixEvents; vllm_args may set its own publisher.
    wants_events = role in ("prefill", "colocated") and config.enable_prefix_caching
    if wants_events and "kv_events_config" not in extra:
        from vllm.config import KVEventsConfig

        args["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    if executor == "mp":
        args["worker_extension_cls"] = f"{__name__}.{ModelProcessExtension.__qualname__}"
    # The model process spawned for "mp" takes vLLM's own OpenMP setting (spin, then sleep: libgomp's default),
    # as under `vllm serve`, whatever OMP_WAIT_POLICY the worker's process has (a role's omp_wait_policy).
    wait_policy = os.environ.pop("OMP_WAIT_POLICY", None) if executor == "mp" else None
    try:
        llm = LLMEngine.from_engine_args(EngineArgs(**args))
    finally:
        torch.set_num_threads = set_num_threads
        if wait_policy is not None:
            os.environ["OMP_WAIT_POLICY"] = wait_policy
    if executor == "mp":
        llm.collective_rpc("splitserve_rewind_cpu_generators")
    else:
        rewind_cpu_generators(llm.engine_core.engine_core.model_executor.driver_worker.worker.model_runner)
    return llm, wants_events


def model_process(config: EngineConfig, role: str) -> str:
    """vLLM's executor for a worker of one rank: "mp" (vLLM's model runner in a process of its own, which vLLM
    spawns and ends, as `vllm serve` runs it on CPU) for a colocated CPU worker, else "uni" (in this process).

    On CPU the model's OpenMP threads take both of a worker's cores at every operator, so any other runnable thread
    of the worker's process (gRPC's, Ray's, the router contract's Python threads holding the GIL) stalls the whole
    forward; vLLM's CPU platform refuses its single-process executor for that reason. A prefill or decode worker
    keeps "uni": splitserve's KV connector reads and writes vLLM's KV cache in this process, where its pair
    groups are (docs/engine.md, "Where vLLM's model runs")."""
    return "mp" if config.device == "cpu" and role == "colocated" else "uni"


class ModelProcessExtension:
    """Methods vLLM mixes into its worker in the model process (``worker_extension_cls``), called there through
    ``collective_rpc`` by name."""

    def splitserve_rewind_cpu_generators(self) -> None:
        rewind_cpu_generators(self.model_runner)


def model_facts_of(llm: Any, model_dir: str) -> ModelFacts:
    vc = llm.vllm_config
    mc = vc.model_config
    return ModelFacts(
        vocab_size=mc.get_vocab_size(),
        num_layers=mc.get_num_layers(vc.parallel_config),
        num_kv_heads=mc.get_total_num_kv_heads(),
        head_dim=mc.get_head_size(),
        dtype=str(mc.dtype).removeprefix("torch."),
        weights_checksum=checkpoint_digest(model_dir),
        block_size=vc.cache_config.block_size,
    )


def rank_kv_region(llm: Any, config: EngineConfig, model: ModelFacts) -> KVCache:
    """This rank's part of vLLM's paged cache as one region: its KV heads (``kv_head_range``) of every layer."""
    runner = llm.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    heads = kv_head_range(model.num_kv_heads, config.tensor_parallel_size, config.tensor_parallel_rank)
    local = replace(model, num_kv_heads=heads.stop - heads.start)
    return vllm_kv_region(runner.kv_caches, local, llm.vllm_config.model_config.dtype)


def checkpoint_digest(model_dir: str) -> str:
    """A digest of the checkpoint's tensors as their files list them (names, dtypes, shapes, offsets) and
    of the files' sizes: the same folder gives the same digest on every worker without reading the weights
    a second time (vLLM loads them itself)."""
    digest = hashlib.sha256()
    for path in checkpoint_files(model_dir):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        digest.update(json.dumps(header, sort_keys=True).encode())
        digest.update(str(Path(path).stat().st_size).encode())
    return "vllm-" + digest.hexdigest()[:32]


class _StateRewind:
    """A CPU generator as vLLM's model runner rewinds it. vLLM discards the token it samples for a request whose
    prompt is still being prefilled (a partial chunk) and rewinds that request's generator by its Philox offset,
    which only CUDA generators have: on a CPU generator ``get_offset`` raises, failing the step. This stands in
    for the generator there and rewinds it by state instead, to where it was before the step sampled."""

    def __init__(self, generator: Any, state: Any) -> None:
        self.generator, self.state = generator, state

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        if self.state is not None:
            self.generator.set_state(self.state)


def rewind_cpu_generators(runner: Any) -> None:
    """Let vLLM's model runner rewind seeded CPU generators after a partial prefill chunk (``_StateRewind``): the
    generators' states are kept before each sampling, and the runner's bookkeeping, which rewinds the discarded
    requests' generators, sees the CPU ones through ``_StateRewind``. A seeded request then draws the same tokens
    however its prompt was chunked, as on CUDA."""
    sample, bookkeeping = runner._sample, runner._bookkeeping_sync
    states: dict[int, Any] = {}

    def _sample(*args: Any, **kwargs: Any) -> Any:
        states.clear()
        states.update({id(g): g.get_state() for g in runner.input_batch.generators.values() if g.device.type == "cpu"})
        return sample(*args, **kwargs)

    def _bookkeeping_sync(*args: Any, **kwargs: Any) -> Any:
        batch = runner.input_batch
        real = batch.generators
        batch.generators = {
            i: _StateRewind(g, states.get(id(g))) if g.device.type == "cpu" else g for i, g in real.items()
        }
        try:
            return bookkeeping(*args, **kwargs)
        finally:
            batch.generators = real
            states.clear()

    runner._sample, runner._bookkeeping_sync = _sample, _bookkeeping_sync


@dataclass(frozen=True)
class VllmStep:
    """A ``ScheduledStep`` of this engine: vLLM's scheduler output and the requests it scheduled."""

    output: Any  # vllm.v1.core.sched.output.SchedulerOutput; None: nothing to run
    requests: tuple[Request, ...] = ()
    sampling: tuple[Request, ...] = ()  # those whose step computes their last uncomputed token
    prompt_work: bool = False
    preempted: tuple[Request, ...] = field(default=())

    @property
    def is_empty(self) -> bool:
        return self.output is None


def vllm_kv_region(kv_caches: list, model: ModelFacts, dtype) -> KVCache:
    """vLLM's per-layer KV tensors as one region, when they are consecutive slices of one allocation (vLLM's CPU
    and GPU runners allocate them so): layer ``l``'s block ``b`` is row ``l * num_blocks + b``, one block's K and
    V of every head as vLLM's attention backend packs them. Raises ValueError when the layers are not laid out so."""
    import torch

    first = kv_caches[0]
    num_blocks = first.shape[0]
    row = first[0].numel()
    if row != 2 * model.num_kv_heads * model.block_size * model.head_dim:
        raise ValueError(f"kv_cache: vLLM's block of {row} elements is not 2 x heads x block_size x head_dim")
    # vLLM's CPU attention keeps a block as [kv_heads, block_size, 2 * head_dim]: heads outermost, which is what
    # moving part of a block's heads needs to know (a whole block moves as one run either way).
    heads_outer = tuple(first.shape[1:]) == (model.num_kv_heads, model.block_size, 2 * model.head_dim)
    for i, layer in enumerate(kv_caches):
        expected = first.data_ptr() + i * num_blocks * row * first.element_size()
        if not layer.is_contiguous() or layer.shape[0] != num_blocks or layer.data_ptr() != expected:
            raise ValueError("kv_cache: vLLM's layers are not consecutive slices of one allocation")
    spec = KVCacheSpec(
        len(kv_caches), model.num_kv_heads, model.head_dim, num_blocks, model.block_size, dtype, heads_outer
    )
    tensor = torch.empty(0, dtype=dtype, device=first.device)
    tensor.set_(first.untyped_storage(), first.storage_offset(), spec.shape)
    return KVCache.wrap(spec, tensor)


class VllmEngine:
    """vLLM's ``EngineCore`` in this process, on the worker's lock, for a worker of ``role``. ``wake`` wakes the
    worker's loop (a lease to admit, a hand-off to report)."""

    def __init__(
        self,
        config: EngineConfig,
        lock: threading.RLock,
        metrics: WorkerMetrics | None = None,
        cpus: Iterable[int] | None = None,
        role: str = "colocated",
        wake: Callable[[], None] | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        """``ranks``: this is rank 0 of a tensor-parallel worker whose other ranks run ``VllmRank``."""
        self.config, self.lock, self.metrics, self.role = config, lock, metrics, role
        # The worker loop's clock: schedule, run and apply are booked to their phases (worker_common.loop_clock).
        self.clock = metrics.loop if metrics is not None else LoopClock()
        self._wake = wake or (lambda: None)
        self._model_config = ModelConfig.from_model_dir(config.model_dir)
        self._engine_id = f"splitserve-{uuid.uuid4().hex[:12]}"
        self._link = None
        if role in ("prefill", "decode"):
            from splitserve.kv_transfer.vllm_connector import link_for

            self._link = link_for(self._engine_id)
        # Rank 0 of a tensor-parallel worker: vLLM's ranks meet where the worker's own group did, and every step
        # this engine schedules goes to the other ranks on the group's plan channel (``VllmRank`` runs it).
        self._ranks = ranks
        self._channel: PlanChannel | None = None
        vllm_ranks = None
        if config.tensor_parallel_size > 1:
            if ranks is None or ranks.rendezvous is None:
                raise ValueError("tensor_parallel_size: a tensor-parallel vllm worker needs its ranks (rank 0)")
            vllm_ranks = VllmRanks(*ranks.rendezvous, ranks.group_id)
        start = time.monotonic()
        self._llm, wants_events = build_vllm(config, role, self._engine_id, cpus, vllm_ranks)
        self._core = self._llm.engine_core.engine_core  # the in-process EngineCore
        self._scheduler = self._core.scheduler
        if ranks is not None:
            import torch

            self._channel = PlanChannel(ranks.group, torch.device(config.device))
        self._prefix: VllmPrefixEvents | None = None
        if wants_events:
            self._prefix = VllmPrefixEvents(config.block_size, inner=self._scheduler.kv_event_publisher)
            self._scheduler.kv_event_publisher = self._prefix
        self._model = model_facts_of(self._llm, config.model_dir)
        mc = self._llm.vllm_config.model_config
        self._max_model_len = mc.max_model_len
        self._region = rank_kv_region(self._llm, config, self._model) if self._link is not None else None
        self._requests: dict[str, Request] = {}  # vLLM's request id -> ours
        self._ids: dict[str, str] = {}  # our request id -> vLLM's
        self._unstarted: set[str] = set()  # vLLM ids not yet admitted
        self._leases: set[str] = set()  # decode: vLLM ids of leases whose KV has not landed
        self._in_step = False
        self._aborts: list[str] = []  # vLLM ids finished while a step ran: aborted before it applies
        logger.info(
            "vllm engine core in-process (%s): %s, %s, block_size %d, %d KV blocks, started in %.1f s",
            role,
            config.model_dir,
            self._model.dtype,
            self._model.block_size,
            self._scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
            time.monotonic() - start,
        )

    # ---- requests -------------------------------------------------------------------------------

    def _add(self, request: Request, token_ids: list[int], params: Any, transfer: dict | None) -> str:
        """Add to vLLM (lock held); returns vLLM's id for it."""
        if request.request_id in self._ids:
            raise ValueError(f"request_id: {request.request_id!r} is already in the engine")
        if transfer is not None:
            params.extra_args = {"kv_transfer_params": transfer}
        processor = self._llm.input_processor
        core_request = processor.process_inputs(
            request.request_id,
            {"prompt_token_ids": token_ids},
            params,
            supported_tasks=self._llm.get_supported_tasks(),
        )
        processor.assign_request_id(core_request)
        vllm_id = core_request.request_id
        if self._link is not None and self.role == "decode":
            self._link.expect_lease(vllm_id)
        self._llm.engine_core.add_request(core_request)
        self._requests[vllm_id] = request
        self._ids[request.request_id] = vllm_id
        self._unstarted.add(vllm_id)
        return vllm_id

    def add(self, request: Request) -> None:
        hand_off = self.role == "prefill"
        with self.lock:
            vllm_id = self._ids.get(request.request_id)
            if vllm_id is not None and vllm_id in self._leases:  # a decode worker prefills a leased request itself
                self.finish(request.request_id, FinishReason.ABORT)
            self._add(
                request,
                list(request.token_ids),
                vllm_sampling(request, hand_off=hand_off),
                {HAND_OFF_KEY: True} if hand_off else None,
            )
        self._wake()

    def add_running(self, request: Request) -> None:
        """The lease's KV landed: ``request`` carries its first token last."""
        with self.lock:
            vllm_id = self._ids.get(request.request_id)
            if vllm_id is None or vllm_id not in self._leases:
                raise ValueError(f"request_id: {request.request_id!r} holds no lease here")
            vllm_request = self._scheduler.requests[vllm_id]
            first = request.token_ids[-1]
            vllm_request.prompt_token_ids[-1] = first
            vllm_request._all_token_ids[-1] = first
            self._leases.discard(vllm_id)
            request.num_computed_tokens = request.num_tokens - 1
            self._requests[vllm_id] = request
            self._link.end_lease(vllm_id, report=True)
        self._wake()

    def finish(self, request_id: str, reason: FinishReason) -> None:
        with self.lock:
            vllm_id = self._ids.pop(request_id, None)
            if vllm_id is None:
                return
            request = self._requests.pop(vllm_id)
            self._unstarted.discard(vllm_id)
            if not request.is_finished:
                request.status, request.finish_reason = RequestStatus.FINISHED, reason
            lease = vllm_id in self._leases
            self._leases.discard(vllm_id)
            if self._in_step:
                self._aborts.append(vllm_id)
            else:
                self._core.abort_requests([vllm_id])
            if lease:  # vLLM keeps an aborted lease's blocks until the load is reported over
                self._link.end_lease(vllm_id, report=True)
            elif self._link is not None and self._link.release(vllm_id):
                pass  # a prefill's held blocks, reported sent
        self._wake()

    @property
    def num_running(self) -> int:
        with self.lock:
            return len(self._scheduler.running)

    @property
    def num_waiting(self) -> int:
        with self.lock:
            return len(self._scheduler.waiting) - len(self._leases)

    @property
    def num_preemptions(self) -> int:
        return 0  # vLLM preempts by recompute inside its scheduler; the worker never sees one

    # ---- the step -------------------------------------------------------------------------------

    def schedule(self) -> VllmStep:
        previous = self.clock.enter("schedule")
        with self.lock:
            step = self._schedule()
        self.clock.enter(previous)
        return step

    def _schedule(self) -> VllmStep:
        """``schedule``, the lock held. A pass that schedules nothing still runs the model runner (booked to
        ``run``) and applies its output (``apply``)."""
        for _ in range(2):  # a second pass schedules what the first one's connector report promoted
            if not self._scheduler.has_requests() and not (self._link is not None and self._link.pending()):
                return VllmStep(None)
            output = self._scheduler.schedule()
            if output.total_num_scheduled_tokens > 0:
                break
            # Nothing to compute, but the output carries finished requests to the model runner, and the
            # connector's report (KV landed, blocks sent) reaches the scheduler through it.
            self.clock.enter("run")
            model_output = self._execute(output)
            self.clock.enter("apply")
            self._apply(self._scheduler.update_from_output(output, model_output))
            self.clock.enter("schedule")
        else:
            return VllmStep(None)
        for new in output.scheduled_new_reqs:  # admitted: what the prefix cache gave it
            if new.req_id in self._unstarted:
                self._unstarted.discard(new.req_id)
                request = self._requests[new.req_id]
                if new.req_id not in self._leases:
                    request.num_cached_tokens = new.num_computed_tokens
        scheduled = output.num_scheduled_tokens
        ids = [i for i in scheduled if i in self._requests]
        vllm_requests = self._scheduler.requests
        final = [i for i in ids if vllm_requests[i].num_computed_tokens >= vllm_requests[i].num_tokens]
        self._in_step = True
        return VllmStep(
            output,
            tuple(self._requests[i] for i in ids),
            tuple(self._requests[i] for i in final),
            prompt_work=any(n > 1 for n in scheduled.values()),
        )

    def _execute(self, output: Any) -> Any:
        """Run vLLM's model on a scheduled output, as ``EngineCore.step`` does."""
        core = self._core
        if self._channel is not None:  # every rank runs the step: its forward joins this one's collectives
            grammar = self._scheduler.get_grammar_bitmask(output)
            self._channel.send(Foreign(encode_step(output, grammar)))
            model_output = core.model_executor.execute_model(output)
        else:
            future = core.model_executor.execute_model(output, non_block=True)
            grammar = self._scheduler.get_grammar_bitmask(output)
            model_output = future.result()
        if model_output is None:
            model_output = core.model_executor.sample_tokens(grammar)
        return model_output

    def run(
        self, step: VllmStep, kind: StepKind | None = None, on_layer_done: Callable[[int], None] | None = None
    ) -> StepResult:
        if not isinstance(step, VllmStep):
            raise TypeError(f"step: not a step of this engine: {type(step).__name__}")
        kind = kind or ("prefill" if step.prompt_work else "decode")
        if step.is_empty:
            return StepResult(kind, ())
        previous = self.clock.enter("run")
        start = time.monotonic()
        watched = on_layer_done is not None and self._link is not None
        if watched:  # the connector's save_kv_layer: each layer's KV goes out as the forward goes on
            self._link.watch_layers(on_layer_done)
        try:
            model_output = self._execute(step.output)
        finally:
            saved = self._link.layers_saved if watched else 0
            if watched:
                self._link.watch_layers(None)
            with self.lock:
                self._in_step = False
                aborts, self._aborts = self._aborts, []
                if aborts:
                    self._core.abort_requests(aborts)
        if on_layer_done is not None and saved < self._model.num_layers:  # layers vLLM did not report: all done
            for layers in range(saved + 1, self._model.num_layers + 1):
                on_layer_done(layers)
        if self.metrics is not None:
            output = step.output
            self.metrics.step(
                kind, time.monotonic() - start, len(output.num_scheduled_tokens), output.total_num_scheduled_tokens
            )
        self.clock.enter("apply")
        with self.lock:
            outputs = self._scheduler.update_from_output(step.output, model_output)
            advanced = self._apply(outputs)
        self._core.post_step(model_executed=True)
        self.clock.enter(previous)
        return StepResult(kind, advanced)

    def _apply(self, outputs: dict) -> tuple[Request, ...]:
        advanced = []
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                request = self._requests.get(out.request_id)
                if request is None or not out.new_token_ids:
                    continue  # finished by us already, or a step that sampled nothing for it
                request.status = RequestStatus.RUNNING
                self._logprobs(request, out)
                request.token_ids.extend(out.new_token_ids)
                request.num_computed_tokens = request.num_tokens - 1
                if out.finish_reason is not None:
                    request.status = RequestStatus.FINISHED
                    request.finish_reason = self._finish_reason(request, out.finish_reason.name)
                    request.stop_reason = out.stop_reason if request.finish_reason is not None else None
                    self._unstarted.discard(out.request_id)
                    if self.role != "prefill":  # a prefill's blocks stay held (the connector) until free()
                        del self._requests[out.request_id]
                        self._ids.pop(request.request_id, None)
                advanced.append(request)
        return tuple(advanced)

    def _logprobs(self, request: Request, out: Any) -> None:
        """The log-probabilities vLLM computed for this output, as our entries on the request."""
        sp = request.sampling
        if sp.logprobs is not None and out.new_logprobs is not None:
            lists = out.new_logprobs
            for i in range(len(out.new_token_ids)):
                entry = token_logprobs(
                    lists.logprob_token_ids[i], lists.logprobs[i], lists.sampled_token_ranks[i], sp.logprobs
                )
                request.logprobs.append(entry)
        prompt = out.new_prompt_logprobs_tensors
        if prompt is not None and request.prompt_logprobs is not None:
            ids, values = prompt.logprob_token_ids.tolist(), prompt.logprobs.tolist()
            ranks = prompt.selected_token_ranks.tolist()
            start = next((i for i, e in enumerate(request.prompt_logprobs) if i and e is None), None)
            for row in range(len(ids)):
                if start is None or start + row >= len(request.prompt_logprobs):
                    break
                k = sp.prompt_logprobs
                request.prompt_logprobs[start + row] = token_logprobs(ids[row], values[row], ranks[row], k)

    def _finish_reason(self, request: Request, name: str) -> FinishReason | None:
        """Ours for vLLM's; None for a prefill's request that only reached the cap at its first token."""
        reason = _FINISH.get(name, FinishReason.ABORT)
        if (
            self.role == "prefill"
            and reason is FinishReason.LENGTH
            and request.num_output_tokens < request.sampling.max_tokens
            and request.num_tokens < self._max_model_len
        ):
            return None  # it goes on on a decode worker
        return reason

    def step(self, kind: StepKind | None = None, on_layer_done: Callable[[int], None] | None = None) -> StepResult:
        return self.run(self.schedule(), kind, on_layer_done)

    # ---- KV blocks: vLLM's block pool ------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int, request: Request | None = None) -> bool:
        """A decode lease for ``request`` (prompt and earlier output; its first token comes with the KV)."""
        if self.role != "decode" or request is None:
            raise NotImplementedError("allocate: the vllm backend leases blocks on a decode worker, for a request")
        with self.lock:
            needed = -(-num_tokens // self._model.block_size)
            if self._scheduler.kv_cache_manager.block_pool.get_num_free_blocks() < needed + self._leased_blocks():
                return False
            tokens = [*request.token_ids, PLACEHOLDER_TOKEN]
            vllm_id = self._add(request, tokens, vllm_sampling(request, lease=True), {EXTERNAL_KEY: num_tokens - 1})
            self._leases.add(vllm_id)
        self._wake()
        return True

    def _leased_blocks(self) -> int:
        """Blocks that leases not yet admitted by vLLM's scheduler will take."""
        return sum(
            -(-self._requests[i].num_tokens // self._model.block_size)
            for i in self._leases
            if not self._link.is_admitted(i)
        )

    def block_table(self, request_id: str) -> list[int]:
        """A request's blocks; a decode lease's once vLLM's scheduler allocated them (waits up to
        ``LEASE_ADMIT_S`` on the loop thread, so never call it with the worker's lock held): [] if not."""
        with self.lock:
            vllm_id = self._ids.get(request_id)
            if vllm_id is None:
                return []
            lease = vllm_id in self._leases
            if not lease:
                held = self._link.held(vllm_id) if self._link is not None else None
                if held is not None:
                    return held
                return list(self._scheduler.kv_cache_manager.get_block_ids(vllm_id)[0])
        self._wake()
        return self._link.wait_lease(vllm_id, LEASE_ADMIT_S) or []

    def free(self, request_id: str) -> None:
        """Give back a lease, or a prefill's blocks held since its first token (its transfer ended)."""
        with self.lock:
            vllm_id = self._ids.get(request_id)
            if vllm_id is not None and self.role == "prefill" and self._link.held(vllm_id) is not None:
                del self._ids[request_id]
                self._requests.pop(vllm_id, None)
                self._link.release(vllm_id)
                self._wake()
                return
        self.finish(request_id, FinishReason.ABORT)

    @property
    def num_free_blocks(self) -> int:
        with self.lock:
            return self._scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def kv_figures(self) -> tuple[int, int, int]:
        with self.lock:
            pool = self._scheduler.kv_cache_manager.block_pool
            total = pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
            return total, total - pool.get_num_free_blocks(), len(pool.cached_block_hash_to_block)

    @property
    def kv_cache(self) -> KVCache:
        if self._region is None:
            raise NotImplementedError("kv_cache: a colocated vllm worker moves no KV")
        return self._region

    def cached_hashes(self) -> list[int]:
        """The router's hashes of the prompt blocks vLLM's prefix cache holds (``VllmPrefixEvents``)."""
        with self.lock:
            return self._prefix.cached_hashes() if self._prefix is not None else []

    def take_block_events(self) -> list[BlockEvent]:
        with self.lock:
            return self._prefix.take_events() if self._prefix is not None else []

    @property
    def prefix_block_size(self) -> int:
        return self.config.block_size

    # ---- model facts and checks -----------------------------------------------------------------

    @property
    def model(self) -> ModelFacts:
        return self._model

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def check_request(self, token_ids: list[int], sampling: SamplingParams) -> None:
        vocab = self._model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token_ids: {bad} is outside the vocabulary [0, {vocab})")
        sampling.validate(vocab)

    # ---- status ---------------------------------------------------------------------------------

    @property
    def decode_graphs(self) -> str:
        return ""

    # ---- tensor parallelism: vLLM's ranks, driven by this one ---------------------------------------

    @property
    def plan_channel(self) -> PlanChannel | None:
        return self._channel

    def keep_alive(self) -> None:
        channel = self._channel
        if channel is not None and time.monotonic() - channel.last_sent > self._ranks.group.timeout_s / 4:
            channel.tick()

    def group_broken(self, error: Exception) -> bool:
        return isinstance(error, CollectiveError) or (self._channel is not None and self._channel.broken)

    def close(self) -> None:
        if self._channel is not None:
            try:
                self._channel.close()  # the other ranks stop following
            except Exception as e:  # a broken group: the followers have failed already
                logger.warning("vllm engine: could not stop the other ranks: %s", e)
        self._llm.engine_core.shutdown()
        if self._link is not None:
            from splitserve.kv_transfer.vllm_connector import drop_link

            drop_link(self._engine_id)


class VllmRank:
    """Rank r > 0 of a tensor-parallel vLLM worker (``splitserve.worker_common.tp.follower`` runs it): vLLM's
    engine for the rank's shard, whose model runner runs the steps rank 0's scheduler made (``run``, from the
    plan channel's ``Foreign`` messages, in order); its own scheduler is never asked. Its KV heads of vLLM's
    paged cache are the region its KV sender or receiver moves, at rank 0's block ids (every rank's cache has
    the same blocks: the same size, over the same number of heads)."""

    def __init__(self, config: EngineConfig, role: str, ranks: VllmRanks, cpus: Iterable[int] | None = None) -> None:
        if config.tensor_parallel_rank < 1:
            raise ValueError("tensor_parallel_rank: rank 0 is the worker's own VllmEngine")
        import torch

        self.config, self.role = config, role
        engine_id = f"splitserve-{uuid.uuid4().hex[:12]}"
        self._link = None
        if role in ("prefill", "decode"):
            from splitserve.kv_transfer.vllm_connector import link_for

            self._link = link_for(engine_id)
        self._llm, _ = build_vllm(config, role, engine_id, cpus, ranks)
        self._executor = self._llm.engine_core.engine_core.model_executor
        self.model = model_facts_of(self._llm, config.model_dir)
        self.kv_cache = rank_kv_region(self._llm, config, self.model)
        self.device = torch.device(config.device)

    def run(self, payload: bytes, on_layer_done: Callable[[int], None] | None = None) -> int:
        """One step rank 0 scheduled: its forward joins rank 0's collectives; what it samples is rank 0's.
        ``on_layer_done(n)``: as the forward's layers write their KV (the sends it streams). Returns the layers
        reported so."""
        metadata = None
        if self._link is not None:
            from splitserve.kv_transfer.vllm_connector import SplitserveMetadata

            metadata = SplitserveMetadata()
        output = decode_step(payload, metadata)
        watched = on_layer_done is not None and self._link is not None
        if watched:
            self._link.watch_layers(on_layer_done)
        try:
            if self._executor.execute_model(output) is None:
                self._executor.sample_tokens(None)
        finally:
            saved = self._link.layers_saved if watched else 0
            if watched:
                self._link.watch_layers(None)
        return saved

    def close(self) -> None:
        self._llm.engine_core.shutdown()
        if self._link is not None:
            from splitserve.kv_transfer.vllm_connector import drop_link

            drop_link(self._llm.vllm_config.kv_transfer_config.engine_id)
