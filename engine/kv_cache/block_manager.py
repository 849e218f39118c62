"""Paged KV-cache bookkeeping: ref-counted blocks, per-request block tables and the prefix cache.

Pure Python (no torch) so schedulers and the router's policies can be unit-tested without devices.

Block states (every block is in exactly one; ``check_integrity()`` proves it)::

    FREE ──allocate──▶ IN_USE (ref ≥ 1) ──free, ref→0, unhashed──▶ FREE
                         │  ▲
      full block hashed  │  │ prefix hit (ref += 1)
                         ▼  │
                       IN_USE, hashed ──free, ref→0──▶ CACHED (evictable, LRU) ──evicted──▶ FREE

- FREE: ref 0, no hash, in the free deque.
- IN_USE: ref = number of request block tables that hold it. A hashed in-use block is shared by
  every request whose prompt has that prefix.
- CACHED: ref 0 but hashed; kept for future prefix hits, reused (evicted, least recently freed
  first) only when the free deque is empty.

A request's table is created by its first ``allocate`` and lives until ``free``. Full blocks become
prefix-cache entries when ``cache_blocks`` is told their KV has been computed; a block's hash chains
over every token before it (``splitserve.engine.kv_cache.block_hash``), so a hit is always a whole prefix.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from splitserve.common.arith import ceil_div
from splitserve.engine.kv_cache.block_hash import ROOT_HASH, hash_block


class BlockIntegrityError(AssertionError):
    """The allocator's invariants do not hold (a bug, never bad input)."""


@dataclass(frozen=True)
class BlockEvent:
    """A change to the prefix cache, published so a router can track which worker holds which prefix."""

    kind: Literal["stored", "removed"]
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrefixHit:
    """The cached blocks that cover a prompt's leading full blocks."""

    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


NO_HIT = PrefixHit((), ())


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.record_events = record_events
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # CACHED blocks, LRU first
        self._hash_to_block: dict[int, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._chains: dict[str, list[int]] = {}  # hashes of each request's full blocks, in order
        self._events: list[BlockEvent] = []

    # ---- status, derived from the allocator itself -------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks kept for prefix hits."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids, in token order (a live view: do not modify)."""
        return self._tables[request_id]

    # ---- prefix cache -------------------------------------------------------------------------

    def lookup_prefix(self, token_ids: Sequence[int]) -> PrefixHit:
        """Cached blocks covering the longest prefix of ``token_ids``, in whole blocks.

        At least one token is always left uncovered: the model must run on it to produce logits.
        Read-only: nothing is referenced until ``allocate`` takes the hit.
        """
        if not self.enable_prefix_caching:
            return NO_HIT
        block_ids: list[int] = []
        hashes: list[int] = []
        parent = ROOT_HASH
        max_blocks = (len(token_ids) - 1) // self.block_size
        for i in range(max_blocks):
            parent = hash_block(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self._hash_to_block.get(parent)
            if block is None:
                break
            block_ids.append(block)
            hashes.append(parent)
        return PrefixHit(tuple(block_ids), tuple(hashes))

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Make the request's full blocks within its first ``num_computed_tokens`` prefix-cache entries.

        Call only once their KV is really in the cache. If another block already holds the same
        prefix (two requests computed it concurrently), the existing entry stays and this block
        remains private to the request.
        """
        if not self.enable_prefix_caching:
            return
        chain = self._chains[request_id]
        table = self._tables[request_id]
        num_full = min(num_computed_tokens // self.block_size, len(table))
        stored: list[int] = []
        for i in range(len(chain), num_full):
            parent = chain[-1] if chain else ROOT_HASH
            h = hash_block(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            chain.append(h)
            block = table[i]
            if h not in self._hash_to_block and self._hash[block] is None:
                self._hash_to_block[h] = block
                self._hash[block] = h
                stored.append(h)
        if stored and self.record_events:
            self._events.append(BlockEvent("stored", tuple(stored)))

    def holds_hash(self, block_hash: int) -> bool:
        """Whether the prefix cache holds a block of this hash now (in use or evictable)."""
        return block_hash in self._hash_to_block

    def cached_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds now (in use or evictable): a router's snapshot."""
        return list(self._hash_to_block)

    def take_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events

    # ---- allocation ---------------------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Grow the request's table to cover ``num_tokens`` tokens; all or nothing.

        The first call creates the table and may take a prefix ``hit`` (from ``lookup_prefix``,
        in the same scheduling step). Returns False, changing nothing, when blocks are short.
        """
        table = self._tables.get(request_id)
        if table is not None and hit.num_blocks:
            raise ValueError(f"request {request_id!r} already has blocks; a prefix hit applies only to a new one")
        missing = self._num_missing(request_id, num_tokens, hit)
        if missing > self._num_takeable(hit):
            return False
        if table is None:
            table = self._tables[request_id] = []
            self._chains[request_id] = list(hit.block_hashes)
            for block in hit.block_ids:
                if self._ref[block] == 0:
                    del self._evictable[block]
                self._ref[block] += 1
                table.append(block)
        for _ in range(missing):
            block = self._take_block()
            self._ref[block] = 1
            table.append(block)
        return True

    def fork(self, parent_id: str, child_id: str, num_blocks: int) -> None:
        """Give ``child_id`` a new table holding the parent's first ``num_blocks`` blocks (ref += 1 each):
        the full blocks of a prompt that several samples share. The caller shares only full blocks that
        no one writes again (the child computes the rest itself), so no block is ever copied."""
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already has blocks")
        table = self._tables[parent_id]
        if not 0 <= num_blocks <= len(table):
            raise ValueError(f"num_blocks: the parent holds {len(table)} blocks, asked for {num_blocks}")
        shared = table[:num_blocks]
        for block in shared:
            self._ref[block] += 1
        self._tables[child_id] = list(shared)
        self._chains[child_id] = self._chains[parent_id][:num_blocks]

    def free(self, request_id: str) -> None:
        """Release every block of the request (a no-op for an unknown id, so callers may free twice)."""
        table = self._tables.pop(request_id, None)
        self._chains.pop(request_id, None)
        if table is None:
            return
        # Tail blocks first, so they sit at the front of the LRU and are evicted before the
        # prefix blocks that more requests are likely to share.
        for block in reversed(table):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._hash[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None

    def _num_missing(self, request_id: str, num_tokens: int, hit: PrefixHit) -> int:
        have = len(self._tables[request_id]) if request_id in self._tables else hit.num_blocks
        return max(0, self.num_blocks_for(num_tokens) - have)

    def _num_takeable(self, hit: PrefixHit) -> int:
        # A hit on a CACHED block takes it out of the evictable pool.
        reused_cached = sum(1 for b in hit.block_ids if self._ref[b] == 0)
        return len(self._free) + len(self._evictable) - reused_cached

    def _take_block(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        removed = self._unhash(block)
        if self.record_events:
            self._events.append(BlockEvent("removed", (removed,)))
        return block

    def _unhash(self, block: int) -> int:
        h = self._hash[block]
        assert h is not None
        del self._hash_to_block[h]
        self._hash[block] = None
        return h

    # ---- invariants ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise BlockIntegrityError unless every invariant in the module docstring holds."""
        refs = [0] * self.num_blocks
        for rid, table in self._tables.items():
            if len(set(table)) != len(table):
                raise BlockIntegrityError(f"request {rid!r} holds a block twice: {table}")
            for b in table:
                refs[b] += 1
        if refs != self._ref:
            bad = [b for b in range(self.num_blocks) if refs[b] != self._ref[b]]
            raise BlockIntegrityError(f"ref counts disagree with block tables for blocks {bad[:10]}")
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockIntegrityError("a block is in the free deque twice")
        evictable = set(self._evictable)
        if free & evictable:
            raise BlockIntegrityError(f"blocks both free and cached: {sorted(free & evictable)[:10]}")
        for b in range(self.num_blocks):
            in_use = self._ref[b] > 0
            if in_use + (b in free) + (b in evictable) != 1:
                raise BlockIntegrityError(f"block {b} is in {in_use + (b in free) + (b in evictable)} states")
            if b in free and self._hash[b] is not None:
                raise BlockIntegrityError(f"free block {b} still has a hash")
            if b in evictable and self._hash[b] is None:
                raise BlockIntegrityError(f"cached block {b} has no hash")
            h = self._hash[b]
            if h is not None and self._hash_to_block.get(h) != b:
                raise BlockIntegrityError(f"block {b}'s hash does not map back to it")
        if len(self._hash_to_block) != sum(h is not None for h in self._hash):
            raise BlockIntegrityError("hash map has entries for no block")
        for rid, chain in self._chains.items():
            if len(chain) > len(self._tables[rid]):
                raise BlockIntegrityError(f"request {rid!r} has more hashed blocks than blocks")
