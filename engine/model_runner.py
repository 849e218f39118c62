"""Runs one scheduled step on the device: builds the flattened batch, runs the model, samples.

The only engine module that touches tensors on the device besides the model itself. Two paths:

- dynamic (every step can take it): decodes (one new token) go first in the flattened batch, then
  prefill chunks, as ``splitserve.engine.attention`` expects; shapes follow the step.
- static (decode-only steps, when the runner has ``StaticDecodeInputs``): the batch padded to a bucket
  in persistent buffers (``splitserve.engine.static_decode``), attention by
  ``splitserve.engine.paged_decode``, and on CUDA
  a replay of the bucket's captured graph (``splitserve.engine.cuda_graphs``). A step with a prefill chunk, a
  layer hook (a prefill worker streaming layer groups) or more decodes than the largest bucket takes
  the dynamic path.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

from splitserve.common.arith import ceil_div
from splitserve.engine.attention import AttentionMetadata, PrefillChunk
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.cuda_graphs import CaptureStats, DecodeGraphs, GraphBackend
from splitserve.engine.kv_cache import KVCache, context_rows
from splitserve.engine.model import CausalLM
from splitserve.engine.sampler import Sampler
from splitserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from splitserve.engine.static_decode import StaticDecodeInputs


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        blocks: BlockManager,
        sampler: Sampler,
        static_decode: StaticDecodeInputs | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.blocks = blocks
        self.sampler = sampler
        self.device = kv_cache.device
        self.block_size = blocks.block_size
        self.static = static_decode
        self.graphs: DecodeGraphs | None = None
        self.num_static_steps = 0  # decode steps the static path ran, for tests and stats
        if static_decode is not None:
            # Rotary tables sized once for every position a table can hold: they must not be
            # reallocated under a captured graph.
            self._static_max_position = static_decode.max_blocks_per_seq * self.block_size - 1
            model.rotary.ensure(self._static_max_position + 1)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, on_layer_done: Callable[[int], None] | None = None) -> dict[str, int]:
        """Compute every scheduled token's K/V; returns the sampled token of each request that samples.

        ``on_layer_done`` is passed to the model (see ``CausalLM.forward``)."""
        if output.is_empty:
            return {}
        if self._takes_static_path(output, on_layer_done):
            return self._execute_static(list(output.scheduled))
        items = [s for s in output.scheduled if s.num_new_tokens == 1]
        items += [s for s in output.scheduled if s.num_new_tokens > 1]
        input_ids, positions, meta, sample_rows = self._prepare(items)
        max_position = max(s.request.num_computed_tokens + s.num_new_tokens for s in items) - 1
        hidden = self.model(input_ids, positions, max_position, self.kv_cache, meta, on_layer_done)
        if not sample_rows:
            return {}
        if len(sample_rows) < hidden.shape[0]:  # else every row samples, in order (a pure decode step)
            hidden = hidden.index_select(0, torch.tensor([row for row, _ in sample_rows], device=self.device))
        logits = self.model.compute_logits(hidden)
        requests = [s.request for _, s in sample_rows]
        tokens = self.sampler(logits, requests)
        return {r.request_id: t for r, t in zip(requests, tokens)}

    def _takes_static_path(self, output: SchedulerOutput, on_layer_done) -> bool:
        return (
            self.static is not None
            and on_layer_done is None
            and all(s.num_new_tokens == 1 for s in output.scheduled)
            and self.static.fits(list(output.scheduled))
        )

    def _execute_static(self, items: list[ScheduledRequest]) -> dict[str, int]:
        tables = [self.blocks.block_table(s.request.request_id) for s in items]
        bucket = self.static.fill(items, tables)
        hidden = self.graphs.replay(bucket) if self.graphs is not None else self._static_forward(bucket)
        self.num_static_steps += 1
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
        """Capture the static decode forward of every bucket (see ``splitserve.engine.cuda_graphs``); later decode-only
        steps replay them. The buffers hold padding while capturing, so the warm-ups write only scratch."""
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
            prefills=[PrefillChunk(0, n, 0, None)] if n > 1 else [],
            num_decodes=1 if n == 1 else 0,
            decode_context_lens=[1] if n == 1 else [],
            decode_rows=self._rows(block_table[:1]) if n == 1 else None,
        )
        positions = torch.arange(n, device=self.device)
        hidden = self.model(
            torch.tensor(token_ids, device=self.device), positions, n - 1, self.kv_cache, meta, on_layer_done
        )
        return self.model.compute_logits(hidden if all_positions else hidden[-1:]).float()

    def _rows(self, block_ids: list[int] | np.ndarray) -> torch.Tensor:
        ids = np.asarray(block_ids, dtype=np.int64)
        return context_rows(self._to_device(ids), self.kv_cache.spec.num_kv_heads)

    def _prepare(self, items: list[ScheduledRequest]):
        """The flattened batch of ``items`` (decodes first): input ids, positions, attention metadata, and
        the (row, item) pairs to sample.

        Built on whole arrays: one padded table of the requests' blocks, and every token's position,
        slot block and offset computed from it at once (no per-token Python), then moved to the device
        in one copy per tensor. Block table entries past a request's context are 0, as padding."""
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
        positions = np.arange(int(counts.sum())) - np.repeat(offsets - starts, counts)
        num_decodes = int(np.count_nonzero(counts == 1))  # decodes (one new token) come first
        input_ids = list(
            itertools.chain.from_iterable(
                s.request.token_ids[a:b] for s, a, b in zip(items, starts.tolist(), ends.tolist())
            )
        )
        meta = AttentionMetadata(
            slot_blocks=self._to_device(tables[owner, positions // bs]),
            slot_offsets=self._to_device(positions % bs),
            num_decodes=num_decodes,
            decode_context_lens=ends[:num_decodes].tolist(),
        )
        if num_decodes:
            width = int(num_blocks[:num_decodes].max())
            meta.decode_rows = self._rows(tables[:num_decodes, :width].reshape(-1))
        for i in range(num_decodes, num_items):
            rows = self._rows(tables[i, : num_blocks[i]]) if starts[i] else None
            meta.prefills.append(PrefillChunk(int(offsets[i]), int(offsets[i] + counts[i]), int(starts[i]), rows))
        sample_rows = [(int(offsets[i] + counts[i] - 1), item) for i, item in enumerate(items) if item.samples]
        return torch.tensor(input_ids, device=self.device), self._to_device(positions), meta, sample_rows

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)
