"""``VllmPrefixEvents``: vLLM's own KV-cache events (its event classes, as its block pool emits them) become the
router's block hashes at the router's block size, chained from the prompt's first token."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from splitserve.engine.kv_cache.block_hash import block_hashes
from splitserve.worker_common.vllm_prefix_events import VllmPrefixEvents

VLLM_BLOCK = 8
ROUTER_BLOCK = 4
PROMPT = list(range(100, 124))  # three vLLM blocks, six router blocks


def stored(hashes, parent, tokens, size=VLLM_BLOCK, group_idx=None):
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=group_idx,
    )


def removed(hashes):
    return BlockRemoved(block_hashes=hashes, medium="GPU")


def feed(events: VllmPrefixEvents, *items) -> None:
    events.publish(KVEventBatch(ts=0.0, events=list(items)))


class Recorder:
    def __init__(self) -> None:
        self.batches, self.closed = [], False

    def publish(self, batch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        self.closed = True


def test_stored_blocks_give_the_router_hashes_of_their_tokens():
    inner = Recorder()
    events = VllmPrefixEvents(ROUTER_BLOCK, inner=inner)
    router = block_hashes(PROMPT, ROUTER_BLOCK)
    feed(events, stored([b"a", b"b"], None, PROMPT[:16]))  # one event, two blocks
    feed(events, stored([b"c"], b"b", PROMPT[16:24]))  # a later step's block, chained on its parent
    assert [e.kind for e in events.take_events()] == ["stored", "stored"]
    assert sorted(events.cached_hashes()) == sorted(router)
    assert len(inner.batches) == 2  # vLLM's own publisher still gets every batch
    events.shutdown()
    assert inner.closed


def test_one_event_lists_the_hashes_in_prompt_order():
    events = VllmPrefixEvents(ROUTER_BLOCK)
    feed(events, stored([b"a", b"b", b"c"], None, PROMPT))
    (event,) = events.take_events()
    assert list(event.block_hashes) == block_hashes(PROMPT, ROUTER_BLOCK)
    assert events.take_events() == []


def test_removal_waits_for_the_last_copy_and_takes_only_that_blocks_hashes():
    events = VllmPrefixEvents(ROUTER_BLOCK)
    router = block_hashes(PROMPT, ROUTER_BLOCK)
    feed(events, stored([b"a", b"b"], None, PROMPT[:16]), stored([b"b"], b"a", PROMPT[8:16]))  # b cached twice
    events.take_events()
    feed(events, removed([b"b"]))
    assert events.take_events() == [] and len(events.cached_hashes()) == 4
    feed(events, removed([b"b"]))
    (event,) = events.take_events()
    assert event.kind == "removed" and list(event.block_hashes) == router[2:4]
    assert sorted(events.cached_hashes()) == sorted(router[:2])


def test_a_block_whose_parent_is_unknown_is_not_mapped():
    events = VllmPrefixEvents(ROUTER_BLOCK)
    feed(events, stored([b"c"], b"never-seen", PROMPT[16:24]))
    assert events.take_events() == [] and events.cached_hashes() == []
    feed(events, stored([b"a"], None, PROMPT[:8]), removed([b"a"]), stored([b"b"], b"a", PROMPT[8:16]))
    assert events.cached_hashes() == []  # its parent was evicted before it was stored
    feed(events, removed([b"c"]), removed([b"b"]))  # removing unmapped blocks publishes nothing
    assert [e.kind for e in events.take_events()] == ["stored", "removed"]


def test_router_blocks_that_straddle_vllm_blocks():
    events = VllmPrefixEvents(5)  # 8-token vLLM blocks, 5-token router blocks: 24 tokens hold 4 of them
    feed(
        events, stored([b"a"], None, PROMPT[:8]), stored([b"b"], b"a", PROMPT[8:16]), stored([b"c"], b"b", PROMPT[16:])
    )
    router = block_hashes(PROMPT, 5)
    assert sorted(events.cached_hashes()) == sorted(router)
    feed(events, removed([b"b"]))  # b completed router blocks 1 (tokens 5-9) and 2 (10-14)
    assert sorted(events.cached_hashes()) == sorted([router[0], router[3]])


def test_a_partial_block_promoted_to_full():
    events = VllmPrefixEvents(ROUTER_BLOCK)
    feed(events, stored([b"p"], None, PROMPT[:6], size=6))  # vLLM caches a partial block of 6 tokens
    assert events.cached_hashes() == [block_hashes(PROMPT, ROUTER_BLOCK)[0]]
    feed(events, removed([b"p"]), stored([b"a"], None, PROMPT[:8]))  # the same block, full
    assert sorted(events.cached_hashes()) == sorted(block_hashes(PROMPT[:8], ROUTER_BLOCK))


def test_all_blocks_cleared_and_other_groups():
    events = VllmPrefixEvents(ROUTER_BLOCK)
    feed(events, stored([b"a"], None, PROMPT[:8]), stored([b"z"], None, PROMPT[:8], group_idx=1))
    assert len(events.cached_hashes()) == 2  # group 1 (a hybrid model's other group) is not the router's
    feed(events, AllBlocksCleared())
    assert events.cached_hashes() == []
    assert [e.kind for e in events.take_events()] == ["stored", "removed"]


def test_a_bad_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        VllmPrefixEvents(0)
