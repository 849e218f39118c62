"""Which worker gets a request: pure functions over the router's view of its workers (no I/O).

Prefill workers are chosen among those with credit (room) by the configured policy:

- ``prefix_aware`` (default): lowest ``overlap_weight x uncached blocks + queued prefill tokens``,
  where uncached blocks are the prompt's full blocks beyond the longest prefix the worker already
  caches (known from the block-hash events it publishes) and queued tokens are the uncached prompt
  tokens the router has sent it that have not reached their first token yet. The default weight
  (16, a block's tokens) makes both terms count tokens.
- ``least_loaded``: fewest queued prefill tokens, then fewest requests in flight.
- ``round_robin``: the next worker in turn.

Decode workers are chosen by room: enough free KV blocks for the request, then the fewest requests
(the router's open ``Decode`` calls to it: running, and leased waiting for KV), then the most free blocks.

Conditional disaggregation (``prefill_on_decode``) decides, before a leg starts, whether its decode worker
prefills it instead of a prefill worker. The router's dispatcher and the simulator
(``splitserve.planning.simulator``) both call it, so they cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class PrefillView:
    worker_id: str
    credit: int  # requests it may still take
    inflight: int = 0
    queued_tokens: int = 0
    cached_hashes: set[int] = field(default_factory=set)
    healthy: bool = True

    def cached_prefix_blocks(self, prompt_hashes: Sequence[int]) -> int:
        n = 0
        for h in prompt_hashes:
            if h not in self.cached_hashes:
                break
            n += 1
        return n


@dataclass
class DecodeView:
    worker_id: str
    free_blocks: int
    requests: int  # running + waiting for KV
    healthy: bool = True


def choose_prefill(
    workers: Sequence[PrefillView],
    policy: str,
    prompt_hashes: Sequence[int],
    block_size: int,
    overlap_weight: float,
    turn: int = 0,
) -> PrefillView | None:
    """The prefill worker for a prompt, or None when no healthy worker has room."""
    candidates = [w for w in workers if w.healthy and w.credit > 0]
    if not candidates:
        return None
    if policy == "round_robin":
        order = [workers[(turn + i) % len(workers)] for i in range(len(workers))]
        return next(w for w in order if w in candidates)
    if policy == "least_loaded":
        return min(candidates, key=lambda w: (w.queued_tokens, w.inflight))
    total = len(prompt_hashes)

    def cost(w: PrefillView) -> float:
        return overlap_weight * (total - w.cached_prefix_blocks(prompt_hashes)) + w.queued_tokens

    return min(candidates, key=lambda w: (cost(w), w.inflight))


def choose_decode(workers: Sequence[DecodeView], blocks_needed: int, exclude: Sequence[str] = ()) -> DecodeView | None:
    candidates = [w for w in workers if w.healthy and w.free_blocks >= blocks_needed and w.worker_id not in exclude]
    if not candidates:
        return None
    return min(candidates, key=lambda w: (w.requests, -w.free_blocks))


class LocalPrefillSettings(Protocol):
    """The thresholds of conditional disaggregation, as ``RouterConfig`` (and the simulator's config) names them."""

    local_prefill_max_tokens: int  # prefill on the decode worker when at most this many tokens are uncached
    remote_prefill_max_queue_tokens: int  # ... or when the prefill queue holds this many tokens or more


def prefill_on_decode(
    settings: LocalPrefillSettings,
    prefill_workers: Sequence[PrefillView],
    prompt_hashes: Sequence[int],
    block_size: int,
    *,
    num_tokens: int,
    tokens_left: int,
    waiting_tokens: int,
    decode_workers: int,
) -> bool:
    """Whether a leg's decode worker prefills it itself (conditional disaggregation, NVIDIA Dynamo's rule).

    ``num_tokens``: the leg's tokens to prefill (prompt and output so far), ``prompt_hashes`` their full
    blocks' hashes; ``tokens_left``: the tokens it may still generate; ``waiting_tokens``: the tokens of
    the requests waiting for a prefill worker's credit; ``decode_workers``: how many the router knows.

    Yes when the thresholds allow it and either the tokens beyond the longest prefix a healthy prefill
    worker caches number at most ``local_prefill_max_tokens``, or the prefill workers' queued tokens plus
    the waiting ones reach ``remote_prefill_max_queue_tokens``. Never with both thresholds 0, without a
    decode worker, or with at most one token left: the prefill's first token would end the request, so
    there is no decode leg to prefill for."""
    s = settings
    if not (s.local_prefill_max_tokens or s.remote_prefill_max_queue_tokens) or not decode_workers:
        return False
    if tokens_left <= 1:
        return False
    healthy = [w for w in prefill_workers if w.healthy]
    cached = max((w.cached_prefix_blocks(prompt_hashes) for w in healthy), default=0) * block_size
    if num_tokens - cached <= s.local_prefill_max_tokens:
        return True
    queued = sum(w.queued_tokens for w in healthy) + waiting_tokens
    return bool(s.remote_prefill_max_queue_tokens) and queued >= s.remote_prefill_max_queue_tokens
