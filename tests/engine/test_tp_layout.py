"""Head ranges per tensor-parallel rank, and the pairs of a KV transfer between workers of any sizes."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.engine.tp.layout import (
    HeadRange,
    check_tp_size,
    kv_head_range,
    query_head_range,
    transfer_pairs,
)

SIZES = (1, 2, 4, 8)


def test_heads_split_evenly_and_kv_heads_follow_their_queries():
    # 14 query heads, 2 KV heads (qwen2.5-0.5b's shape) at TP 2: one KV head per rank, 7 queries each.
    assert [query_head_range(14, 2, r) for r in range(2)] == [HeadRange(0, 7), HeadRange(7, 14)]
    assert [kv_head_range(2, 2, r) for r in range(2)] == [HeadRange(0, 1), HeadRange(1, 2)]


def test_fewer_kv_heads_than_ranks_replicates_each_head_on_consecutive_ranks():
    assert [kv_head_range(2, 4, r) for r in range(4)] == [HeadRange(0, 1)] * 2 + [HeadRange(1, 2)] * 2
    assert [kv_head_range(1, 8, r) for r in range(8)] == [HeadRange(0, 1)] * 8


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "message"),
    [
        (14, 2, 4, "14 attention heads"),
        (16, 6, 4, "6 KV heads"),
        (24, 3, 4, "multiple of the model's 3 KV heads"),
        (8, 8, 0, "must be >= 1"),
    ],
)
def test_sizes_that_split_a_head_are_refused_by_name(heads, kv_heads, tp, message):
    with pytest.raises(ValueError, match=f"tensor_parallel_size: .*{message}"):
        check_tp_size(heads, kv_heads, tp)


@given(st.sampled_from((1, 2, 4, 8)), st.sampled_from(SIZES), st.sampled_from(SIZES))
def test_every_receiver_rank_gets_each_of_its_heads_exactly_once_from_a_holder(kv_heads, p, d):
    pairs = transfer_pairs(kv_heads, p, d)
    for receiver in range(d):
        got = sorted(
            h for pair in pairs if pair.receiver_rank == receiver for h in range(pair.heads.start, pair.heads.stop)
        )
        wanted = kv_head_range(kv_heads, d, receiver)
        assert got == list(range(wanted.start, wanted.stop))
    for pair in pairs:
        held = kv_head_range(kv_heads, p, pair.sender_rank)
        assert pair.heads.overlap(held) == pair.heads  # a sender only sends heads it holds


def test_symmetric_sizes_pair_each_rank_with_itself_only():
    assert [(x.sender_rank, x.receiver_rank) for x in transfer_pairs(4, 4, 4)] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert [(x.sender_rank, x.receiver_rank, x.heads.count) for x in transfer_pairs(2, 2, 1)] == [(0, 0, 1), (1, 0, 1)]
