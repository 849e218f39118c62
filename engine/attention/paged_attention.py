"""Attention over the paged KV cache, for a flattened batch mixing decodes and prefill chunks.

A forward pass sees T tokens flattened into one dimension: first one token per decoding request,
then every prefill chunk, one request after another. ``AttentionMetadata`` says where each request's
tokens are and which cache blocks hold its context; it is built once per step on the host and
shared by every layer.

- Decodes (one query each) are batched. With a ``paged_decode`` backend that reads the cache in place
  (``AttentionMetadata.paged_decode``: the CPU kernel, Triton on CUDA) they are attended through their
  block tables, nothing gathered; otherwise their blocks are gathered into ``[kv_heads, B, L, d]``, padded
  to the longest context and masked, then one SDPA call.
- Prefill chunks go one request at a time. With a prefill kernel (``AttentionMetadata.paged_prefill``: the
  CPU kernel, float32) each chunk attends its whole context straight from the cache through its block
  table (``PrefillChunk.table``). Otherwise through ``scaled_dot_product_attention``: against their own
  fresh keys when nothing precedes the chunk (plain causal), else against the gathered context
  (cached prefix or earlier chunks) with a causal mask shifted by what precedes the chunk.

A decode-only step may instead come with ``StaticDecodeMetadata`` (the model runner's static path):
a padded batch of decodes whose slots, block tables and lengths are device tensors of fixed shape,
attended by a ``splitserve.engine.attention.paged_decode`` backend with no host work per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from splitserve.engine.attention.paged_decode import PagedDecodeFn
from splitserve.engine.kv_cache.cache import gather_context, write_kv


@dataclass
class PrefillChunk:
    start: int  # first token of the chunk in the flattened batch
    end: int
    num_computed: int  # tokens of this request already in the cache before the chunk
    context_rows: (
        torch.Tensor | None
    )  # kv_cache.context_rows of the blocks covering the context; None if num_computed == 0

    # The request's block ids covering the context (int64, on the device), for a prefill kernel; None without one.
    table: torch.Tensor | None = None

    @property
    def context_len(self) -> int:
        return self.num_computed + self.end - self.start


# A prefill kernel: (q [Tq, heads, d], cache_layer, table [blocks], context_len, scale, window) -> [Tq, heads, d],
# the chunk's queries at positions [context_len - Tq, context_len) attending causally to the cached context.
PagedPrefillFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float, int | None], torch.Tensor]


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] int64: cache block of every token
    slot_offsets: torch.Tensor  # [T] int64: offset within that block
    num_decodes: int = 0
    decode_rows: torch.Tensor | None = None  # kv_cache.context_rows of the padded decode block tables
    decode_context_lens: list[int] = field(default_factory=list)
    # The decodes' attention read in place: a paged_decode backend, the decodes' block tables [B, width] and
    # context lengths [B] (int64, on the device). None: the gather through ``decode_rows``.
    paged_decode: PagedDecodeFn | None = None
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # The prefill chunks' attention read from the cache through each chunk's table (None: SDPA, as above).
    paged_prefill: PagedPrefillFn | None = None
    # The decode batch's key span and mask, one per sliding window (None = full attention); built
    # lazily, shared by every layer with the same window.
    _decode_spans: dict[int | None, tuple[int, int, torch.Tensor | None]] = field(default_factory=dict)

    def decode_span(self, window: int | None, device: torch.device) -> tuple[int, int, torch.Tensor | None]:
        if window not in self._decode_spans:
            self._decode_spans[window] = _decode_span(self.decode_context_lens, window, device)
        return self._decode_spans[window]


@dataclass(frozen=True)
class StaticDecodeMetadata:
    """A padded decode-only batch: one token per row, every tensor persistent and of fixed shape."""

    slot_blocks: torch.Tensor  # [B] int64: cache block each row's new K/V goes to (padding: a scratch block)
    slot_offsets: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32
    context_lens: torch.Tensor  # [B] int32, the new token included; 0 for padding rows
    paged_decode: PagedDecodeFn


def _decode_span(lens: list[int], window: int | None, device: torch.device) -> tuple[int, int, torch.Tensor | None]:
    """The key positions [start, end) that some decode of the batch attends to, and a boolean mask
    [B, 1, 1, end - start] of those each one does (None when all do). Keys are cut to exactly that
    span, as transformers' cache holds them (a sliding-window layer keeps only its window), so that
    the attention kernel sums the same terms in the same blocks and bf16 results agree with it."""
    end = max(lens)
    start = 0 if window is None else max(0, min(lens) - window)
    pos = torch.arange(start, end)
    ctx = torch.tensor(lens)[:, None]
    allowed = pos[None, :] < ctx
    if window is not None:
        allowed &= pos[None, :] > ctx - 1 - window
    if bool(allowed.all()):
        return start, end, None
    return start, end, allowed[:, None, None, :].to(device)  # broadcast over [B, heads, 1, L]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata | StaticDecodeMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q [T, heads, d], k/v [T, kv_heads, d] -> [T, heads, d]; also stores k/v in the layer's cache."""
    write_kv(cache, k, v, meta.slot_blocks, meta.slot_offsets)
    if isinstance(meta, StaticDecodeMetadata):
        return meta.paged_decode(q, cache, meta.block_tables, meta.context_lens, scale, window)
    parts = []
    if meta.num_decodes:
        parts.append(_decode(q[: meta.num_decodes], cache, meta, scale, window))
    for chunk in meta.prefills:
        if meta.paged_prefill is not None and chunk.table is not None:
            parts.append(
                meta.paged_prefill(q[chunk.start : chunk.end], cache, chunk.table, chunk.context_len, scale, window)
            )
        else:
            parts.append(_prefill(q, k, v, cache, chunk, scale, window))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _decode(q, cache, meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    if meta.paged_decode is not None:
        return meta.paged_decode(q, cache, meta.decode_tables, meta.decode_lens, scale, window)
    keys, values = gather_context(cache, meta.decode_rows, q.shape[0])  # [kv_heads, B, blocks * block_size, d]
    start, end, mask = meta.decode_span(window, q.device)
    keys, values = keys[:, :, start:end].transpose(0, 1), values[:, :, start:end].transpose(0, 1)  # [B, kv_heads, L, d]
    # SDPA, as transformers decodes: its kernel keeps the scores in float32 for bf16/fp16 inputs (a
    # plain bf16 matmul would round them to bf16 before the softmax, and greedy output would drift).
    # Each KV head's query group is folded into the query axis ([B, kv_heads, group, d]), as transformers'
    # ``pack_gqa`` does where it passes a mask: one work item and two small GEMMs per (row, KV head) instead
    # of per query head. Without a mask transformers lets SDPA broadcast the KV heads instead; the two forms
    # differ in about one output element in 10^3-10^4, by one bf16 step, within the bf16 tie rule, and the
    # folded one is 6-11x faster at one row on a CPU (docs/performance.md, "Decode attention with the query
    # group folded").
    batch, heads, head_dim = q.shape
    grouped = q.view(batch, keys.shape[1], heads // keys.shape[1], head_dim)  # [B, kv_heads, group, d]
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, head_dim)


def _prefill(q, k, v, cache, chunk: PrefillChunk, scale: float, window: int | None) -> torch.Tensor:
    query = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, heads, Tq, d]
    if chunk.num_computed == 0:
        keys = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        values = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
    else:
        keys, values = gather_context(cache, chunk.context_rows, 1)  # [kv_heads, 1, L, d]
        keys = keys[:, :, : chunk.context_len].transpose(0, 1)
        values = values[:, :, : chunk.context_len].transpose(0, 1)
    num_q, num_k = query.shape[2], keys.shape[2]
    if window is None and num_q == num_k:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        qpos = torch.arange(num_k - num_q, num_k, device=q.device)[:, None]
        kpos = torch.arange(num_k, device=q.device)[None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)  # [Tq, heads, d]
