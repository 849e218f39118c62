"""The offline engine: ``LLM(model_dir).generate(prompts, sampling)`` with continuous batching.

One step reads like the loop it is::

    output = scheduler.schedule()          # what to run (data only)
    sampled = runner.execute(output)       # run it on the device
    advanced = scheduler.update(output, sampled)   # apply tokens, finish requests
    -> detokenize, match stop strings, report

Used by tests, benchmarks and the colocated serving mode; the disaggregated workers reuse its parts.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from splitserve.engine.core import EngineConfig, EngineCore
from splitserve.engine.sampling.logprobs import TokenLogprobs
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.sampling.rng import random_seed
from splitserve.engine.scheduler.request import FinishReason, Request
from splitserve.engine.text.detokenizer import IncrementalDetokenizer
from splitserve.engine.text.stop_strings import StopStringMatcher
from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.engine.tp.distributed import TPGroup


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # output tokens so far
    text: str  # output text so far (stop strings and held-back partial text excluded)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # With sampling.logprobs: one entry per output token; with sampling.prompt_logprobs: one per prompt
    # token, the first None (``splitserve.engine.sampling.logprobs.TokenLogprobs``).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class _Stream:
    """Per-request text state: incremental detokenizer plus stop-string matcher."""

    def __init__(self, tokenizer: Tokenizer, request: Request) -> None:
        sp = request.sampling
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, sp.skip_special_tokens)
        self.stops = StopStringMatcher(sp.stop, sp.include_stop_str_in_output)
        self.text = ""


class LLM:
    def __init__(self, model_dir: str, *, tp_group: TPGroup | None = None, **options) -> None:
        """``options``: EngineConfig's fields. A tensor-parallel engine runs one ``LLM`` per rank, each with
        ``tensor_parallel_size``, its ``tensor_parallel_rank`` and the ranks' ``tp_group``, and the same calls
        on every rank in the same order (the ranks run every step together). With
        ``tensor_parallel_step="plan"`` only rank 0 builds an ``LLM``; the other ranks build an ``EngineCore``
        and run ``splitserve.engine.tp.step.follow`` on it until rank 0's ``close()`` (or the end of its
        ``with`` block) stops them."""
        self.core = EngineCore(EngineConfig(model_dir=str(model_dir), **options), tp_group=tp_group)
        core = self.core
        self.config, self.model_config, self.tokenizer = core.config, core.model_config, core.tokenizer
        self.dtype, self.device, self.model = core.dtype, core.device, core.model
        self.weights_checksum, self.kv_cache, self.blocks, self.runner = (
            core.weights_checksum,
            core.kv_cache,
            core.blocks,
            core.runner,
        )
        self.scheduler = core.make_scheduler()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()

    # ---- requests -----------------------------------------------------------------------------

    def add_request(
        self, prompt: str | Sequence[int], sampling: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        sampling = sampling or SamplingParams()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self.core.check_request(token_ids, sampling)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = Request(request_id, token_ids, sampling, seed=self._seed_for(sampling))
        self.scheduler.add(request)
        self._streams[request_id] = _Stream(self.tokenizer, request)
        return request_id

    def _seed_for(self, sampling: SamplingParams) -> int:
        """The request's effective seed. In lockstep every rank of a tensor-parallel engine samples, so an
        unseeded request draws from rank 0's random seed on every rank (one broadcast, in the order every rank
        adds its requests): with per-rank seeds the ranks would sample different tokens, their KV heads would
        hold different sequences and EOS could end a request on one rank only."""
        if sampling.seed is not None:
            return sampling.seed
        seed = random_seed()
        group = self.core.tp_group
        if group is not None and not self.core.plan_steps:
            seed = int(group.broadcast(torch.tensor([seed], dtype=torch.int64, device=self.device), src=0).item())
        return seed

    def abort(self, request_id: str) -> None:
        self.scheduler.finish(request_id, FinishReason.ABORT)
        self._streams.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns an output for every request that advanced."""
        output = self.scheduler.schedule()
        now = time.monotonic()
        for item in output.scheduled:
            if item.request.first_scheduled_time is None:
                item.request.first_scheduled_time = now
        sampled = self.runner.execute(output)
        advanced = self.scheduler.update(output, sampled)
        now = time.monotonic()
        results = []
        for request in advanced:
            if request.first_token_time is None:
                request.first_token_time = now
            results.append(self._emit(request, now))
        return results

    def _emit(self, request: Request, now: float) -> RequestOutput:
        stream = self._streams[request.request_id]
        text = stream.detok.add_tokens(request.token_ids[-1:])
        if request.is_finished:
            text += stream.detok.flush()
        delta, stop = stream.stops.feed(text)
        if stop is None and request.is_finished:
            delta += stream.stops.flush()
            stop = stream.stops.matched
        if stop is not None:
            # A stop string ends the request, and outranks a length limit reached on the same token.
            self.scheduler.finish(request.request_id, FinishReason.STOP, stop)
            request.finish_reason, request.stop_reason = FinishReason.STOP, stop
        stream.text += delta
        if request.is_finished:
            del self._streams[request.request_id]
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids,
            text=stream.text,
            finished=request.is_finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            logprobs=list(request.logprobs) if request.sampling.logprobs is not None else None,
            prompt_logprobs=None if request.prompt_logprobs is None else list(request.prompt_logprobs),
            metrics={
                "arrival_time": request.arrival_time,
                "first_scheduled_time": request.first_scheduled_time or now,
                "first_token_time": request.first_token_time or now,
                "last_token_time": now,
            },
        )

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (text or token ids) to completion, batched continuously; outputs in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = list(sampling) if isinstance(sampling, Sequence) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling: {len(params)} parameter sets for {len(prompts)} prompts")
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        try:
            for prompt, sp in zip(prompts, params):
                ids.append(self.add_request(prompt, sp))
            while len(done) < len(ids):
                for out in self.step():
                    if out.finished:
                        done[out.request_id] = out
        finally:
            for rid in ids:
                if rid not in done:
                    self.abort(rid)
        return [done[rid] for rid in ids]

    # ---- status -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the followers of an engine whose rank 0 drives; nothing otherwise. Idempotent."""
        self.core.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def kv_status(self) -> dict[str, int]:
        """Block figures read from the allocator: total, in use, cached (evictable), free."""
        b = self.blocks
        return {
            "total": b.num_blocks,
            "in_use": b.num_used_blocks,
            "cached": b.num_cached_blocks,
            "free": b.num_free_blocks - b.num_cached_blocks,
        }

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
