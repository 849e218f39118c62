"""Runs one scheduled step on the device: builds the flattened batch, runs the model, samples.

The only engine module that touches tensors on the device besides the model itself. Decodes (one
new token) go first in the flattened batch, then prefill chunks, as ``engine.attention`` expects.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata, PrefillChunk
from engine.block_manager import BlockManager
from engine.kv_cache import KVCache, context_rows
from engine.model import CausalLM
from engine.sampler import Sampler
from engine.scheduler import ScheduledRequest, SchedulerOutput


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, blocks: BlockManager, sampler: Sampler) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.blocks = blocks
        self.sampler = sampler
        self.device = kv_cache.device
        self.block_size = blocks.block_size

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, on_layer_done: Callable[[int], None] | None = None) -> dict[str, int]:
        """Compute every scheduled token's K/V; returns the sampled token of each request that samples.

        ``on_layer_done`` is passed to the model (see ``CausalLM.forward``)."""
        if output.is_empty:
            return {}
        items = [s for s in output.scheduled if s.num_new_tokens == 1]
        items += [s for s in output.scheduled if s.num_new_tokens > 1]
        input_ids, positions, meta, sample_rows = self._prepare(items)
        max_position = max(s.request.num_computed_tokens + s.num_new_tokens for s in items) - 1
        hidden = self.model(input_ids, positions, max_position, self.kv_cache, meta, on_layer_done)
        if not sample_rows:
            return {}
        rows = torch.tensor([row for row, _ in sample_rows], device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        requests = [s.request for _, s in sample_rows]
        tokens = self.sampler(logits, requests)
        return {r.request_id: t for r, t in zip(requests, tokens)}

    @torch.inference_mode()
    def score(self, token_ids: list[int], block_table: list[int], all_positions: bool = True,
              on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:  # fmt: skip
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
        hidden = self.model(torch.tensor(token_ids, device=self.device), positions, n - 1, self.kv_cache, meta,
                            on_layer_done)  # fmt: skip
        return self.model.compute_logits(hidden if all_positions else hidden[-1:]).float()

    def _rows(self, block_ids: list[int]) -> torch.Tensor:
        return context_rows(torch.tensor(block_ids, device=self.device), self.kv_cache.spec.num_kv_heads)

    def _prepare(self, items: list[ScheduledRequest]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        sample_rows: list[tuple[int, ScheduledRequest]] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for item in items:
            request, n = item.request, item.num_new_tokens
            start, end = request.num_computed_tokens, request.num_computed_tokens + n
            table = self.blocks.block_table(request.request_id)
            offset = len(input_ids)
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            slot_blocks.extend(table[p // bs] for p in range(start, end))
            slot_offsets.extend(p % bs for p in range(start, end))
            if n == 1:
                decode_tables.append(table[: -(-end // bs)])
                decode_lens.append(end)
            else:
                rows = self._rows(table[: -(-end // bs)]) if start else None
                prefills.append(PrefillChunk(offset, offset + n, start, rows))
            if item.samples:
                sample_rows.append((offset + n - 1, item))
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, device=self.device),
            slot_offsets=torch.tensor(slot_offsets, device=self.device),
            num_decodes=len(decode_tables),
            decode_context_lens=decode_lens,
            prefills=prefills,
        )
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            meta.decode_rows = self._rows([b for t in padded for b in t])
        return (
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            meta,
            sample_rows,
        )
