"""A request inside one engine: its tokens and counters; everything else is derived.

Lifecycle::

    WAITING ──scheduled──▶ RUNNING ──stop / length / abort──▶ FINISHED
       ▲                      │
       └─────preempted────────┘   (blocks freed, KV recomputed later; prefix-cached blocks make
                                   the recompute cheap)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from splitserve.engine.sampling.params import SamplingParams, TokenLogprobs
from splitserve.engine.sampling.rng import random_seed


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the caller
    PREEMPTED = "preempted"  # out of blocks on a decode worker: handed back to be re-prefilled


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    seed: int = -1  # effective seed: sampling.seed, or a random one
    token_ids: list[int] = field(init=False)  # prompt followed by output
    num_computed_tokens: int = 0  # tokens whose K/V are in this engine's cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # With sampling.logprobs: one entry per token this engine sampled for the request, in order (so the
    # last n are those of its last n tokens; a resumed request's earlier tokens have none here).
    logprobs: list[TokenLogprobs] = field(init=False, default_factory=list)
    # With sampling.prompt_logprobs: one entry per prompt token (the first one's None), filled as the
    # prompt's chunks are computed; complete once the first token is sampled.
    prompt_logprobs: list[TokenLogprobs | None] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids: must not be empty")
        self.token_ids = list(self.prompt_token_ids)
        if self.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        if self.seed < 0:
            self.seed = self.sampling.seed if self.sampling.seed is not None else random_seed()

    @classmethod
    def resume(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        sampling: SamplingParams,
        seed: int,
    ) -> Request:
        """A request that already generated ``output_token_ids`` elsewhere (migration, re-prefill)."""
        request = cls(request_id, prompt_token_ids, sampling, seed=seed)
        request.token_ids.extend(output_token_ids)
        return request

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities asked for and not computed yet (before the first token of its leg):
        every prompt position must then be computed here, none served from the prefix cache."""
        return self.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
