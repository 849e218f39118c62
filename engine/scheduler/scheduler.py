"""Continuous batching with chunked prefill under a per-step token budget; torch-free.

Each step ``schedule()`` returns what to run; the model runs it; ``update()`` applies the sampled
tokens. Policy (as vLLM v1): running requests first, oldest first, each asking for all its
uncomputed tokens (one for a decode, a chunk for an unfinished prefill); then waiting requests in
arrival order, each starting from its prefix-cache hit. Budget and ``prefill_chunk_size`` cut
prefills into chunks. When blocks run out, the newest running request is preempted: its blocks are
freed and it goes back to the head of the queue, to be recomputed later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Literal

from splitserve.common.validate import check_ranges
from splitserve.engine.kv_cache.block_manager import NO_HIT, BlockManager
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.scheduler.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running requests at most
    max_num_batched_tokens: int = 2048  # tokens per step (decodes count one each)
    prefill_chunk_size: int | None = None  # prompt tokens of one request per step; None = budget
    max_model_len: int = 4096  # prompt + output tokens at most
    # Disaggregated roles. A prefill worker hands each request off after its first token: the request
    # leaves the scheduler but keeps its blocks (the owner frees them once the KV has moved). A decode
    # worker hands preempted requests back to the router (to be re-prefilled elsewhere) instead of
    # recomputing them locally.
    hand_off_after_first_token: bool = False
    preemption: Literal["recompute", "hand_back"] = "recompute"

    def __post_init__(self) -> None:
        check_ranges(self, ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "prefill_chunk_size"), min=1)


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens to compute this step, starting at request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's known tokens, so its logits are used."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[Request, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, eos_token_ids: Iterable[int] = ()) -> None:
        self.config = config
        self.blocks = blocks
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # since start, for status and tests

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in the engine")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt: {request.num_prompt_tokens} tokens leave no room for output "
                f"(max_model_len {self.config.max_model_len})"
            )
        if self.blocks.num_blocks_for(request.num_prompt_tokens + 1) > self.blocks.num_blocks:
            raise ValueError(f"prompt: {request.num_prompt_tokens} tokens do not fit in the KV cache at all")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._chunk(request, request.num_computed_tokens, budget)
            while not self.blocks.allocate(request.request_id, request.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, n))
                budget -= n
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            request = self.waiting[0]
            # Prompt log-probabilities need every prompt position's logits: no prefix-cache hit for them.
            fresh = request.num_computed_tokens == 0 and not request.wants_prompt_logprobs
            hit = self.blocks.lookup_prefix(request.token_ids) if fresh else NO_HIT
            computed = hit.num_blocks * self.blocks.block_size
            n = self._chunk(request, computed, budget)
            if not self.blocks.allocate(request.request_id, computed + n, hit):
                break
            self.waiting.popleft()
            if request.num_preemptions == 0:
                request.num_cached_tokens = computed
            request.num_computed_tokens = computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, n))
            budget -= n
        return SchedulerOutput(tuple(scheduled), tuple(preempted))

    def _chunk(self, request: Request, computed: int, budget: int) -> int:
        n = min(request.num_tokens - computed, budget)
        if self.config.prefill_chunk_size is not None and n > 1:
            n = min(n, self.config.prefill_chunk_size)
        return n

    def _preempt(self, request: Request) -> None:
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.preemption == "hand_back":
            self.running.append(request)  # finish() expects it where it was
            self.finish(request.request_id, FinishReason.PREEMPTED)
            return
        self.blocks.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def add_running(self, request: Request, num_computed: int | None = None) -> None:
        """Admit a request whose KV for its first ``num_computed`` tokens is already in its blocks; None:
        all but its last token (a decode worker's request after the transfer), so its next step decodes
        that last token. Fewer: its next steps compute the rest as prompt chunks (a profile's step with a
        cached context)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in the engine")
        if not self.blocks.has_request(request.request_id):
            raise ValueError(f"request {request.request_id!r} holds no blocks")
        computed = request.num_tokens - 1 if num_computed is None else num_computed
        if not 0 <= computed < request.num_tokens:
            raise ValueError(f"num_computed: must be 0 to {request.num_tokens - 1}, got {computed}")
        request.num_computed_tokens = computed
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)

    def fork(self, parent_id: str, child: Request) -> None:
        """Admit ``child``, another sample of the parent's prompt (``n`` > 1), sharing the parent's computed
        full prompt blocks by reference count; the child computes the rest of the prompt (less than a block,
        or one token) and samples its own first token. The parent's prompt must be computed (its KV landed,
        or its prefill ran); the shared blocks hold prompt tokens only, which nothing writes again."""
        parent = self.requests[parent_id]
        if child.prompt_token_ids != parent.prompt_token_ids or child.num_output_tokens:
            raise ValueError(f"request {child.request_id!r}: a fork has its parent's prompt and no output")
        # Never the block holding the prompt's last token: its logits are the child's to compute.
        computed = min(parent.num_computed_tokens, parent.num_prompt_tokens - 1)
        num_blocks = computed // self.blocks.block_size
        self.blocks.fork(parent_id, child.request_id, num_blocks)
        child.num_cached_tokens = num_blocks * self.blocks.block_size
        self.add_running(child, child.num_cached_tokens)

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Apply one step's results; returns the requests that got a new token (finished ones too)."""
        advanced = []
        for item in output.scheduled:
            request = item.request
            samples = item.samples
            request.num_computed_tokens += item.num_new_tokens
            self.blocks.cache_blocks(request.request_id, request.token_ids, request.num_computed_tokens)
            if not samples or request.is_finished:
                continue
            token = sampled[request.request_id]
            request.token_ids.append(token)
            advanced.append(request)
            reason = self._stop_reason(request, token)
            if self.config.hand_off_after_first_token:
                self._hand_off(request, reason)
            elif reason is not None:
                self.finish(request.request_id, *reason)
        return advanced

    def _hand_off(self, request: Request, reason: tuple[FinishReason, int | None] | None) -> None:
        """The request leaves with its blocks still allocated; ``finish_reason`` says whether it is
        complete (None: it continues elsewhere)."""
        del self.requests[request.request_id]
        self.running.remove(request)
        request.status = RequestStatus.FINISHED
        if reason is not None:
            request.finish_reason, request.stop_reason = reason

    def _stop_reason(self, request: Request, token: int) -> tuple[FinishReason, int | None] | None:
        return stop_reason(
            request.sampling,
            self.eos_token_ids,
            request.num_output_tokens,
            token,
            request.num_tokens >= self.config.max_model_len,
        )

    def finish(self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End a request wherever it is and free its blocks; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        self.blocks.free(request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason


def stop_reason(
    sampling: SamplingParams, eos_token_ids: Collection[int], num_output_tokens: int, token: int, at_max_len: bool
) -> tuple[FinishReason, int | None] | None:
    """Whether a request ends with this output token (its ``num_output_tokens``-th), and why: EOS (unless
    ``ignore_eos``) or a stop id once ``min_tokens`` are out, else ``max_tokens`` or the model's length.
    The one rule: the scheduler applies it to each sampled token, the router to the tokens it relayed."""
    if num_output_tokens >= sampling.min_tokens:
        if not sampling.ignore_eos and token in eos_token_ids:
            return FinishReason.STOP, None
        if token in sampling.stop_token_ids:
            return FinishReason.STOP, token
    if num_output_tokens >= sampling.max_tokens or at_max_len:
        return FinishReason.LENGTH, None
    return None
