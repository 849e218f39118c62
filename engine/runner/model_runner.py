"""Runs one scheduled step on the device: builds the flattened batch, runs the model, samples.

The only engine module that touches tensors on the device besides the model itself. Two paths:

- dynamic (every step can take it): decodes (one new token) go first in the flattened batch, then
  prefill chunks, as ``splitserve.engine.attention.paged_attention`` expects; shapes follow the step.
- static (decode-only steps, when the runner has ``StaticDecodeInputs``): the batch padded to a bucket
  in persistent buffers (``splitserve.engine.runner.static_decode``), attention by
  ``splitserve.engine.attention.paged_decode``, and on CUDA
  a replay of the bucket's captured graph (``splitserve.engine.runner.cuda_graphs``). A step with a prefill chunk, a
  layer hook (a prefill worker streaming layer groups) or more decodes than the largest bucket takes
  the dynamic path, as does a step with a prompt whose log-probabilities are asked for (every prompt
  row's logits are computed then, not the sampled rows' only).

The dynamic path is two halves: ``plan`` turns the scheduled items into a ``StepPlan`` (host arrays, no
tensors) and ``run_plan`` runs its forward. Rank 0 of a tensor-parallel engine whose rank 0 drives sends
each plan to the other ranks between the two (``splitserve.engine.tp.step``); unsharded, the plan goes
straight to ``run_plan``, with no encoding. Such an engine decodes on the dynamic path only.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from splitserve.common.arith import ceil_div
from splitserve.engine.attention.paged_attention import AttentionMetadata, PagedPrefillFn, PrefillChunk
from splitserve.engine.attention.paged_decode import PagedDecodeFn
from splitserve.engine.kv_cache.block_manager import BlockManager
from splitserve.engine.kv_cache.cache import KVCache, context_rows
from splitserve.engine.model.transformer import CausalLM
from splitserve.engine.runner.cuda_graphs import CaptureStats, DecodeGraphs, GraphBackend
from splitserve.engine.runner.static_decode import StaticDecodeInputs
from splitserve.engine.sampling.logprobs import token_logprobs
from splitserve.engine.sampling.sampler import Sampler
from splitserve.engine.scheduler.scheduler import ScheduledRequest, SchedulerOutput
from splitserve.engine.tp.step import PlanChannel, StepPlan

# Prompt rows whose logits are computed at once for prompt log-probabilities (rows x vocab float32 each).
PROMPT_LOGPROBS_ROWS = 256


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        blocks: BlockManager | None,
        sampler: Sampler,
        static_decode: StaticDecodeInputs | None = None,
        channel: PlanChannel | None = None,
        decode_attention: PagedDecodeFn | None = None,
        prefill_attention: PagedPrefillFn | None = None,
    ) -> None:
        """``blocks`` is None on a follower rank, which only runs plans (``run_plan``); ``channel`` is rank 0's
        of a tensor-parallel engine whose rank 0 drives (``splitserve.engine.tp.step``). ``decode_attention``:
        the paged_decode backend that attends the decodes of dynamic steps in place (None: they gather).
        ``prefill_attention``: the kernel that attends prefill chunks from the cache (None: SDPA)."""
        self.model = model
        self.kv_cache = kv_cache
        self.blocks = blocks
        self.sampler = sampler
        self.device = kv_cache.device
        self.block_size = kv_cache.spec.block_size
        self.channel = channel
        self.static = static_decode
        self.decode_attention = decode_attention
        self.prefill_attention = prefill_attention
        self.graphs: DecodeGraphs | None = None
        # Steps by the path that ran them: "dynamic", "static" (eager) or "graph" (a captured graph replayed).
        # What ran, not what was configured: scripts/gpu_bench.py reports its timed steps' paths from it.
        self.steps: Counter[str] = Counter()
        if static_decode is not None:
            # Rotary tables sized once for every position a table can hold: they must not be
            # reallocated under a captured graph.
            self._static_max_position = static_decode.max_blocks_per_seq * self.block_size - 1
            model.rotary.ensure(self._static_max_position + 1)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, on_layer_done: Callable[[int], None] | None = None) -> dict[str, int]:
        """Compute every scheduled token's K/V; returns the sampled token of each request that samples.

        ``on_layer_done`` is passed to the model (see ``CausalLM.forward``). With a ``channel`` (rank 0 of a
        tensor-parallel engine whose rank 0 drives) the step's plan goes to the other ranks first."""
        if output.is_empty:
            return {}
        if self._takes_static_path(output, on_layer_done):
            return self._execute_static(list(output.scheduled))
        self.steps["dynamic"] += 1
        items = [s for s in output.scheduled if s.num_new_tokens == 1]
        items += [s for s in output.scheduled if s.num_new_tokens > 1]
        plan, sampled = self.plan(items)
        if self.channel is not None:
            self.channel.send(plan)
        hidden = self.run_plan(plan, on_layer_done)
        self._prompt_logprobs(items, hidden)
        if not sampled:
            return {}
        if len(sampled) < hidden.shape[0]:  # else every row samples, in order (a pure decode step)
            hidden = hidden.index_select(0, self._to_device(plan.sample_rows))
        logits = self.model.compute_logits(hidden)
        requests = [s.request for s in sampled]
        tokens = self.sampler(logits, requests)
        return {r.request_id: t for r, t in zip(requests, tokens)}

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan, on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """The forward of one plan on this rank's shard: hidden states [tokens, hidden] (no logits)."""
        input_ids, positions, meta = self._inputs(plan)
        return self.model(input_ids, positions, plan.max_position, self.kv_cache, meta, on_layer_done)

    def _prompt_logprobs(self, items: list[ScheduledRequest], hidden: torch.Tensor) -> None:
        """Each prompt token's log-probability (and top entries) under the logits of the row before it,
        for the items whose request asks for them, into ``request.prompt_logprobs``. The last prompt row
        predicts the first output token: the sampler's. Rows in groups, to bound the logits' memory."""
        offset = 0
        for item in items:
            request, start, count = item.request, item.request.num_computed_tokens, item.num_new_tokens
            end = min(start + count, request.num_prompt_tokens - 1)  # rows that score a prompt token
            if request.wants_prompt_logprobs and start < end:
                k = request.sampling.prompt_logprobs
                for a in range(start, end, PROMPT_LOGPROBS_ROWS):
                    b = min(a + PROMPT_LOGPROBS_ROWS, end)
                    logits = self.model.compute_logits(hidden[offset + a - start : offset + b - start])
                    entries = token_logprobs(logits, request.token_ids[a + 1 : b + 1], k)
                    request.prompt_logprobs[a + 1 : b + 1] = entries
            offset += count

    def _takes_static_path(self, output: SchedulerOutput, on_layer_done) -> bool:
        return (
            self.static is not None
            and on_layer_done is None
            and all(s.num_new_tokens == 1 and not s.request.wants_prompt_logprobs for s in output.scheduled)
            and self.static.fits(list(output.scheduled))
        )

    def _execute_static(self, items: list[ScheduledRequest]) -> dict[str, int]:
        tables = [self.blocks.block_table(s.request.request_id) for s in items]
        bucket = self.static.fill(items, tables)
        if self.graphs is not None:
            hidden = self.graphs.replay(bucket)
            self.steps["graph"] += 1
        else:
            hidden = self._static_forward(bucket)
            self.steps["static"] += 1
        sample = [row for row, s in enumerate(items) if s.samples]
        if not sample:
            return {}
        if len(sample) == len(items):
            hidden = hidden[: len(items)]
        else:
            hidden = hidden.index_select(0, torch.tensor(sample, device=self.device))
        requests = [items[row].request for row in sample]
        tokens = self.sampler(self.model.compute_logits(hidden), requests)
        return {r.request_id: t for r, t in zip(requests, tokens)}

    def _static_forward(self, bucket: int) -> torch.Tensor:
        """The decode forward of one bucket on the persistent buffers: hidden states [bucket, hidden]."""
        s = self.static
        ids, positions = s.input_ids(bucket), s.positions(bucket)
        return self.model(ids, positions, self._static_max_position, self.kv_cache, s.meta[bucket])

    @torch.inference_mode()
    def capture_decode_graphs(self, backend: GraphBackend) -> CaptureStats:
        """Capture the static decode forward of every bucket (see ``splitserve.engine.runner.cuda_graphs``); later
        decode-only steps replay them. The buffers hold padding while capturing, so the warm-ups write only scratch."""
        assert self.static is not None, "CUDA graphs need the static decode path"
        cfg = self.model.config
        hidden = torch.zeros(self.static.max_batch, cfg.hidden_size, dtype=self.kv_cache.spec.dtype, device=self.device)
        self.graphs = DecodeGraphs(self._static_forward, self.static.buckets, hidden, backend)
        return self.graphs.capture()

    @torch.inference_mode()
    def score(
        self,
        token_ids: list[int],
        block_table: list[int],
        all_positions: bool = True,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """A full prefill of ``token_ids`` into ``block_table``; float32 logits at every position
        ([len(token_ids), vocab]) or, with ``all_positions=False``, at the last one ([1, vocab])."""
        bs = self.block_size
        n = len(token_ids)
        meta = AttentionMetadata(
            slot_blocks=torch.tensor([block_table[p // bs] for p in range(n)], device=self.device),
            slot_offsets=torch.arange(n, device=self.device) % bs,
            prefills=[PrefillChunk(0, n, 0, None, self._table(block_table[: ceil_div(n, bs)]))] if n > 1 else [],
            paged_prefill=self.prefill_attention,
            num_decodes=1 if n == 1 else 0,
            decode_context_lens=[1] if n == 1 else [],
            decode_rows=self._rows(block_table[:1]) if n == 1 else None,
        )
        positions = torch.arange(n, device=self.device)
        hidden = self.model(
            torch.tensor(token_ids, device=self.device), positions, n - 1, self.kv_cache, meta, on_layer_done
        )
        return self.model.compute_logits(hidden if all_positions else hidden[-1:]).float()

    def _table(self, block_ids: list[int] | np.ndarray) -> torch.Tensor | None:
        """A prefill chunk's block ids on the device, for the prefill kernel (None without one)."""
        if self.prefill_attention is None:
            return None
        return self._to_device(np.asarray(block_ids, dtype=np.int64))

    def _rows(self, block_ids: list[int] | np.ndarray) -> torch.Tensor:
        ids = np.asarray(block_ids, dtype=np.int64)
        return context_rows(self._to_device(ids), self.kv_cache.spec.num_kv_heads)

    def plan(self, items: list[ScheduledRequest]) -> tuple[StepPlan, list[ScheduledRequest]]:
        """The step's plan for ``items`` (decodes first), and the items it samples, in its sample rows' order.

        Built on whole arrays: one padded table of the requests' blocks, and every token's position,
        slot block and offset computed from it at once (no per-token Python). Block table entries past a
        request's context are 0, as padding."""
        bs = self.block_size
        num_items = len(items)
        starts = np.fromiter((s.request.num_computed_tokens for s in items), np.int64, num_items)
        counts = np.fromiter((s.num_new_tokens for s in items), np.int64, num_items)
        ends = starts + counts
        offsets = np.cumsum(counts) - counts  # first row of each item in the flattened batch
        num_blocks = ceil_div(ends, bs)  # blocks covering each request's context after this step
        tables = np.zeros((num_items, int(num_blocks.max())), dtype=np.int64)
        for i, item in enumerate(items):
            tables[i, : num_blocks[i]] = self.blocks.block_table(item.request.request_id)[: num_blocks[i]]
        owner = np.repeat(np.arange(num_items), counts)  # the item of every token
        num_tokens = int(counts.sum())
        positions = np.arange(num_tokens) - np.repeat(offsets - starts, counts)
        num_decodes = int(np.count_nonzero(counts == 1))  # decodes (one new token) come first
        input_ids = np.fromiter(
            itertools.chain.from_iterable(
                s.request.token_ids[a:b] for s, a, b in zip(items, starts.tolist(), ends.tolist())
            ),
            np.int64,
            num_tokens,
        )
        width = int(num_blocks[:num_decodes].max()) if num_decodes else 0
        sampled = [i for i, item in enumerate(items) if item.samples]
        plan = StepPlan(
            input_ids=input_ids,
            positions=positions,
            slot_blocks=tables[owner, positions // bs],
            slot_offsets=positions % bs,
            decode_context_lens=ends[:num_decodes],
            decode_tables=tables[:num_decodes, :width],
            prefill_chunks=np.stack([offsets, offsets + counts, starts], axis=1)[num_decodes:],
            prefill_tables=tables[num_decodes:],
            sample_rows=(offsets + counts - 1)[sampled],
            max_position=int(ends.max()) - 1,
        )
        return plan, [items[i] for i in sampled]

    def _inputs(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The plan's tensors on the device: input ids, positions and attention metadata, one copy per tensor."""
        num_decodes = plan.num_decodes
        meta = AttentionMetadata(
            slot_blocks=self._to_device(plan.slot_blocks),
            slot_offsets=self._to_device(plan.slot_offsets),
            num_decodes=num_decodes,
            decode_context_lens=plan.decode_context_lens.tolist(),
            paged_prefill=self.prefill_attention,
        )
        if num_decodes and self.decode_attention is not None:
            meta.paged_decode = self.decode_attention
            meta.decode_tables = self._to_device(plan.decode_tables)
            meta.decode_lens = self._to_device(plan.decode_context_lens)
        elif num_decodes:
            meta.decode_rows = self._rows(plan.decode_tables.reshape(-1))
        for (start, end, computed), table in zip(plan.prefill_chunks.tolist(), plan.prefill_tables):
            blocks = table[: ceil_div(computed + end - start, self.block_size)]
            if self.prefill_attention is not None:  # read in place: no rows to gather
                meta.prefills.append(PrefillChunk(start, end, computed, None, self._table(blocks)))
            else:
                meta.prefills.append(PrefillChunk(start, end, computed, self._rows(blocks) if computed else None))
        return self._to_device(plan.input_ids), self._to_device(plan.positions), meta

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)
