"""Decode attention that reads K/V straight from the paged cache through block tables, at static shapes.

One query per row. Every row carries a block table padded to the same width (``max_blocks``) and its
context length; nothing about the batch is read on the host, so a step of a given batch size always
launches the same operations on the same shapes, which is what a CUDA graph needs.

The contract every backend meets (``PagedDecodeFn``)::

    paged_decode(q [B, H, d], cache_layer [num_blocks, 2, kv_heads, block_size, d],
                 block_tables [B, max_blocks] int32/int64, context_lens [B] int,
                 scale: float, window: int | None) -> [B, H, d]

- Row b attends to key positions ``[max(0, len - window), len)`` of its table (all of ``[0, len)``
  without a window), where ``len = context_lens[b]``.
- A row with ``context_lens[b] == 0`` (batch padding) attends to position 0 of its first block
  instead: its output is finite and meaningless. Table entries past a row's context may name any
  block (a dummy one): they are never attended to, so they never disturb a live row.

``paged_decode_torch`` is the reference, always available. Faster backends (a Triton kernel on CUDA,
``engine/attention/triton_paged_decode.py``; a C++ kernel on the CPU that reads the cache in place,
``engine/attention/cpu_paged_decode.py``) are listed in their module's ``BACKENDS`` and registered on the first
selection (``OPTIONAL_PRIORITIES`` ranks them), or with ``register_backend``; ``select_backend`` returns the
preferred one available for a device and dtype. A ``BACKENDS`` entry is ``(name, fn, is_available(device))``,
or ``(name, fn, is_available(device), dtypes)`` for a backend that runs only those dtypes.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PagedDecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, "int | None"], torch.Tensor]

# Modules that register a backend when imported; absent ones are skipped.
OPTIONAL_BACKEND_MODULES = (
    "splitserve.engine.attention.triton_paged_decode",
    "splitserve.engine.attention.cpu_paged_decode",
)
# The Triton kernel is preferred over the torch reference where it runs (CUDA). FlashInfer and
# FlashAttention rank below the reference, so they run only when named: FlashInfer's plan reads the
# lengths on the host (a CUDA graph cannot capture it) and FlashAttention 2 needs 256-token pages. The CPU
# kernel, where it builds, is faster than the reference's gather at every measured shape (docs/performance.md).
OPTIONAL_PRIORITIES = {"triton": 20, "cpu": 20}

log = logging.getLogger(__name__)


def paged_decode_torch(
    q: torch.Tensor,
    cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """The reference: gather every row's ``max_blocks`` blocks, mask by length and window, one SDPA call.

    SDPA keeps the scores in float32 for bf16/fp16 inputs, as the dynamic path (``attention._decode``)
    and transformers do; each KV head's query group is folded into the query axis, since a mask is
    always passed."""
    batch, heads, head_dim = q.shape
    num_blocks, _, kv_heads, block_size, _ = cache_layer.shape
    max_blocks = block_tables.shape[1]
    # Rows of the cache viewed as [blocks * 2 * kv_heads, block_size * d], ordered (row, K/V, head, block)
    # so one index_select lands in attention's layout (as kv_cache.context_rows does for one table).
    kv_head = torch.arange(2 * kv_heads, device=q.device).view(1, 2, kv_heads, 1)
    rows = block_tables.long().view(batch, 1, 1, max_blocks) * (2 * kv_heads) + kv_head
    gathered = cache_layer.view(num_blocks * 2 * kv_heads, block_size * head_dim).index_select(0, rows.reshape(-1))
    gathered = gathered.view(batch, 2, kv_heads, max_blocks * block_size, head_dim)
    keys, values = gathered[:, 0], gathered[:, 1]  # [B, kv_heads, L, d]
    lens = context_lens.to(device=q.device, dtype=torch.long).clamp(min=1)[:, None]  # padding rows: position 0
    pos = torch.arange(max_blocks * block_size, device=q.device)[None, :]
    allowed = pos < lens
    if window is not None:
        allowed &= pos >= lens - window
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=allowed[:, None, None, :], scale=scale)
    return out.reshape(batch, heads, head_dim)


@dataclass(frozen=True)
class PagedDecodeBackend:
    name: str
    fn: PagedDecodeFn
    is_available: Callable[[torch.device, torch.dtype], bool]
    priority: int  # the highest available one is selected


class BackendRegistry:
    """Named paged-decode backends; ``select`` picks the highest-priority one available."""

    def __init__(self) -> None:
        self._backends: dict[str, PagedDecodeBackend] = {}
        self._optional_imported = False

    def register(
        self,
        name: str,
        fn: PagedDecodeFn,
        is_available: Callable[[torch.device, torch.dtype], bool],
        priority: int = 10,
    ) -> None:
        if name in self._backends:
            raise ValueError(f"paged decode backend {name!r} is already registered")
        self._backends[name] = PagedDecodeBackend(name, fn, is_available, priority)

    def names(self) -> list[str]:
        self._import_optional()
        return sorted(self._backends)

    def select(self, device: torch.device | str, dtype: torch.dtype, name: str | None = None) -> PagedDecodeBackend:
        """The named backend (ValueError when unknown or unavailable here), else the preferred available one."""
        self._import_optional()
        device = torch.device(device)
        if name is not None:
            backend = self._backends.get(name)
            if backend is None:
                raise ValueError(f"paged_decode backend: unknown {name!r} (known: {', '.join(self.names())})")
            if not backend.is_available(device, dtype):
                raise ValueError(f"paged_decode backend: {name!r} is not available on {device} for {dtype}")
            return backend
        available = [b for b in self._backends.values() if b.is_available(device, dtype)]
        return max(available, key=lambda b: b.priority)

    def _import_optional(self) -> None:
        if self._optional_imported:
            return
        self._optional_imported = True
        for module in OPTIONAL_BACKEND_MODULES:
            try:
                loaded = importlib.import_module(module)
            except ImportError as e:  # absent, or what it needs (triton) is not installed here
                log.debug("paged decode backend module %s not loaded: %s", module, e)
                continue
            for name, fn, available, *dtypes in getattr(loaded, "BACKENDS", ()):
                if name not in self._backends:
                    self.register(
                        name,
                        fn,
                        lambda device, dtype, available=available, dtypes=dtypes: (
                            (not dtypes or dtype in dtypes[0]) and available(device)
                        ),
                        priority=OPTIONAL_PRIORITIES.get(name, -1),
                    )


# The process's registry: backends are code, registered at import like codecs, not configuration.
REGISTRY = BackendRegistry()
REGISTRY.register("torch", paged_decode_torch, lambda device, dtype: True, priority=0)


def register_backend(
    name: str, fn: PagedDecodeFn, is_available: Callable[[torch.device, torch.dtype], bool], priority: int = 10
) -> None:
    REGISTRY.register(name, fn, is_available, priority)


def select_backend(device: torch.device | str, dtype: torch.dtype, name: str | None = None) -> PagedDecodeBackend:
    return REGISTRY.select(device, dtype, name)
