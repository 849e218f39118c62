"""The parts every engine user builds: model, paged KV cache, block manager and model runner.

``LLM`` (offline), the prefill worker and the decode worker each wrap one ``EngineCore`` and differ
only in how they schedule and where tokens go.

A tensor-parallel engine is one ``EngineCore`` per rank, each given the ranks' ``TPGroup``: every rank
holds its shard of the model and a KV cache of its KV heads, and all of them run the same steps in
lockstep (the scheduler is deterministic and the logits, with the LM head replicated, identical).
With ``tensor_parallel_step="plan"`` rank 0 drives instead: it alone schedules and samples, and sends each
step's plan to the other ranks (followers: no block manager, no scheduler; ``splitserve.engine.tp.step``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from splitserve.common.arith import ceil_div
from splitserve.common.validate import check_choice, check_range, check_ranges
from splitserve.engine.allocator import ALLOCATOR_MODES
from splitserve.engine.allocator import install as install_block_cache
from splitserve.engine.attention import cpu_paged_prefill
from splitserve.engine.attention.paged_decode import PagedDecodeBackend, select_backend
from splitserve.engine.hardware import cpu_isa, native_bf16
from splitserve.engine.kv_cache.block_manager import BlockManager
from splitserve.engine.kv_cache.cache import KVCache, KVCacheSpec
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.linear_tuner import LINEAR_KERNELS, KernelPolicy, summarize
from splitserve.engine.model.loader import build_model, canonical_dtype, parse_dtype
from splitserve.engine.runner.cuda_graphs import CaptureStats, CudaGraphBackend
from splitserve.engine.runner.model_runner import ModelRunner
from splitserve.engine.runner.static_decode import StaticDecodeInputs, batch_buckets
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.sampling.sampler import Sampler
from splitserve.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.engine.tp.distributed import TPGroup
from splitserve.engine.tp.shard import TPShard
from splitserve.engine.tp.step import PlanChannel

log = logging.getLogger(__name__)

# The decode attention of the dynamic path (every step that is not a static one). The label names the
# package (the gather lives in attention/paged_attention.py): reports compare it across runs.
DYNAMIC_DECODE_BACKEND = "gather (splitserve.engine.attention)"

DECODE_PATHS = ("auto", "dynamic", "static")
DYNAMIC_DECODE_ATTENTION = ("in_place", "gather")
PREFILL_ATTENTION = ("in_place", "sdpa")
TP_STEPS = ("lockstep", "plan")
ENGINE_BACKENDS = ("splitserve", "vllm")


@dataclass(frozen=True)
class EngineSettings:
    """The engine's knobs a deployment sets once for every role (the deployment config's ``engine:``)."""

    block_size: int = 16  # tokens per KV block: the unit of paging, prefix caching and transfer
    num_blocks: int | None = None  # default: as many as kv_cache_bytes holds
    kv_cache_bytes: int = 512 << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int | None = None  # default: max_num_batched_tokens
    # The longest prompt plus output a request may have; default: the model's max_position_embeddings (the vllm
    # backend: the model's, or as long as the KV cache holds one request of).
    max_model_len: int | None = None
    # Reuse the KV of cached prompt prefixes (prefill and colocated workers; a decode worker's requests arrive
    # with their KV, so it never has one).
    enable_prefix_caching: bool = True
    # Which kernel the linear layers run (CPU; CUDA always runs cuBLAS): auto (timed per weight shape at load,
    # cached: engine/model/linear_tuner.py) | plain (F.linear) | packed (oneDNN prepacked) | split (both, by rows)
    # | and for bf16 weights computed in float32: upcast (bf16 kept) | fp32 (a float32 copy) | fp32-packed
    linear_kernel: str = "auto"
    linear_split_allowed: bool | None = None  # auto may pick split (2x memory); None: when linear weights <= RAM/4
    # auto may keep a float32 copy of a bf16 weight (fp32, fp32-packed: 2x memory); None: when the linear
    # weights in float32 take <= RAM/4
    linear_fp32_weights: bool | None = None
    # Decode-only steps: "static" pads the batch to a bucket in persistent buffers (engine/runner/static_decode.py),
    # "dynamic" runs them as every other step; "auto": static on CUDA, dynamic on CPU (static measured no
    # faster there, with the CPU kernel on both paths: docs/performance.md).
    decode_path: str = "auto"
    # The decodes of dynamic steps: "in_place" attends them through their block tables with the preferred
    # paged_decode backend that reads the cache in place (the CPU kernel, Triton on CUDA; the gather where
    # none is available for the device and dtype), "gather" copies their blocks out first (the older path).
    dynamic_decode_attention: str = "in_place"
    # Prefill chunks: "in_place" attends each chunk to its context read from the cache by the CPU prefill kernel
    # where it serves (float32, a build with AVX-512: engine/attention/cpu_paged_prefill.py; SDPA elsewhere, the
    # reason logged), "sdpa" always runs torch's SDPA (over a gathered context for a later chunk).
    prefill_attention: str = "in_place"
    cuda_graphs: bool = True  # CUDA with the static path: capture each bucket's decode step at start-up
    # A tensor-parallel worker's ranks: a collective (or a follower's wait for rank 0's next message) that
    # takes longer fails the whole worker, so a dead or stalled rank is noticed within this; an idle rank 0
    # ticks its ranks at a quarter of it.
    tensor_parallel_timeout_s: float = 10.0
    # Which engine the workers run (docs/engine.md): "splitserve" (this package) or "vllm" (vLLM's engine core
    # in the worker's process: `make setup-vllm`); a role may set its own (its section's `backend`).
    backend: str = "splitserve"
    # The vllm backend only: more of vLLM's EngineArgs (e.g. {"enforce_eager": false} to compile the model);
    # the ones these settings already decide (dtype, block_size, max_num_seqs, ...) are refused.
    vllm_args: dict | None = None
    # The splitserve engine on the CPU: "cache" keeps the large blocks a step frees for the next step (torch's
    # CPU allocator replaced, for the process: engine/allocator.py), "default" leaves torch's allocator as it is.
    cpu_allocator: str = "cache"

    def __post_init__(self) -> None:
        check_choice(self, "decode_path", DECODE_PATHS)
        check_choice(self, "cpu_allocator", ALLOCATOR_MODES)
        check_choice(self, "dynamic_decode_attention", DYNAMIC_DECODE_ATTENTION)
        check_choice(self, "prefill_attention", PREFILL_ATTENTION)
        check_choice(self, "backend", ENGINE_BACKENDS)
        if self.vllm_args is not None and not (
            isinstance(self.vllm_args, dict) and all(isinstance(k, str) for k in self.vllm_args)
        ):
            raise ValueError(f"vllm_args: must map vLLM EngineArgs names to values, got {self.vllm_args!r}")
        check_ranges(self, ("block_size", "num_blocks", "kv_cache_bytes", "max_model_len"), min=1)
        check_range(self, "tensor_parallel_timeout_s", above=0)
        check_choice(self, "linear_kernel", LINEAR_KERNELS)


@dataclass(frozen=True)
class EngineConfig(EngineSettings):
    """Everything an ``EngineCore`` is built from: the settings, and what each process adds (the model,
    its dtype and device, threads)."""

    model_dir: str = field(kw_only=True)
    dtype: str = "auto"  # bfloat16 | float16 | float32 | auto (the checkpoint's)
    device: str = "cpu"  # cpu | cuda | cuda:N
    num_threads: int | None = None  # torch intra-op threads (CPU); None leaves torch's default
    pack_weights: bool = True  # False: linear_kernel plain (the older switch, kept for compatibility)
    # This process is rank tensor_parallel_rank of a tensor-parallel engine of tensor_parallel_size ranks
    # (its TPGroup is handed to EngineCore: a group cannot live in a frozen config).
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    # How the ranks agree on each step: "lockstep" (every rank schedules, deterministically) or "plan" (rank 0
    # alone schedules, samples and sends each step's plan; the other ranks own no scheduler or block manager
    # and run splitserve.engine.tp.step.follow).
    tensor_parallel_step: str = "lockstep"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self, "tensor_parallel_step", TP_STEPS)
        check_range(self, "tensor_parallel_size", min=1)
        check_range(self, "tensor_parallel_rank", min=0, max=self.tensor_parallel_size - 1)
        if not self.pack_weights and self.linear_kernel not in ("auto", "plain"):
            raise ValueError(f"linear_kernel: {self.linear_kernel!r} contradicts pack_weights=False (plain)")
        if self.device.startswith("cuda") and self.linear_kernel not in ("auto", "plain"):
            raise ValueError(f"linear_kernel: {self.linear_kernel!r} is a CPU kernel; device is {self.device}")

    @property
    def kernel_policy(self) -> KernelPolicy:
        mode = self.linear_kernel if self.pack_weights else "plain"
        return KernelPolicy(
            mode, self.linear_split_allowed, lm_head_rows=self.max_num_seqs, allow_fp32_weights=self.linear_fp32_weights
        )


class EngineCore:
    def __init__(
        self, config: EngineConfig, record_block_events: bool = False, tp_group: TPGroup | None = None
    ) -> None:
        """``tp_group``: the ranks' group, required when ``config.tensor_parallel_size`` > 1 (one of size 1 is
        ignored: the unsharded engine runs no collective)."""
        self.config = cfg = config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.model_config = ModelConfig.from_model_dir(cfg.model_dir)
        self.tp_group = self._check_tp_group(tp_group)
        self.tokenizer = Tokenizer.from_model_dir(cfg.model_dir)
        self.dtype = parse_dtype(cfg.dtype, self.model_config.checkpoint_dtype)
        self.device = torch.device(cfg.device)
        self.model, self.weights_checksum = build_model(
            self.model_config,
            cfg.model_dir,
            self.dtype,
            self.device,
            cfg.kernel_policy,
            self.tp_group,
            auto_float32=self.auto_float32_applies(),
        )
        # --dtype auto may compute a bf16 checkpoint in float32 (no native bf16): the model's dtype is the engine's.
        self.dtype = self.model.embed_tokens.weight.dtype
        # After the load, whose temporaries go back to the system as before: the steps' are kept from here on.
        self.allocator = "default"
        if self.device.type == "cpu" and cfg.cpu_allocator == "cache":
            self.allocator = install_block_cache()
        tp = (cfg.tensor_parallel_size, cfg.tensor_parallel_rank)
        per_block = KVCacheSpec.for_model(self.model_config, 1, cfg.block_size, self.dtype, *tp).bytes_per_block
        num_blocks = cfg.num_blocks or max(1, cfg.kv_cache_bytes // per_block)
        self.decode_path = self.resolve_decode_path()
        self.static_decode = self.decode_path == "static"
        # The decode attention: on the static path its paged_decode backend; on the dynamic path the preferred
        # backend that reads the cache in place (the CPU kernel, Triton on CUDA), or the gather where only the
        # reference is available here (a float16 CPU cache; the CPU kernel not built).
        in_place = self.dynamic_decode_attention()
        self.dynamic_decode_backend = DYNAMIC_DECODE_BACKEND if in_place is None else f"paged_decode {in_place.name}"
        self.decode_backend = self.dynamic_decode_backend  # the static path's replaces it (_static_decode_inputs)
        prefill_attention = self.resolve_prefill_attention()
        self.prefill_backend = "sdpa" if prefill_attention is None else "paged_prefill cpu"
        # The static path's padding rows write to one scratch block past those the block manager owns.
        cache_blocks = num_blocks + 1 if self.static_decode else num_blocks
        cache_spec = KVCacheSpec.for_model(self.model_config, cache_blocks, cfg.block_size, self.dtype, *tp)
        self.kv_cache = KVCache(cache_spec, self.device)
        # A follower's blocks are rank 0's: it holds the cache of its heads and runs the plans it is sent.
        self.blocks = (
            None
            if self.is_follower
            else BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching, record_block_events)
        )
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids or self.model_config.eos_token_ids)
        self.max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        static = self._static_decode_inputs(scratch_block=num_blocks) if self.static_decode else None
        channel = PlanChannel(self.tp_group, self.device) if self.drives_followers else None
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            self.blocks,
            Sampler(self.eos_token_ids),
            static,
            channel=channel,
            decode_attention=None if in_place is None else in_place.fn,
            prefill_attention=prefill_attention,
        )
        self.graph_stats: CaptureStats | None = None
        # Collectives inside captured graphs are not validated yet: a tensor-parallel engine decodes eagerly.
        if static is not None and cfg.cuda_graphs and self.device.type == "cuda" and self.tp_group is None:
            try:
                self.graph_stats = self.runner.capture_decode_graphs(CudaGraphBackend(self.device))
            except RuntimeError as e:  # an op that cannot be captured: run the static path eagerly
                log.warning("decode CUDA graphs: capture failed, decoding without graphs: %s", e)
                self.runner.graphs = None

    def _check_tp_group(self, group: TPGroup | None) -> TPGroup | None:
        """The group the model uses (None unsharded), once the model is known to split into the configured
        shards (errors name ``tensor_parallel_size``) and ``group`` is that rank's."""
        cfg = self.config
        size, rank = cfg.tensor_parallel_size, cfg.tensor_parallel_rank
        TPShard.for_model(self.model_config, size, rank)
        if group is None:
            if size > 1:
                raise ValueError(f"tp_group: tensor_parallel_size {size} needs the ranks' TPGroup, got none")
            return None
        if (group.size, group.rank) != (size, rank):
            raise ValueError(
                f"tp_group: rank {group.rank} of {group.size} does not match tensor_parallel_rank {rank} "
                f"of tensor_parallel_size {size}"
            )
        return group if size > 1 else None

    @property
    def plan_steps(self) -> bool:
        """Rank 0 drives: a tensor-parallel engine (more than one rank) with ``tensor_parallel_step="plan"``."""
        return self.tp_group is not None and self.config.tensor_parallel_step == "plan"

    @property
    def drives_followers(self) -> bool:
        return self.plan_steps and self.tp_group.rank == 0

    @property
    def is_follower(self) -> bool:
        return self.plan_steps and self.tp_group.rank > 0

    def close(self) -> None:
        """Rank 0 that drives: end the followers' loops (Stop). Idempotent; nothing to do otherwise."""
        if self.runner.channel is not None:
            self.runner.channel.close()

    def auto_float32_applies(self) -> bool:
        """``dtype="auto"`` on a bf16 checkpoint, on a CPU without native bf16 (``engine/hardware.py``'s flags,
        or ``$SPLITSERVE_CPU_ISA``'s): the loader may then compute in float32 (docs/engine.md, "dtypes")."""
        if canonical_dtype(self.config.dtype) != "auto" or self.dtype != torch.bfloat16 or self.device.type != "cpu":
            return False
        return not native_bf16(cpu_isa())

    @property
    def linear_kernels(self) -> str:
        """The compute dtype and each linear shape's kernel on one line, for status (``splitserve status``)."""
        note = f" ({self.model.dtype_note})" if self.model.dtype_note else ""
        choices = getattr(self.model, "kernel_choices", None) or {}
        return f"{str(self.dtype).removeprefix('torch.')}{note}; " + summarize(choices)

    def resolve_decode_path(self) -> str:
        """ "static" or "dynamic" for this engine's device (see ``EngineConfig.decode_path``). A plan carries
        the dynamic path's inputs only, so an engine whose rank 0 drives decodes dynamically."""
        if self.plan_steps:
            return "dynamic"
        if self.config.decode_path != "auto":
            return self.config.decode_path
        return "static" if self.device.type == "cuda" else "dynamic"

    def dynamic_decode_attention(self) -> PagedDecodeBackend | None:
        """The paged_decode backend the dynamic path attends its decodes with, reading the cache in place; None
        when the preferred one here is the reference (``paged_decode_torch`` gathers as the dynamic path's own
        gather does, over every row's padded table: no gain) or ``dynamic_decode_attention`` is "gather"."""
        if self.config.dynamic_decode_attention == "gather":
            return None
        backend = select_backend(self.device, self.dtype)
        return None if backend.name == "torch" else backend

    def resolve_prefill_attention(self) -> cpu_paged_prefill.PagedPrefillFn | None:
        """The kernel prefill chunks are attended with (None: SDPA); why not, logged once per engine."""
        if self.config.prefill_attention == "sdpa":
            return None
        reason = cpu_paged_prefill.unavailable_reason(self.device, self.dtype, self.model_config.head_dim)
        if reason is not None:
            log.info("prefill attention: SDPA (the CPU prefill kernel does not serve here: %s)", reason)
            return None
        log.info("prefill attention: the CPU prefill kernel, reading the cache in place")
        return cpu_paged_prefill.paged_prefill_cpu

    def _static_decode_inputs(self, scratch_block: int) -> StaticDecodeInputs:
        cfg = self.config
        backend = select_backend(self.device, self.dtype)
        self.decode_backend = f"paged_decode {backend.name}"
        buckets = batch_buckets(cfg.max_num_seqs)
        max_blocks_per_seq = ceil_div(self.max_model_len, cfg.block_size)
        log.info(
            "static decode path: buckets %s, %d blocks per sequence, paged decode backend %r",
            buckets,
            max_blocks_per_seq,
            backend.name,
        )
        return StaticDecodeInputs(buckets, max_blocks_per_seq, cfg.block_size, scratch_block, self.device, backend.fn)

    @property
    def decode_graphs(self) -> str:
        """The captured decode graphs in one line for status ("" when there are none, as on CPU)."""
        return "" if self.graph_stats is None else self.graph_stats.summary()

    def make_scheduler(self, **mode) -> Scheduler:
        cfg = self.config
        if self.is_follower:
            raise ValueError(
                f"tensor_parallel_rank: rank {cfg.tensor_parallel_rank} follows rank 0's plans "
                "(splitserve.engine.tp.step.follow) and has no scheduler"
            )
        scheduler_config = SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            prefill_chunk_size=cfg.prefill_chunk_size,
            max_model_len=self.max_model_len,
            **mode,
        )
        return Scheduler(scheduler_config, self.blocks, self.eos_token_ids)

    def check_request(self, token_ids: list[int], sampling: SamplingParams) -> None:
        """Raise ValueError naming the field when the engine cannot take this request."""
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token_ids: {bad} is outside the vocabulary [0, {vocab})")
        sampling.validate(vocab)
