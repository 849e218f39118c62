"""ModelRunner.plan builds the flattened batch on whole arrays, and _inputs its tensors; together they must
give exactly the metadata of the per-token loop they replaced (kept below as the reference) on batches
mixing decodes, fresh prefills and later chunks, with block tables longer than the context (blocks
allocated ahead)."""

from __future__ import annotations

import random

import torch

from splitserve.common.arith import ceil_div
from splitserve.engine.attention.paged_attention import AttentionMetadata, PrefillChunk
from splitserve.engine.kv_cache.block_manager import BlockManager
from splitserve.engine.kv_cache.cache import KVCache, KVCacheSpec, context_rows
from splitserve.engine.runner.model_runner import ModelRunner
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.sampling.sampler import Sampler
from splitserve.engine.scheduler.request import Request
from splitserve.engine.scheduler.scheduler import ScheduledRequest

BLOCK_SIZE = 4
KV_HEADS = 2


def reference_prepare(runner: ModelRunner, items: list[ScheduledRequest]):
    """The per-token loop the runner used to run."""
    bs = runner.block_size

    def rows(block_ids):
        return context_rows(torch.tensor(block_ids), KV_HEADS)

    input_ids, positions, slot_blocks, slot_offsets, sample_rows = [], [], [], [], []
    decode_tables, decode_lens, prefills = [], [], []
    for item in items:
        request, n = item.request, item.num_new_tokens
        start, end = request.num_computed_tokens, request.num_computed_tokens + n
        table = runner.blocks.block_table(request.request_id)
        offset = len(input_ids)
        input_ids.extend(request.token_ids[start:end])
        positions.extend(range(start, end))
        slot_blocks.extend(table[p // bs] for p in range(start, end))
        slot_offsets.extend(p % bs for p in range(start, end))
        if n == 1:
            decode_tables.append(table[: ceil_div(end, bs)])
            decode_lens.append(end)
        else:
            prefills.append(
                PrefillChunk(offset, offset + n, start, rows(table[: ceil_div(end, bs)]) if start else None)
            )
        if item.samples:
            sample_rows.append((offset + n - 1, item))
    meta = AttentionMetadata(
        torch.tensor(slot_blocks),
        torch.tensor(slot_offsets),
        len(decode_tables),
        decode_context_lens=decode_lens,
        prefills=prefills,
    )
    if decode_tables:
        width = max(len(t) for t in decode_tables)
        meta.decode_rows = rows([b for t in decode_tables for b in t + [0] * (width - len(t))])
    return torch.tensor(input_ids), torch.tensor(positions), meta, sample_rows


def prepare(runner: ModelRunner, items: list[ScheduledRequest]):
    """What the dynamic path computes from ``items`` (decodes first): input ids, positions, attention
    metadata, and the (row, item) pairs it samples."""
    plan, sampled = runner.plan(items)
    return (*runner._inputs(plan), list(zip(plan.sample_rows.tolist(), sampled)))


def make_runner(num_blocks: int = 256) -> ModelRunner:
    spec = KVCacheSpec(
        num_layers=1,
        num_kv_heads=KV_HEADS,
        head_dim=2,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        dtype=torch.float32,
    )
    return ModelRunner(None, KVCache(spec, "cpu"), BlockManager(num_blocks, BLOCK_SIZE, False), Sampler())


def make_item(
    runner: ModelRunner, rng: random.Random, name: str, prompt: int, computed: int, new: int, extra_blocks: int
) -> ScheduledRequest:
    request = Request(name, [rng.randrange(1000) for _ in range(prompt)], SamplingParams(max_tokens=4))
    request.num_computed_tokens = computed
    assert runner.blocks.allocate(name, computed + new + extra_blocks * BLOCK_SIZE)
    return ScheduledRequest(request, new)


def assert_same(got, want) -> None:
    (ids, pos, meta, samples), (ref_ids, ref_pos, ref_meta, ref_samples) = got, want
    assert torch.equal(ids, ref_ids) and torch.equal(pos, ref_pos)
    assert torch.equal(meta.slot_blocks, ref_meta.slot_blocks) and torch.equal(meta.slot_offsets, ref_meta.slot_offsets)
    assert meta.num_decodes == ref_meta.num_decodes and meta.decode_context_lens == ref_meta.decode_context_lens
    assert (meta.decode_rows is None) == (ref_meta.decode_rows is None)
    if meta.decode_rows is not None:
        assert torch.equal(meta.decode_rows, ref_meta.decode_rows)
    assert len(meta.prefills) == len(ref_meta.prefills)
    for chunk, ref in zip(meta.prefills, ref_meta.prefills):
        assert (chunk.start, chunk.end, chunk.num_computed) == (ref.start, ref.end, ref.num_computed)
        assert (chunk.context_rows is None) == (ref.context_rows is None)
        if chunk.context_rows is not None:
            assert torch.equal(chunk.context_rows, ref.context_rows)
    assert [(row, item.request.request_id) for row, item in samples] == [
        (row, item.request.request_id) for row, item in ref_samples
    ]


def test_plan_and_inputs_match_the_per_token_loop_on_mixed_batches():
    rng = random.Random(0)
    for trial in range(20):
        runner = make_runner()
        decodes, prefills = [], []
        for i in range(rng.randint(0, 6)):  # decodes of various lengths, some at a block edge
            length = rng.choice([1, BLOCK_SIZE, BLOCK_SIZE + 1, rng.randint(2, 40)])
            decodes.append(make_item(runner, rng, f"d{trial}-{i}", length + 1, length, 1, rng.randint(0, 2)))
        for i in range(rng.randint(0 if decodes else 1, 3)):  # fresh prompts, later chunks, partial chunks
            prompt = rng.randint(2, 30)
            computed = rng.choice([0, 0, rng.randint(1, prompt - 1)])
            new = rng.randint(2, max(2, prompt - computed)) if prompt - computed >= 2 else 2
            prefills.append(
                make_item(runner, rng, f"p{trial}-{i}", max(prompt, computed + new), computed, new, rng.randint(0, 2))
            )
        items = decodes + prefills
        assert_same(prepare(runner, items), reference_prepare(runner, items))
