from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.engine.kv_cache.block_hash import ROOT_HASH, block_hashes, hash_block
from splitserve.engine.kv_cache.block_manager import BlockEvent, BlockIntegrityError, BlockManager


def make_manager(num_blocks: int = 8, block_size: int = 4, **kw) -> BlockManager:
    return BlockManager(num_blocks, block_size, **kw)


def assert_all_free(bm: BlockManager) -> None:
    bm.check_integrity()
    assert bm.num_used_blocks == 0
    assert bm.num_free_blocks == bm.num_blocks


# ---- hashing ----------------------------------------------------------------------------------


def test_hash_is_chained_and_stable_across_processes():
    tokens = list(range(10))
    hashes = block_hashes(tokens, 4)
    assert len(hashes) == 2  # the trailing partial block has no hash
    assert hashes[0] == hash_block(ROOT_HASH, [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    # The same block after a different prefix hashes differently.
    assert block_hashes([9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != hashes[1]
    code = "from splitserve.engine.kv_cache.block_hash import block_hashes; print(block_hashes(list(range(10)), 4))"
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    )
    assert other.stdout.strip() == str(hashes)


def test_hash_module_is_torch_free():
    code = (
        "import sys, splitserve.engine.kv_cache.block_hash, splitserve.engine.kv_cache.block_manager, "
        "splitserve.engine.sampling.params, splitserve.engine.sampling.rng, splitserve.engine.scheduler.scheduler, "
        "splitserve.engine.model.config; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hash_rejects_out_of_range_tokens():
    with pytest.raises(ValueError, match="token ids"):
        hash_block(ROOT_HASH, [-1])


# ---- allocation and freeing ---------------------------------------------------------------------


def test_allocate_grows_table_and_free_returns_everything():
    bm = make_manager()
    assert bm.allocate("a", 5)  # 2 blocks
    assert len(bm.block_table("a")) == 2
    assert bm.allocate("a", 8)  # still 2
    assert len(bm.block_table("a")) == 2
    assert bm.allocate("a", 9)
    assert len(bm.block_table("a")) == 3
    assert bm.num_used_blocks == 3
    bm.free("a")
    bm.free("a")  # freeing twice is harmless
    assert_all_free(bm)


def test_allocate_is_all_or_nothing():
    bm = make_manager(num_blocks=4)
    assert bm.allocate("a", 12)  # 3 blocks
    assert not bm.allocate("b", 8)
    assert not bm.has_request("b")
    assert bm.num_used_blocks == 3
    bm.check_integrity()
    bm.free("a")
    assert_all_free(bm)


def test_prefix_hit_shares_blocks_and_refcounts():
    bm = make_manager()
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert bm.lookup_prefix(prompt).num_blocks == 0
    assert bm.allocate("a", len(prompt))
    bm.cache_blocks("a", prompt, len(prompt))
    hit = bm.lookup_prefix(prompt + [99])
    assert hit.block_ids == tuple(bm.block_table("a")[:2])
    assert bm.allocate("b", 11, hit)
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.num_used_blocks == 4  # 2 shared + 1 private each
    bm.check_integrity()
    bm.free("a")
    bm.check_integrity()
    assert bm.num_used_blocks == 3  # b still holds the shared ones
    bm.free("b")
    assert bm.num_used_blocks == 0
    assert bm.num_cached_blocks == 2  # the two hashed full blocks stay cached
    assert_all_free(bm)


def test_hit_leaves_at_least_one_token_to_compute():
    bm = make_manager()
    prompt = list(range(8))  # exactly 2 full blocks
    bm.allocate("a", 8)
    bm.cache_blocks("a", prompt, 8)
    bm.free("a")
    # The whole prompt is cached, but the last token must still run to produce logits.
    assert bm.lookup_prefix(prompt).num_blocks == 1
    assert bm.lookup_prefix(prompt + [1]).num_blocks == 2


def test_cached_blocks_are_evicted_lru_only_when_free_runs_out():
    bm = make_manager(num_blocks=4, record_events=True)
    p1, p2 = [1] * 8, [2] * 8
    for rid, p in (("a", p1), ("b", p2)):
        bm.allocate(rid, 8)
        bm.cache_blocks(rid, p, 8)
    bm.free("a")
    bm.free("b")
    assert bm.num_cached_blocks == 4
    stored = [e for e in bm.take_events() if e.kind == "stored"]
    assert sum(len(e.block_hashes) for e in stored) == 4
    # A new 1-block request must evict exactly one cached block: a's tail block (freed first).
    a_hashes = block_hashes(p1, 4)
    assert bm.allocate("c", 3)
    events = bm.take_events()
    assert events == [BlockEvent("removed", (a_hashes[1],))]
    assert bm.lookup_prefix(p1 + [0]).num_blocks == 1  # a's first block survives
    assert bm.lookup_prefix(p2 + [0]).num_blocks == 2
    bm.free("c")
    assert_all_free(bm)


def test_hit_on_cached_block_counts_against_capacity():
    bm = make_manager(num_blocks=3)
    prompt = [7] * 8
    bm.allocate("a", 8)
    bm.cache_blocks("a", prompt, 8)
    bm.free("a")
    hit = bm.lookup_prefix(prompt + [1, 2, 3, 4, 5])  # 2 cached blocks hit
    assert hit.num_blocks == 2
    # 13 tokens need 4 blocks: 2 from the hit + 2 new, but only 1 block is left besides the hit.
    assert not bm.allocate("b", 13, hit)
    assert bm.allocate("b", 12, hit)
    bm.check_integrity()
    bm.free("b")
    assert_all_free(bm)


def test_duplicate_prefix_keeps_first_entry():
    bm = make_manager()
    prompt = [3] * 5
    bm.allocate("a", 5)
    bm.allocate("b", 5)  # computed concurrently, no hit
    bm.cache_blocks("a", prompt, 5)
    bm.cache_blocks("b", prompt, 5)
    assert bm.lookup_prefix(prompt).block_ids == (bm.block_table("a")[0],)
    bm.free("a")
    bm.free("b")
    assert bm.num_cached_blocks == 1  # b's duplicate went back to the free pool
    assert_all_free(bm)


def test_prefix_caching_disabled_never_hits():
    bm = make_manager(enable_prefix_caching=False)
    bm.allocate("a", 8)
    bm.cache_blocks("a", [1] * 8, 8)
    bm.free("a")
    assert bm.num_cached_blocks == 0
    assert bm.lookup_prefix([1] * 9).num_blocks == 0


def test_check_integrity_catches_corruption():
    bm = make_manager()
    bm.allocate("a", 4)
    bm._ref[bm.block_table("a")[0]] += 1  # a leaked reference
    with pytest.raises(BlockIntegrityError, match="ref counts"):
        bm.check_integrity()


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    bm = make_manager()
    bm.allocate("a", 4)
    hit = bm.lookup_prefix([1] * 9)
    bm.cache_blocks("a", [1] * 4, 4)
    hit = bm.lookup_prefix([1] * 9)
    with pytest.raises(ValueError, match="already has blocks"):
        bm.allocate("a", 9, hit)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcde"), st.integers(0, 3), st.integers(1, 20)), max_size=60))
def test_random_operations_keep_invariants(ops):
    """Random allocate/cache/free sequences never break an invariant, and freeing all empties the pool."""
    bm = make_manager(num_blocks=10, block_size=4, record_events=True)
    prompts = {rid: [ord(rid) % 3] * 40 for rid in "abcde"}
    lengths: dict[str, int] = {}
    for rid, op, n in ops:
        if op == 0 and not bm.has_request(rid):
            hit = bm.lookup_prefix(prompts[rid][:n])
            if bm.allocate(rid, n, hit):
                lengths[rid] = n
        elif op == 1 and bm.has_request(rid):
            if bm.allocate(rid, lengths[rid] + n):
                lengths[rid] += n
        elif op == 2 and bm.has_request(rid):
            bm.cache_blocks(rid, prompts[rid], lengths[rid])
        elif op == 3:
            bm.free(rid)
            lengths.pop(rid, None)
        bm.check_integrity()
    for rid in "abcde":
        bm.free(rid)
    assert_all_free(bm)
