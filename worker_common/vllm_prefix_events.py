"""vLLM's prefix-cache events as the router's block hashes (``VllmPrefixEvents``), so a vLLM prefill or colocated
worker feeds the router's prefix-aware routing as a splitserve worker does (docs/engine.md, "vLLM workers").

vLLM hashes its blocks its own way and at its own block size (128 tokens on CPU); the router hashes a prompt's
blocks with ``splitserve.engine.kv_cache.block_hash`` at ``engine.block_size``. vLLM's KV events carry the token
ids of every block they store and the hash of its parent block, so this class recomputes, for each block vLLM
caches, the router's chained hashes of the full router blocks that block completes:

* ``BlockStored``: each block continues its parent's chain (the router hash at the parent's last full router
  block and the tokens after it); the router blocks it completes are published "stored".
* ``BlockRemoved``: the router blocks a vLLM block completed are published "removed" once no cached vLLM block
  completes them.
* ``AllBlocksCleared``: everything held is removed.

A vLLM block whose parent is not known here (never stored, or removed since) is not mapped: the router then does
not know that prefix, which costs routing quality only. Events of other KV-cache groups (hybrid models) are
ignored. The class stands in for vLLM's event publisher (``publish``), forwarding every batch to the publisher
vLLM built (none, or ZMQ when ``vllm_args`` asks for it), and imports nothing of vLLM.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from splitserve.engine.kv_cache.block_hash import ROOT_HASH, iter_block_hashes
from splitserve.engine.kv_cache.block_manager import BlockEvent


class VllmPrefixEvents:
    """vLLM's KV-cache event batches in; the router's ``BlockEvent``s (at ``block_size``) out."""

    def __init__(self, block_size: int, inner: Any = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {block_size}")
        self.block_size, self.inner = block_size, inner
        self._lock = threading.Lock()
        self._ends: dict[Any, tuple[int, tuple[int, ...]]] = {}  # vLLM hash -> (router chain hash, tokens after it)
        self._owned: dict[Any, tuple[int, ...]] = {}  # vLLM hash -> the router hashes its block completes
        self._copies: Counter = Counter()  # vLLM hash -> blocks vLLM caches under it
        self._held: Counter = Counter()  # router hash -> mapped vLLM blocks completing it
        self._events: list[BlockEvent] = []

    # ---- vLLM's publisher interface -------------------------------------------------------------

    def publish(self, batch: Any) -> None:
        with self._lock:
            for event in batch.events:
                self._apply(event)
        if self.inner is not None:
            self.inner.publish(batch)

    def shutdown(self) -> None:
        if self.inner is not None:
            self.inner.shutdown()

    def __getattr__(self, name: str) -> Any:  # anything else vLLM asks its publisher
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    # ---- the engine's side ----------------------------------------------------------------------

    def take_events(self) -> list[BlockEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def cached_hashes(self) -> list[int]:
        with self._lock:
            return list(self._held)

    # ---- translation ----------------------------------------------------------------------------

    def _apply(self, event: Any) -> None:
        if getattr(event, "group_idx", None) not in (None, 0):
            return
        kind = type(event).__name__
        if kind == "BlockStored":
            self._stored(event)
        elif kind == "BlockRemoved":
            self._removed(list(event.block_hashes))
        elif kind == "AllBlocksCleared":
            self._removed(list(self._copies), everything=True)

    def _stored(self, event: Any) -> None:
        hashes, tokens, size = list(event.block_hashes), list(event.token_ids), int(event.block_size)
        if not hashes or len(tokens) != len(hashes) * size:
            return  # blocks skipped inside the event (windows): their tokens cannot be placed
        parent = event.parent_block_hash
        stored: list[int] = []
        for i, vllm_hash in enumerate(hashes):
            start = self._ends.get(parent) if parent is not None else (ROOT_HASH, ())
            parent = vllm_hash
            self._copies[vllm_hash] += 1
            if self._copies[vllm_hash] > 1 or start is None:
                continue  # a second copy of a mapped block, or one whose parent is unknown here
            chain, rest = start
            block = [*rest, *tokens[i * size : (i + 1) * size]]
            completed = tuple(iter_block_hashes(block, self.block_size, chain))
            full = len(completed) * self.block_size
            self._ends[vllm_hash] = (completed[-1] if completed else chain, tuple(block[full:]))
            self._owned[vllm_hash] = completed
            for h in completed:
                self._held[h] += 1
                if self._held[h] == 1:
                    stored.append(h)
        if stored:
            self._events.append(BlockEvent("stored", tuple(stored)))

    def _removed(self, vllm_hashes: list, everything: bool = False) -> None:
        removed: list[int] = []
        for vllm_hash in vllm_hashes:
            if vllm_hash not in self._copies:
                continue
            self._copies[vllm_hash] = 0 if everything else self._copies[vllm_hash] - 1
            if self._copies[vllm_hash] > 0:
                continue
            del self._copies[vllm_hash]
            self._ends.pop(vllm_hash, None)
            for h in self._owned.pop(vllm_hash, ()):
                self._held[h] -= 1
                if self._held[h] <= 0:
                    del self._held[h]
                    removed.append(h)
        if removed:
            self._events.append(BlockEvent("removed", tuple(removed)))
