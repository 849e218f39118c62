"""``VllmEngine``: vLLM's engine core, in this process, behind the workers' ``Engine`` interface
(``splitserve.worker_common.engine_api``), for ``engine.backend: vllm`` (docs/engine.md).

The worker keeps everything it has on the splitserve backend: its gRPC service, status, metrics, health,
drain, cancel and the router contract. Only the engine changes: vLLM's ``EngineCore`` (its scheduler, KV
cache manager, model runner and sampler) runs in the worker's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
the single-process executor), on the worker's cores, with no HTTP server and no placement group of its own.

One step, as the worker takes it, maps onto vLLM's own step (``EngineCore.step``):

    schedule()  ->  scheduler.schedule()                       (under the worker's lock)
    run()       ->  executor.execute_model / sample_tokens     (no lock: the model runs)
                    scheduler.update_from_output               (under the lock)

Requests stay this repository's ``Request`` objects: the engine appends the tokens vLLM sampled and sets the
finish reason, so the worker streams them exactly as it does its own engine's. vLLM sees token ids only (the
router detokenizes and matches stop strings, for both backends), and a request's sampling parameters map
one to one (``vllm_sampling``). A request finished while its step runs (a cancel) is aborted after the model
returns and before the results apply, as ``EngineCore`` does with aborts that arrive mid-step.

vllm is imported only here, and only when a worker builds this engine: ``import splitserve`` and the router
never import it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.engine.core import EngineConfig
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.loader import checkpoint_files
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.scheduler.request import FinishReason, Request, RequestStatus
from splitserve.engine.tp.step import PlanChannel
from splitserve.worker_common.engine_api import ModelFacts, StepKind, StepResult
from splitserve.worker_common.metrics import WorkerMetrics

logger = logging.getLogger(__name__)

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
    }
)


def vllm_sampling(request: Request) -> Any:
    """The request's sampling parameters as vLLM's ``SamplingParams``, meaning the same as ours: the seed is
    the request's effective seed (so an unseeded request is as random on both backends, and a seeded one
    repeats on each, not across them); a request resumed with output tokens asks for the tokens it still
    lacks. Stop strings are the router's on both backends, so vLLM never sees them."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp: SamplingParams = request.sampling
    done = request.num_output_tokens
    return VllmSamplingParams(
        n=1,
        max_tokens=max(1, sp.max_tokens - done),
        min_tokens=max(0, sp.min_tokens - done),
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
    )


def vllm_environment(config: EngineConfig, cpus: Iterable[int] | None) -> dict[str, str]:
    """The environment vLLM reads at import and start-up, for a worker of this config on these cores: the
    engine core in this process, vLLM's OpenMP threads bound to the worker's cores (all of them: vLLM's
    default keeps one for a front end this worker does not run), its CPU platform on a CPU device. Values
    the operator set already are kept."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if config.device == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
        cores = sorted(cpus) if cpus is not None else sorted(os.sched_getaffinity(0))
        if config.num_threads:
            cores = cores[: config.num_threads]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores)
    return env


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


@dataclass(frozen=True)
class VllmStep:
    """A ``ScheduledStep`` of this engine: vLLM's scheduler output and the requests it scheduled."""

    output: Any  # vllm.v1.core.sched.output.SchedulerOutput; None: nothing to run
    requests: tuple[Request, ...] = ()
    prompt_work: bool = False
    preempted: tuple[Request, ...] = field(default=())

    @property
    def is_empty(self) -> bool:
        return self.output is None

    @property
    def sampling(self) -> tuple[Request, ...]:
        return self.requests  # vLLM samples every scheduled request; a partial prefill's token is dropped


class VllmEngine:
    """vLLM's ``EngineCore`` in this process, on the worker's lock. Built by ``VllmEngine.build``."""

    def __init__(
        self,
        config: EngineConfig,
        lock: threading.RLock,
        metrics: WorkerMetrics | None = None,
        cpus: Iterable[int] | None = None,
    ) -> None:
        if config.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size: the vllm backend runs one process per worker here (TP 1)")
        self.config, self.lock, self.metrics = config, lock, metrics
        self._model_config = ModelConfig.from_model_dir(config.model_dir)
        for key, value in vllm_environment(config, cpus).items():
            os.environ.setdefault(key, value)
        import torch
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
        args = {
            "model": config.model_dir,
            "dtype": config.dtype,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "enable_prefix_caching": config.enable_prefix_caching,
            "max_model_len": config.max_model_len,
            "tensor_parallel_size": 1,
            "distributed_executor_backend": "uni",
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
        start = time.monotonic()
        try:
            self._llm = LLMEngine.from_engine_args(EngineArgs(**args))
        finally:
            torch.set_num_threads = set_num_threads
        self._core = self._llm.engine_core.engine_core  # the in-process EngineCore
        self._scheduler = self._core.scheduler
        vc = self._llm.vllm_config
        mc = vc.model_config
        self._model = ModelFacts(
            vocab_size=mc.get_vocab_size(),
            num_layers=mc.get_num_layers(vc.parallel_config),
            num_kv_heads=mc.get_total_num_kv_heads(),
            head_dim=mc.get_head_size(),
            dtype=str(mc.dtype).removeprefix("torch."),
            weights_checksum=checkpoint_digest(config.model_dir),
            block_size=vc.cache_config.block_size,
        )
        self._max_model_len = mc.max_model_len
        self._requests: dict[str, Request] = {}  # vLLM's request id -> ours
        self._ids: dict[str, str] = {}  # our request id -> vLLM's
        self._unstarted: set[str] = set()  # vLLM ids not yet admitted
        self._in_step = False
        self._aborts: list[str] = []  # vLLM ids finished while a step ran: aborted before it applies
        logger.info(
            "vllm engine core in-process: %s, %s, block_size %d, %d KV blocks, started in %.1f s",
            config.model_dir,
            self._model.dtype,
            self._model.block_size,
            self._scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
            time.monotonic() - start,
        )

    # ---- requests -------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        with self.lock:
            if request.request_id in self._ids:
                raise ValueError(f"request_id: {request.request_id!r} is already in the engine")
            processor = self._llm.input_processor
            core_request = processor.process_inputs(
                request.request_id,
                {"prompt_token_ids": list(request.token_ids)},
                vllm_sampling(request),
                supported_tasks=self._llm.get_supported_tasks(),
            )
            processor.assign_request_id(core_request)
            self._llm.engine_core.add_request(core_request)
            self._requests[core_request.request_id] = request
            self._ids[request.request_id] = core_request.request_id
            self._unstarted.add(core_request.request_id)

    def add_running(self, request: Request) -> None:
        raise NotImplementedError("add_running: the vllm backend receives KV through its connector")

    def finish(self, request_id: str, reason: FinishReason) -> None:
        with self.lock:
            vllm_id = self._ids.pop(request_id, None)
            if vllm_id is None:
                return
            request = self._requests.pop(vllm_id)
            self._unstarted.discard(vllm_id)
            if not request.is_finished:
                request.status, request.finish_reason = RequestStatus.FINISHED, reason
            if self._in_step:
                self._aborts.append(vllm_id)
            else:
                self._core.abort_requests([vllm_id])

    @property
    def num_running(self) -> int:
        with self.lock:
            return len(self._scheduler.running)

    @property
    def num_waiting(self) -> int:
        with self.lock:
            return len(self._scheduler.waiting)

    @property
    def num_preemptions(self) -> int:
        return 0  # vLLM preempts by recompute inside its scheduler; the worker never sees one

    # ---- the step -------------------------------------------------------------------------------

    def schedule(self) -> VllmStep:
        with self.lock:
            if not self._scheduler.has_requests():
                return VllmStep(None)
            output = self._scheduler.schedule()
            if output.total_num_scheduled_tokens == 0:
                # Nothing to compute, but the output carries finished requests to the model runner.
                self._execute(output)
                return VllmStep(None)
            for new in output.scheduled_new_reqs:  # admitted: what the prefix cache gave it
                if new.req_id in self._unstarted:
                    self._unstarted.discard(new.req_id)
                    self._requests[new.req_id].num_cached_tokens = new.num_computed_tokens
            scheduled = output.num_scheduled_tokens
            requests = tuple(self._requests[i] for i in scheduled if i in self._requests)
            self._in_step = True
            return VllmStep(output, requests, prompt_work=any(n > 1 for n in scheduled.values()))

    def _execute(self, output: Any) -> Any:
        """Run vLLM's model on a scheduled output and apply it, as ``EngineCore.step`` does (lock held by the
        caller around the apply)."""
        core = self._core
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
        start = time.monotonic()
        try:
            model_output = self._execute(step.output)
        finally:
            with self.lock:
                self._in_step = False
                aborts, self._aborts = self._aborts, []
                if aborts:
                    self._core.abort_requests(aborts)
        if self.metrics is not None:
            self.metrics.step(
                kind,
                time.monotonic() - start,
                len(step.output.num_scheduled_tokens),
                step.output.total_num_scheduled_tokens,
            )
        with self.lock:
            outputs = self._scheduler.update_from_output(step.output, model_output)
            advanced = self._apply(outputs)
        self._core.post_step(model_executed=True)
        return StepResult(kind, advanced)

    def _apply(self, outputs: dict) -> tuple[Request, ...]:
        advanced = []
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                request = self._requests.get(out.request_id)
                if request is None or not out.new_token_ids:
                    continue  # finished by us already, or a step that sampled nothing for it
                request.status = RequestStatus.RUNNING
                request.token_ids.extend(out.new_token_ids)
                request.num_computed_tokens = request.num_tokens - 1
                if out.finish_reason is not None:
                    request.status = RequestStatus.FINISHED
                    request.finish_reason = _FINISH[out.finish_reason.name]
                    request.stop_reason = out.stop_reason
                    del self._requests[out.request_id]
                    self._unstarted.discard(out.request_id)
                    self._ids.pop(request.request_id, None)
                advanced.append(request)
        return tuple(advanced)

    def step(self, kind: StepKind | None = None, on_layer_done: Callable[[int], None] | None = None) -> StepResult:
        return self.run(self.schedule(), kind, on_layer_done)

    # ---- KV blocks: vLLM's block pool ------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        raise NotImplementedError("allocate: the vllm backend's blocks are its scheduler's")

    def block_table(self, request_id: str) -> list[int]:
        raise NotImplementedError("block_table: the vllm backend's blocks are its scheduler's")

    def free(self, request_id: str) -> None:
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
    def kv_cache(self):
        raise NotImplementedError("kv_cache: the vllm backend's KV is moved by its connector")

    def cached_hashes(self) -> list[int]:
        return []  # vLLM's prefix cache hashes blocks its own way: the router routes these workers by load

    def take_block_events(self) -> list:
        return []

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

    # ---- tensor parallelism: none of ours (vLLM runs its own ranks) ------------------------------

    @property
    def plan_channel(self) -> PlanChannel | None:
        return None

    def keep_alive(self) -> None:
        pass

    def group_broken(self, error: Exception) -> bool:
        return False

    def close(self) -> None:
        self._llm.engine_core.shutdown()
