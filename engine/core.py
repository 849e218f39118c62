"""The parts every engine user builds: model, paged KV cache, block manager and model runner.

``LLM`` (offline), the prefill worker and the decode worker each wrap one ``EngineCore`` and differ
only in how they schedule and where tokens go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.kv_cache import KVCache, KVCacheSpec
from engine.linear_tuner import LINEAR_KERNELS, KernelPolicy
from engine.loader import build_model, parse_dtype
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    dtype: str = "auto"  # bfloat16 | float16 | float32 | auto (the checkpoint's)
    device: str = "cpu"  # cpu | cuda | cuda:N
    block_size: int = 16
    num_blocks: int | None = None  # default: as many as kv_cache_bytes holds
    kv_cache_bytes: int = 512 << 20
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    num_threads: int | None = None  # torch intra-op threads (CPU); None leaves torch's default
    # Which kernel the linear layers run (CPU; CUDA always runs cuBLAS): auto (timed per weight shape at load,
    # cached: engine/linear_tuner.py) | plain (F.linear) | packed (oneDNN prepacked) | split (both, by rows)
    linear_kernel: str = "auto"
    linear_split_allowed: bool | None = None  # auto may pick split (2x memory); None: when linear weights <= RAM/4
    pack_weights: bool = True  # False: linear_kernel plain (the older switch, kept for compatibility)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {self.num_blocks}")
        if self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes: must be >= 1, got {self.kv_cache_bytes}")
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ValueError(f"linear_kernel: must be one of {', '.join(LINEAR_KERNELS)}, got {self.linear_kernel!r}")
        if not self.pack_weights and self.linear_kernel not in ("auto", "plain"):
            raise ValueError(f"linear_kernel: {self.linear_kernel!r} contradicts pack_weights=False (plain)")
        if self.device.startswith("cuda") and self.linear_kernel in ("packed", "split"):
            raise ValueError(f"linear_kernel: {self.linear_kernel!r} is a CPU kernel; device is {self.device}")

    @property
    def kernel_policy(self) -> KernelPolicy:
        mode = self.linear_kernel if self.pack_weights else "plain"
        return KernelPolicy(mode, self.linear_split_allowed, lm_head_rows=self.max_num_seqs)


class EngineCore:
    def __init__(self, config: EngineConfig, record_block_events: bool = False) -> None:
        self.config = cfg = config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.model_config = ModelConfig.from_model_dir(cfg.model_dir)
        self.tokenizer = Tokenizer.from_model_dir(cfg.model_dir)
        self.dtype = parse_dtype(cfg.dtype, self.model_config.checkpoint_dtype)
        self.device = torch.device(cfg.device)
        self.model, self.weights_checksum = build_model(self.model_config, cfg.model_dir, self.dtype, self.device,
                                                        cfg.kernel_policy)  # fmt: skip
        per_block = KVCacheSpec.for_model(self.model_config, 1, cfg.block_size, self.dtype).bytes_per_block
        num_blocks = cfg.num_blocks or max(1, cfg.kv_cache_bytes // per_block)
        self.kv_cache = KVCache(KVCacheSpec.for_model(self.model_config, num_blocks, cfg.block_size, self.dtype),
                                self.device)  # fmt: skip
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching, record_block_events)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids or self.model_config.eos_token_ids)
        self.max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        self.runner = ModelRunner(self.model, self.kv_cache, self.blocks, Sampler(self.eos_token_ids))

    def make_scheduler(self, **mode) -> Scheduler:
        cfg = self.config
        scheduler_config = SchedulerConfig(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                           prefill_chunk_size=cfg.prefill_chunk_size, max_model_len=self.max_model_len,
                                           **mode)  # fmt: skip
        return Scheduler(scheduler_config, self.blocks, self.eos_token_ids)

    def check_request(self, token_ids: list[int], sampling: SamplingParams) -> None:
        """Raise ValueError naming the field when the engine cannot take this request."""
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token_ids: {bad} is outside the vocabulary [0, {vocab})")
        sampling.validate(vocab)
