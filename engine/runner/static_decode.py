"""The static-shape decode step: a decode-only batch padded to a bucket, in persistent input buffers.

A step where every scheduled request computes exactly one token runs at a fixed batch size, the
smallest bucket (1, 2, 4, 8, ..., ``max_num_seqs``) that holds it, with every input in a buffer that
lives as long as the engine and is overwritten in place each step. So the forward of one bucket always
sees the same tensors at the same addresses and the same shapes: it can be captured once as a CUDA
graph and replayed (``splitserve.engine.runner.cuda_graphs``), and on any device it does no host work per layer.

Padding rows (bucket minus batch) decode token 0 at position 0 with context length 0; their K/V go
to a scratch block that the block manager never hands out (the cache holds one block more than the
manager knows), and their block tables name only that block, so they never read or write a live
block. Table entries past a live row's context also name the scratch block; attention masks them.

Buffers are sized for the largest bucket; bucket b uses their first b rows (views made once).
"""

from __future__ import annotations

import torch

from splitserve.engine.attention.paged_attention import StaticDecodeMetadata
from splitserve.engine.attention.paged_decode import PagedDecodeFn
from splitserve.engine.scheduler.scheduler import ScheduledRequest


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    buckets = []
    size = 1
    while size < max_num_seqs:
        buckets.append(size)
        size *= 2
    return (*buckets, max_num_seqs)


class StaticDecodeInputs:
    # Rows of the int64 ``scalars`` buffer, one value per batch row each.
    INPUT_IDS, POSITIONS, SLOT_BLOCKS, SLOT_OFFSETS, CONTEXT_LENS = range(5)

    def __init__(
        self,
        buckets: tuple[int, ...],
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
        paged_decode: PagedDecodeFn,
    ) -> None:
        self.buckets = buckets
        self.max_batch = buckets[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = device
        self.scalars = torch.zeros(5, self.max_batch, dtype=torch.long, device=device)
        table_shape = (self.max_batch, max_blocks_per_seq)
        self.block_tables = torch.full(table_shape, scratch_block, dtype=torch.int32, device=device)
        self.scalars[self.SLOT_BLOCKS] = scratch_block
        # Filled on the host, then one copy each to the device: from pinned memory, asynchronously. A
        # host buffer is rewritten only at the next step's fill, after that step's sampling has waited
        # for the device. On the CPU the host buffers are the device buffers.
        if device.type == "cpu":
            self._host_scalars, self._host_tables = self.scalars, self.block_tables
        else:
            pin = device.type == "cuda"
            self._host_scalars = self.scalars.cpu().pin_memory() if pin else self.scalars.cpu()
            self._host_tables = self.block_tables.cpu().pin_memory() if pin else self.block_tables.cpu()
        self.meta = {b: self._metadata(b, paged_decode) for b in buckets}

    def _metadata(self, bucket: int, paged_decode: PagedDecodeFn) -> StaticDecodeMetadata:
        s = self.scalars
        return StaticDecodeMetadata(
            slot_blocks=s[self.SLOT_BLOCKS, :bucket],
            slot_offsets=s[self.SLOT_OFFSETS, :bucket],
            block_tables=self.block_tables[:bucket],
            context_lens=s[self.CONTEXT_LENS, :bucket],
            paged_decode=paged_decode,
        )

    def input_ids(self, bucket: int) -> torch.Tensor:
        return self.scalars[self.INPUT_IDS, :bucket]

    def positions(self, bucket: int) -> torch.Tensor:
        return self.scalars[self.POSITIONS, :bucket]

    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket holding ``batch`` rows; None when none does."""
        return next((b for b in self.buckets if b >= batch), None)

    def fits(self, items: list[ScheduledRequest]) -> bool:
        """Whether this decode batch can run here: a bucket holds it and every context fits the table width."""
        if self.bucket_for(len(items)) is None:
            return False
        limit = self.max_blocks_per_seq * self.block_size
        return all(s.request.num_computed_tokens + 1 <= limit for s in items)

    def fill(self, items: list[ScheduledRequest], tables: list[list[int]]) -> int:
        """Write one decode per item (``tables``: each one's block table) into the first rows, pad the
        rest of the bucket, and return the bucket."""
        bucket = self.bucket_for(len(items))
        bs, scratch = self.block_size, self.scratch_block
        pad = bucket - len(items)
        ids, positions, blocks, offsets, lens = [], [], [], [], []
        table_rows, table_cols, table_ids = [], [], []
        for row, (item, table) in enumerate(zip(items, tables)):
            position = item.request.num_computed_tokens
            used = position // bs + 1
            ids.append(item.request.token_ids[position])
            positions.append(position)
            blocks.append(table[position // bs])
            offsets.append(position % bs)
            lens.append(position + 1)
            table_rows.extend([row] * used)
            table_cols.extend(range(used))
            table_ids.extend(table[:used])
        self._host_scalars[:, :bucket] = torch.tensor(
            [ids + [0] * pad, positions + [0] * pad, blocks + [scratch] * pad, offsets + [0] * pad, lens + [0] * pad]
        )
        host_tables = self._host_tables[:bucket]
        host_tables.fill_(scratch)
        host_tables[torch.tensor(table_rows), torch.tensor(table_cols)] = torch.tensor(table_ids, dtype=torch.int32)
        if self._host_scalars is not self.scalars:
            # All of the (small) scalars buffer, contiguous; rows past the bucket are never read.
            self.scalars.copy_(self._host_scalars, non_blocking=True)
            self.block_tables[:bucket].copy_(host_tables, non_blocking=True)
        return bucket
