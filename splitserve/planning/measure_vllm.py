"""``splitserve profile --backend vllm``: the steps of a worker on the vllm engine backend, measured as that
worker takes them (``worker_common.vllm_engine.VllmEngine``: vLLM's scheduler, model runner and sampler in this
process, ``schedule`` then ``run``), on the same grid as the splitserve engine's (``measure.Grid``), fitted into
the same ``Profile``: so ``simulate`` and ``plan`` take a vLLM worker's costs as they take ours.

vLLM's scheduler admits requests by itself, so a step with context is reached the way a server reaches it, not
by leasing blocks: a prefill over ``context`` cached tokens first computes a prompt of that length (untimed,
kept by vLLM's prefix cache, block-aligned) and then times the step of a prompt that extends it; a decode step
of ``batch`` sequences times the steps after every sequence's prompt is in. Each step's shape is read from what
vLLM scheduled (its chunk sizes and computed tokens), not assumed. The KV transfer is measured as for the
splitserve engine (``measure.measure_transfers``), at vLLM's block size: the bytes a vLLM worker moves.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from splitserve.deploy.profile import ModelShape, StepSample, StepShape

# Room per sequence past its prompt, and spare blocks, in the measured engine's cache.
SEQUENCE_SLACK = 16
DECODE_MAX_TOKENS = 1000  # a decoding sequence's cap: far past the steps it lives (it is aborted after)


@dataclass
class VllmMeasurer:
    """One ``VllmEngine`` (the colocated role: prefix caching on, no connector), stepped by hand."""

    model_dir: str
    grid: Any  # measure.Grid (measure_profile builds this measurer; measure imports this module)
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None
    vllm_args: dict | None = None
    tensor_parallel_size: int = 1  # > 1: ranks 1.. spawned here, each a vLLM engine following rank 0's steps

    def __post_init__(self) -> None:
        import torch

        from splitserve.engine.core import EngineConfig
        from splitserve.engine.model.config import ModelConfig
        from splitserve.worker_common.vllm_engine import VllmEngine

        if self.threads:
            torch.set_num_threads(self.threads)
        g = self.grid
        tokens = max(
            max(g.prefill_tokens) + 2 * max(g.prefill_contexts),
            max(g.decode_batches) * (max(g.decode_contexts) + 4 * g.decode_steps + SEQUENCE_SLACK),
            max(t + b * (c + SEQUENCE_SLACK) for t, b, c in g.mixed),
        )
        self.model_config = ModelConfig.from_model_dir(self.model_dir)
        m = self.model_config
        element = torch.empty((), dtype=torch.float32 if self.dtype == "float32" else torch.bfloat16).element_size()
        kv_bytes = 2 * m.num_layers * m.num_kv_heads * m.head_dim * element * 2 * tokens
        config = EngineConfig(
            model_dir=self.model_dir,
            dtype=self.dtype,
            device=self.device,
            num_threads=self.threads,
            backend="vllm",
            vllm_args=self.vllm_args,
            kv_cache_bytes=max(kv_bytes, 64 << 20),
            max_num_seqs=max(max(g.decode_batches), max(b for _, b, _ in g.mixed)) + 1,
            max_num_batched_tokens=max(g.prefill_tokens) + max(g.decode_batches) + 64,
            enable_prefix_caching=True,
            max_model_len=max(g.prefill_tokens) + max(g.prefill_contexts) + max(g.decode_contexts) + 64,
        )
        self._ranks: list = []
        ranks = None
        if self.tensor_parallel_size > 1:
            config = replace(config, tensor_parallel_size=self.tensor_parallel_size)
            ranks, self._ranks, self._errors = _spawn_ranks(config)
        self.engine = VllmEngine(config, threading.RLock(), ranks=ranks)
        self.torch = torch
        self.block_size = self.engine.model.block_size
        self._ids = 0
        self._vocab = m.vocab_size
        # What measure_profile reads of a measurer's engine.
        self.core = SimpleNamespace(
            dtype=getattr(torch, self.engine.model.dtype),
            device=torch.device(self.device),
            kv_cache=SimpleNamespace(tensor=torch.empty(0, dtype=getattr(torch, self.engine.model.dtype))),
        )

    # ---- requests and steps -------------------------------------------------------------------

    def _prompt(self, length: int, seed: int | None = None) -> list[int]:
        self._ids += 1
        base = self._ids if seed is None else seed
        return [(7 + 31 * i + 977 * base) % (self._vocab - 1) for i in range(length)]

    def _add(self, prompt: list[int], max_tokens: int):
        from splitserve.engine.sampling.params import SamplingParams
        from splitserve.engine.scheduler.request import Request

        self._ids += 1
        request = Request(
            f"profile-{self._ids}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        )
        self.engine.add(request)
        return request

    def _step(self) -> tuple[StepShape, float]:
        """One step as the worker takes it (schedule, run, apply): its shape, as vLLM scheduled it, and seconds."""
        start = time.perf_counter()
        step = self.engine.schedule()
        chunks, contexts = [], []
        if not step.is_empty:
            vllm_requests = self.engine._scheduler.requests
            for request_id, new in step.output.num_scheduled_tokens.items():
                before = vllm_requests[request_id].num_computed_tokens - new
                if new > 1:
                    chunks.append((before, new))
                else:
                    contexts.append(before + 1)
        self.engine.run(step)
        return StepShape.of(chunks, contexts), time.perf_counter() - start

    def _run_until(self, done) -> None:
        for _ in range(10_000):
            if done():
                return
            self._step()
        raise RuntimeError("profile: the vllm engine made no progress")

    def _clear(self) -> None:
        from splitserve.engine.scheduler.request import FinishReason

        for request_id in list(self.engine._ids):
            self.engine.finish(request_id, FinishReason.ABORT)
        self._run_until(lambda: not self.engine._scheduler.has_requests())

    # ---- the grid -----------------------------------------------------------------------------

    def warm_up(self) -> None:
        for _ in range(2):
            self._add(self._prompt(64), 2)
            self._run_until(lambda: not self.engine._ids)

    def prefill(self, tokens: int, context: int) -> StepSample:
        times, shape = [], StepShape()
        for _ in range(self.grid.repeats):
            prefix = self._prompt(context)
            if context:  # computed and kept by the prefix cache, then extended
                self._add(prefix, 1)
                self._run_until(lambda: not self.engine._ids)
            request = self._add(prefix + self._prompt(tokens), 1)
            step_shape, seconds = self._step()
            self._run_until(lambda: request.is_finished)  # noqa: B023
            shape = step_shape
            times.append(seconds)
            self._clear()
        return StepSample(shape, statistics.median(times))

    def decode(self, batch: int, context: int) -> StepSample:
        # Prompts are computed over several steps (the token budget): the first ones decode meanwhile, so no
        # sequence may end before the timed steps do.
        requests = [self._add(self._prompt(context), DECODE_MAX_TOKENS) for _ in range(batch)]
        self._run_until(lambda: all(r.num_output_tokens >= 1 for r in requests))
        self._step()  # the first step with every sequence decoding: warm
        samples = [self._step() for _ in range(self.grid.decode_steps)]
        self._clear()
        shape = samples[len(samples) // 2][0]
        return StepSample(shape, statistics.median(s for _, s in samples))

    def mixed(self, tokens: int, batch: int, context: int) -> StepSample:
        times, shape = [], StepShape()
        for _ in range(self.grid.repeats):
            requests = [self._add(self._prompt(context), DECODE_MAX_TOKENS) for _ in range(batch)]
            self._run_until(lambda: all(r.num_output_tokens >= 1 for r in requests))  # noqa: B023
            self._add(self._prompt(tokens), 1)
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
        return ModelShape.of(self.model_config, name)

    def close(self) -> None:
        self.engine.close()  # Stop: the other ranks return
        if self._ranks:
            from splitserve.planning.ranks import end_followers

            end_followers(self._ranks, self._errors)


def _spawn_ranks(config: Any) -> tuple[Any, list, Any]:
    """Ranks 1.. of a tensor-parallel vLLM engine, spawned and joining rank 0's group (this process): rank 0's
    ``Ranks``, the processes, and the queue their errors come back on."""
    import uuid

    import torch

    from splitserve.engine.tp.distributed import TPGroup
    from splitserve.planning.ranks import HOST, TP_GROUP_TIMEOUT_S, TP_SETUP_TIMEOUT_S, spawn_followers
    from splitserve.worker_common.tp.rank_link import Ranks

    size, group_id = config.tensor_parallel_size, f"profile-{uuid.uuid4().hex[:12]}"
    store, port, procs, errors = spawn_followers(
        size, _rank_main, lambda port, rank, errors: (config, port, group_id, rank, errors)
    )
    group = TPGroup.join(
        "gloo", store, "tp/", 0, size, HOST, TP_GROUP_TIMEOUT_S, TP_SETUP_TIMEOUT_S, torch.device("cpu")
    )
    ranks = Ranks(group, group_id, None, (HOST, port))
    ranks.store = store  # kept alive with the group: the ranks' rendezvous
    return ranks, procs, errors


def _rank_main(config: Any, port: int, group_id: str, rank: int, errors: Any) -> None:
    """A spawned rank: join the group, build its vLLM engine as rank 0 builds its own, run rank 0's steps until
    Stop."""
    try:
        import torch

        from splitserve.engine.tp.distributed import TPGroup, connect_store
        from splitserve.engine.tp.step import Foreign, PlanChannel, Stop
        from splitserve.planning.ranks import HOST, TP_GROUP_TIMEOUT_S, TP_SETUP_TIMEOUT_S
        from splitserve.worker_common.vllm_engine import VllmRank, VllmRanks

        store = connect_store(HOST, port, TP_SETUP_TIMEOUT_S)
        group = TPGroup.join("gloo", store, "tp/", rank, config.tensor_parallel_size, HOST, TP_GROUP_TIMEOUT_S,
                             TP_SETUP_TIMEOUT_S, torch.device("cpu"))  # fmt: skip
        engine = VllmRank(replace(config, tensor_parallel_rank=rank), "colocated", VllmRanks(HOST, port, group_id))
        channel = PlanChannel(group, engine.device)
        while not isinstance(message := channel.receive(), Stop):
            if isinstance(message, Foreign):
                engine.run(message.payload)
        engine.close()
    except BaseException as e:  # reported to rank 0, which fails the profile
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
