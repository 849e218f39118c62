"""The engine seam: the one interface the workers use to drive an engine (``Engine``), and the few types it
speaks in. ``splitserve.worker_common.local_engine.LocalEngine`` puts this repository's engine behind it.

An engine owns its scheduler and its KV layout, as vLLM's does: the worker adds, finishes and frees
requests by id, steps the engine, and reads back per-request results (``StepResult``); it never sees the
scheduler's output, the block manager or the model runner. Two things it does see:

* the scheduled step before it runs (``schedule()`` returns an opaque ``ScheduledStep``, ``run()`` runs it).
  A prefill worker starts the KV transfer of each request on its final chunk before the forward, so the
  layer groups stream out while later layers compute (``on_layer_done``), and a decode worker hands the
  requests preempted to make room back to the router before the step runs. vLLM's KV connector has the same
  two hooks: ``build_connector_meta`` on the scheduled step, then ``save_kv_layer`` per layer and
  ``wait_for_save`` in the forward. ``step()`` is both phases at once, for a caller that needs neither.
* the KV region (``KVRegion``), which the KV transfer reads from and writes into by block id. A decode
  worker leases blocks (``allocate``), has the KV written into them, then joins the request with its first
  token (``add_running``): where vLLM's connector would ``start_load_kv`` into blocks its scheduler chose.

Rank 0 of a tensor-parallel worker that drives its ranks also uses the ``TensorParallel`` part (its plan
channel, the idle tick, the group's failure); an engine that runs its ranks by itself answers None and False.

Every method may be called from any thread: the engine takes the worker's lock itself (a reentrant lock, so
a worker that holds it already around several calls may call in). ``run`` and ``step`` hold it only while
scheduling or applying results, never while the model runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from splitserve.engine.kv_cache.cache import KVCacheSpec
from splitserve.engine.scheduler.request import FinishReason, Request
from splitserve.engine.tp.step import PlanChannel

__all__ = [
    "Engine",
    "FinishReason",
    "KVRegion",
    "ModelFacts",
    "Request",
    "ScheduledStep",
    "StepKind",
    "StepResult",
    "TensorParallel",
]

StepKind = Literal["prefill", "decode"]  # "prefill" if the step computes prompt tokens (the metrics' label)


@dataclass(frozen=True)
class ModelFacts:
    """What a worker needs to know of the model and the KV layout (the layout fingerprint, checks)."""

    vocab_size: int
    num_layers: int
    num_kv_heads: int  # of the whole model, every rank's
    head_dim: int
    dtype: str  # "bfloat16", ...
    weights_checksum: str  # the same at every TP size
    block_size: int  # tokens per KV block


@runtime_checkable
class ScheduledStep(Protocol):
    """One step's work, scheduled and not yet run (opaque to the worker beyond these)."""

    @property
    def is_empty(self) -> bool: ...

    @property
    def requests(self) -> tuple[Request, ...]:
        """The requests scheduled in this step."""
        ...

    @property
    def sampling(self) -> tuple[Request, ...]:
        """The requests that sample a token in this step (a prompt's final chunk, or a decode)."""
        ...

    @property
    def preempted(self) -> tuple[Request, ...]:
        """Requests preempted to make room for this step (in hand-back mode, already freed)."""
        ...

    @property
    def prompt_work(self) -> bool:
        """Whether some request computes prompt tokens in this step (more than one new token)."""
        ...


@dataclass(frozen=True)
class StepResult:
    """What one step did: the requests that got a token (some of them finished by it), in step order, and
    the requests preempted to make room for it (the scheduled step's ``preempted``)."""

    kind: StepKind
    advanced: tuple[Request, ...]
    preempted: tuple[Request, ...] = ()

    @property
    def finished(self) -> tuple[Request, ...]:
        """The requests the step finished (their blocks freed, or owned by the worker in hand-off mode)."""
        return tuple(r for r in self.advanced if r.is_finished)


@runtime_checkable
class KVRegion(Protocol):
    """The KV cache as the KV transfer sees it (``splitserve.kv_transfer``): blocks by id, rows by head."""

    @property
    def device(self) -> torch.device: ...

    @property
    def spec(self) -> KVCacheSpec:
        """The cache's shape: num_blocks, num_layers, num_kv_heads (this rank's), block_size, head_dim, dtype."""
        ...

    @property
    def tensor(self) -> torch.Tensor: ...

    def gather_blocks(
        self, block_ids: torch.Tensor, layers: range | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def scatter_blocks(self, block_ids: torch.Tensor, data: torch.Tensor, layers: range | None = None) -> None: ...

    def row_index(self, block_ids: torch.Tensor, layers: range) -> torch.Tensor: ...

    def rows(self) -> torch.Tensor: ...


@runtime_checkable
class TensorParallel(Protocol):
    """The tensor-parallel part of an engine: what rank 0 of a worker whose engine drives other ranks
    needs (an engine on one device, or one that runs its ranks by itself, answers None, False, no-op)."""

    @property
    def plan_channel(self) -> PlanChannel | None:
        """Rank 0 of a tensor-parallel engine that drives its followers: the channel of its plans and notices."""
        ...

    def keep_alive(self) -> None:
        """Idle: tick the other ranks if due (raises if one is dead or stalled); no-op without followers."""
        ...

    def group_broken(self, error: Exception) -> bool:
        """Whether ``error`` (raised by a step) means the tensor-parallel group failed."""
        ...

    def close(self) -> None:
        """End the followers' loops (idempotent; no-op without followers)."""
        ...


@runtime_checkable
class Forks(Protocol):
    """An engine that can run ``n`` > 1 samples of one prompt on one prefill (an optional part: a worker
    whose engine lacks it refuses ``n`` > 1)."""

    def fork(self, parent_id: str, child: Request) -> None:
        """Join ``child`` (the parent's prompt, no output, its own seed) to the batch, sharing the parent's
        computed full prompt blocks; it computes the rest of the prompt itself (``Scheduler.fork``)."""
        ...


@runtime_checkable
class Engine(TensorParallel, Protocol):
    """The one interface the workers drive an engine through (with its ``TensorParallel`` part)."""

    # ---- requests -------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request to compute from its first uncomputed token; raises ValueError if refused."""
        ...

    def add_running(self, request: Request) -> None:
        """Join a request whose KV is already in its leased blocks (decode: the KV landed) to the batch."""
        ...

    def finish(self, request_id: str, reason: FinishReason) -> None:
        """End a request held by the scheduler (no-op if it is not); frees its blocks."""
        ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_preemptions(self) -> int:
        """Requests preempted since start (metrics)."""
        ...

    # ---- the step -------------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep: ...

    def run(
        self, step: ScheduledStep, kind: StepKind | None = None, on_layer_done: Callable[[int], None] | None = None
    ) -> StepResult:
        """Run a scheduled step on the model, timed for the metrics under ``kind`` (default: from the step's
        work), and apply the sampled tokens. ``on_layer_done(n)``: the first n layers are computed."""
        ...

    def step(self, kind: StepKind | None = None, on_layer_done: Callable[[int], None] | None = None) -> StepResult:
        """``schedule`` and ``run`` at once (an empty result when there is nothing to do)."""
        ...

    # ---- KV blocks ------------------------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int, request: Request | None = None) -> bool:
        """Lease blocks for ``num_tokens`` of a request not yet in the scheduler (decode); False: no room.
        ``request``: the request the lease is for (its prompt, earlier output and sampling; the first token
        comes with the KV), for an engine whose scheduler admits leases itself (vLLM's). Such an engine's
        ``block_table`` of a lease may wait for its loop, so it is read without the worker's lock."""
        ...

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids, in token order (a copy)."""
        ...

    def free(self, request_id: str) -> None:
        """Give back a request's blocks (a lease, or a request handed off at its first token)."""
        ...

    @property
    def num_free_blocks(self) -> int: ...

    def kv_figures(self) -> tuple[int, int, int]:
        """(total, in use, cached) blocks."""
        ...

    @property
    def kv_cache(self) -> KVRegion:
        """The KV region the KV transfer sends from and receives into."""
        ...

    def cached_hashes(self) -> list[int]:
        """The prefix cache's block hashes held now (the cache-event feed's snapshot)."""
        ...

    def take_block_events(self) -> Iterable:
        """The prefix cache's block events (``kind``: "stored" | "removed", ``block_hashes``) since the last call."""
        ...

    @property
    def prefix_block_size(self) -> int:
        """The block size of the hashes ``cached_hashes`` and the block events carry (the router's)."""
        ...

    # ---- model facts and checks -----------------------------------------------------------------

    @property
    def model(self) -> ModelFacts: ...

    @property
    def max_model_len(self) -> int: ...

    def check_request(self, token_ids: list[int], sampling) -> None:
        """Raise ValueError naming the field when the engine cannot take this request."""
        ...

    # ---- status ---------------------------------------------------------------------------------

    @property
    def decode_graphs(self) -> str:
        """The captured decode graphs in one line for status ("" when none)."""
        ...
