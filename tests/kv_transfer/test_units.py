"""kv_transfer in one process: descriptor strictness (fuzzed in tests/security), message planning, the pair logic over a
fake NCCL-like group, and a real gloo pair on the test device (the GPU check runs this file with
``--device cuda``, covering CUDA payloads staged through pinned host memory)."""

from __future__ import annotations

import random
import time

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.common.arith import ceil_div
from splitserve.engine.kv_cache.cache import KVCache, KVCacheSpec
from splitserve.kv_transfer.comm import choose_backend
from splitserve.kv_transfer.config import FaultPoint, TransferConfig
from splitserve.kv_transfer.descriptor import (
    Commit,
    DescriptorError,
    LayoutFingerprint,
    PayloadDescriptor,
    decode_descriptor,
    encode_descriptor,
)
from splitserve.kv_transfer.handles import TransferState
from splitserve.kv_transfer.local import LocalConnection
from splitserve.kv_transfer.receiver import KVReceiver
from splitserve.kv_transfer.sender import KVSender, PeerAddress
from tests.kv_transfer.fakes import FakeFabric

LAYERS, HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4
FP = LayoutFingerprint("m", "float32", BLOCK, LAYERS, HEADS, HEAD_DIM, "w1")


def make_descriptor(**kw) -> PayloadDescriptor:
    base = dict(
        seq=0,
        transfer_id="r1",
        layer_start=0,
        layer_end=2,
        block_start=0,
        block_end=3,
        num_blocks=3,
        num_tokens=10,
        dtype="float32",
        shape=(2, 3, 2, HEADS, BLOCK, HEAD_DIM),
        nbytes=2 * 3 * 512,
        last=True,
        commit=Commit(first_token=5),
    )
    return PayloadDescriptor(**{**base, **kw})


# ---- descriptors ---------------------------------------------------------------------------------


def test_descriptor_round_trip():
    d = make_descriptor()
    assert decode_descriptor(encode_descriptor(d)) == d


def _wire(**changes) -> bytes:
    raw = msgpack.unpackb(encode_descriptor(make_descriptor()))
    raw.update(changes)
    for key in [k for k, v in changes.items() if v is _DROP]:
        del raw[key]
    return msgpack.packb(raw)


_DROP = object()


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (_wire(v=2), "v"),
        (_wire(seq=-1), "seq"),
        (_wire(seq=True), "seq"),
        (_wire(layers=[2, 1]), "layers"),
        (_wire(layers=[0]), "layers"),
        (_wire(blocks=[0, 9]), "blocks"),
        (_wire(id=""), "id"),
        (_wire(id="x" * 300), "id"),
        (_wire(id=5), "id"),
        (_wire(dtype="int8"), "dtype"),
        (_wire(shape=[2, -3]), "shape"),
        (_wire(shape="big"), "shape"),
        (_wire(nbytes=0), "nbytes"),
        (_wire(last="yes"), "last"),
        (_wire(commit=[1, 2]), "commit"),
        (_wire(extra=1), "unknown keys"),
        (_wire(nbytes=_DROP), "missing keys"),
        (msgpack.packb([1, 2, 3]), "must be a map"),
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb({"v": msgpack.ExtType(1, b"x")}), "ext"),
        (b"\x00" * 70000, "exceeds the limit"),
    ],
)
def test_descriptor_decoding_is_strict(data, field):
    with pytest.raises(DescriptorError, match=field):
        decode_descriptor(data)


def test_commit_round_trip_and_wire_form():
    for commit in (None, Commit(first_token=0), Commit(first_token=2**31 - 1)):
        assert decode_descriptor(encode_descriptor(make_descriptor(commit=commit))).commit == commit
    raw = msgpack.unpackb(encode_descriptor(make_descriptor(commit=Commit(first_token=7))))
    assert raw["commit"] == {"version": 1, "first_token": 7}


@pytest.mark.parametrize(
    ("commit", "field"),
    [
        ({"version": 2, "first_token": 5}, r"commit\.version: 2 is not 1"),
        ({"version": 0, "first_token": 5}, r"commit\.version"),
        ({"version": "1", "first_token": 5}, r"commit\.version: must be an integer"),
        ({"version": True, "first_token": 5}, r"commit\.version: must be an integer"),
        ({"version": 1, "first_token": "5"}, r"commit\.first_token"),
        ({"version": 1, "first_token": 5.0}, r"commit\.first_token"),
        ({"version": 1, "first_token": True}, r"commit\.first_token"),
        ({"version": 1, "first_token": -1}, r"commit\.first_token"),
        ({"version": 1, "first_token": 2**31}, r"commit\.first_token"),
        ({"version": 1, "first_token": [5]}, r"commit\.first_token"),
        ({"version": 1, "first_token": 5, "id": "r1"}, r"commit: missing keys \[\], unknown keys \['id'\]"),
        ({"first_token": 5}, r"commit: missing keys \['version'\]"),
        ({"version": 1}, r"commit: missing keys \['first_token'\]"),
        ({}, "commit: missing keys"),
        ("first_token", "commit: must be a map"),
    ],
)
def test_commit_decoding_is_strict(commit, field):
    with pytest.raises(DescriptorError, match=field):
        decode_descriptor(_wire(commit=commit))


def test_commit_with_a_bytes_key_is_refused():
    raw = msgpack.unpackb(encode_descriptor(make_descriptor()))
    raw["commit"] = {"version": 1, b"first_token": 5}
    with pytest.raises(DescriptorError, match="commit: missing keys"):
        decode_descriptor(msgpack.packb(raw, use_bin_type=True))


def test_fingerprint_mismatch_names_fields():
    other = LayoutFingerprint("m", "bfloat16", BLOCK, LAYERS, HEADS, HEAD_DIM, "w2")
    diff = FP.mismatches(other)
    assert len(diff) == 2 and diff[0].startswith("dtype") and diff[1].startswith("weights_checksum")
    assert FP.mismatches(FP) == []


def test_config_and_backend_choice():
    assert choose_backend(torch.device("cpu")) == "gloo"
    with pytest.raises(ValueError, match="backend"):
        choose_backend(torch.device("cpu"), "nccl")
    with pytest.raises(ValueError, match="op_timeout_s"):
        TransferConfig(op_timeout_s=0)
    with pytest.raises(ValueError, match="fault.action"):
        FaultPoint("sender", "explode", 1)


# ---- in-process pairs -----------------------------------------------------------------------------


def make_endpoints(device, config: TransferConfig, factory=None, num_blocks: int = 256, faults=None):
    spec = KVCacheSpec(LAYERS, HEADS, HEAD_DIM, num_blocks, BLOCK, torch.float32)
    src, dst = KVCache(spec, device), KVCache(spec, device)
    src.tensor.copy_(torch.randn(src.tensor.shape))
    kw = {"faults": faults} if factory is None else {"communicator_factory": factory, "faults": faults}
    receiver = KVReceiver(dst, FP, "d", config=config, **kw)
    sender = KVSender(src, FP, "p", connect=lambda peer: LocalConnection(receiver.serve_pair), config=config, **kw)
    return sender, receiver, PeerAddress("d", receiver.incarnation, "local")


def run_transfers(sender, receiver, peer, sizes, stream=True, seed=0):
    rng = random.Random(seed)
    num_blocks = sender.cache.spec.num_blocks
    src_pool, dst_pool = rng.sample(range(num_blocks), num_blocks), rng.sample(range(num_blocks), num_blocks)
    jobs = []
    for i, tokens in enumerate(sizes):
        n = ceil_div(tokens, BLOCK)
        src, dst = [src_pool.pop() for _ in range(n)], [dst_pool.pop() for _ in range(n + 1)]
        rh = receiver.expect(f"s{seed}-t{i}", dst)
        sh = sender.start(f"s{seed}-t{i}", peer, src, tokens)
        jobs.append((sh, rh, src, dst))
    for sh, _, _, _ in jobs:  # interleave: every transfer's groups are in the FIFO before any finishes
        if stream:
            sender.layers_ready(sh, LAYERS // 2)
    for sh, _, _, _ in jobs:
        sender.finish(sh, Commit(first_token=sh.num_tokens))
    for sh, rh, src, dst in jobs:
        assert rh.wait(10) is TransferState.DONE, rh
        assert sh.wait(10) is TransferState.DONE, sh
        assert rh.commit == Commit(first_token=sh.num_tokens)
        assert torch.equal(sender.cache.tensor[:, src].cpu(), receiver.cache.tensor[:, dst[: len(src)]].cpu())
    return jobs


SMALL = TransferConfig(max_message_bytes=2048, whole_request_bytes=0, layer_group_size=2, op_timeout_s=2.0)


def test_fifo_pair_logic_over_a_fake_nccl_group():
    """Tags ignored, completion polled: many interleaved transfers still land byte-exact."""
    sender, receiver, peer = make_endpoints("cpu", SMALL, FakeFabric().factory)
    run_transfers(sender, receiver, peer, [1, 5, 17, 33, 8, 64, 3])
    assert sender.num_pairs() == 1
    sender.close()
    receiver.close()


def test_silent_nccl_peer_fails_within_the_deadline():
    sender, receiver, peer = make_endpoints("cpu", SMALL, FakeFabric(frozen=True).factory)
    rh = receiver.expect("t", [1, 2, 3])
    sh = sender.start("t", peer, [4, 5, 6], 12)
    sender.finish(sh)
    assert sh.wait(3 * SMALL.op_timeout_s) is TransferState.FAILED
    assert "did not complete" in sh.error
    assert rh.wait(3 * SMALL.op_timeout_s) is TransferState.FAILED
    sender.close()
    receiver.close()


def test_transfer_deadline_and_unknown_transfer_are_reported():
    sender, receiver, peer = make_endpoints("cpu", SMALL)
    late = receiver.expect("late", [1, 2], timeout_s=0.2)
    assert late.wait(2) is TransferState.FAILED and "deadline" in late.error
    sh = sender.start("nobody-expects-me", peer, [7], 3)
    sender.finish(sh)
    assert sh.wait(5) is TransferState.FAILED and "no lease" in sh.error
    run_transfers(sender, receiver, peer, [9])  # the pair is still fine
    sender.close()
    receiver.close()


def test_a_receivers_whole_deadline_runs_from_the_senders_first_message():
    """An expect given no timeout (a decode worker's lease) waits up to transfer_start_timeout_s for the sender to
    begin, and the whole transfer's deadline then runs from the first message: a prompt that queued on its prefill
    worker for longer than a whole transfer may take still lands; a sender that never begins fails at the start
    deadline, saying so."""
    config = TransferConfig(
        max_message_bytes=2048,
        whole_request_bytes=0,
        layer_group_size=2,
        op_timeout_s=2.0,
        transfer_timeout_s=0.5,
        transfer_start_timeout_s=3.0,
    )
    sender, receiver, peer = make_endpoints("cpu", config)
    queued = receiver.expect("queued", [1, 2, 3])
    never = receiver.expect("never", [4, 5])
    time.sleep(1.0)  # twice the whole deadline, before the sender begins
    assert queued.state is TransferState.WAITING and never.state is TransferState.WAITING
    sh = sender.start("queued", peer, [7, 8, 9], 12)
    sender.finish(sh)
    assert sh.wait(5) is TransferState.DONE and queued.wait(5) is TransferState.DONE, (sh.error, queued.error)
    assert never.wait(4) is TransferState.FAILED
    assert "no KV came within the transfer start deadline of 3.0s" in never.error
    sender.close()
    receiver.close()


def test_real_gloo_pair_on_the_test_device(device):
    """Real gloo groups between two endpoints in this process; on CUDA the payload is staged through
    pinned host memory. (gloo is named: NCCL refuses two ranks on one GPU, so a real NCCL pair needs two.)"""
    config = TransferConfig(
        max_message_bytes=4096, whole_request_bytes=1024, layer_group_size=2, op_timeout_s=5.0, backend="gloo"
    )
    sender, receiver, peer = make_endpoints(device, config)
    run_transfers(sender, receiver, peer, [2, 16, 45, 100], stream=True, seed=1)
    run_transfers(sender, receiver, peer, [7], stream=False, seed=2)
    sender.close()
    receiver.close()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.integers(1, 6), st.integers(512, 20000), st.integers(0, 3))
def test_plan_partitions_layers_times_blocks(num_blocks, num_layers, group, limit, start):
    fp = LayoutFingerprint("m", "float32", BLOCK, num_layers, HEADS, HEAD_DIM, "w")
    config = TransferConfig(max_message_bytes=limit, layer_group_size=group)
    sender = KVSender.__new__(KVSender)  # planning needs only the fingerprint and config
    sender.fingerprint, sender.config = fp, config

    class H:
        block_ids = tuple(range(num_blocks))

    l0 = min(start, num_layers - 1)
    messages = sender._plan(H, l0, num_layers, True, Commit(first_token=1))
    covered = [
        (layer, b)
        for m in messages
        for layer in range(m.layer_start, m.layer_end)
        for b in range(m.block_start, m.block_end)
    ]
    assert sorted(covered) == [(layer, b) for layer in range(l0, num_layers) for b in range(num_blocks)]
    per = fp.bytes_per_block_layer
    assert all((m.layer_end - m.layer_start) * (m.block_end - m.block_start) * per <= max(limit, per) for m in messages)
    assert [m.last for m in messages] == [False] * (len(messages) - 1) + [True]
    assert messages[-1].commit == Commit(first_token=1)


def test_pair_setup_has_a_deadline():
    """A receiver that never answers the hello fails the transfer within pair_setup_timeout_s."""
    import time

    config = TransferConfig(pair_setup_timeout_s=0.5, op_timeout_s=1.0)
    spec = KVCacheSpec(LAYERS, HEADS, HEAD_DIM, 16, BLOCK, torch.float32)
    silent = lambda inbound, send: [None for _ in inbound]  # noqa: E731  (reads forever, answers nothing)
    sender = KVSender(KVCache(spec, "cpu"), FP, "p", connect=lambda peer: LocalConnection(silent), config=config)
    start = time.monotonic()
    sh = sender.start("t", PeerAddress("ghost", "", "local"), [1], 3)
    sender.finish(sh)
    assert sh.wait(5) is TransferState.FAILED
    assert "no welcome" in sh.error and time.monotonic() - start < 2.0
    assert sender.num_pairs() == 0
    sender.close()


def test_pairs_beyond_the_cap_are_closed_least_recently_used_first():
    config = TransferConfig(max_pairs=1, op_timeout_s=2.0)
    spec = KVCacheSpec(LAYERS, HEADS, HEAD_DIM, 64, BLOCK, torch.float32)
    src = KVCache(spec, "cpu")
    src.tensor.copy_(torch.randn(src.tensor.shape))
    receivers = {name: KVReceiver(KVCache(spec, "cpu"), FP, name, config=config) for name in ("a", "b")}
    sender = KVSender(
        src, FP, "p", config=config, connect=lambda peer: LocalConnection(receivers[peer.receiver_id].serve_pair)
    )

    def move(name: str, tid: str) -> None:
        receiver = receivers[name]
        rh = receiver.expect(tid, [5, 6])
        sh = sender.start(tid, PeerAddress(name, receiver.incarnation, "local"), [1, 2], 8)
        sender.finish(sh)
        assert sh.wait(10) is TransferState.DONE and rh.wait(10) is TransferState.DONE
        assert torch.equal(receiver.cache.tensor[:, [5, 6]], src.tensor[:, [1, 2]])

    move("a", "t1")
    move("b", "t2")  # opening b closes the idle pair with a
    assert sender.num_pairs() == 1
    move("a", "t3")  # a's pair is rebuilt under a new generation
    assert sender.num_pairs() == 1
    sender.close()
    for r in receivers.values():
        r.close()


# ---- tensor parallelism: fingerprints, descriptor heads, packing part of the heads -------------------


def test_fingerprints_of_any_tp_sizes_pair_when_the_layout_agrees():
    rank1_of_2 = LayoutFingerprint("m", "float32", BLOCK, LAYERS, HEADS, HEAD_DIM, "w1", 2, 1, 1, 2)
    assert rank1_of_2.heads.count == 1 and FP.heads.count == HEADS  # TP 1 holds every head by default
    assert rank1_of_2.mismatches(FP) == [] and FP.mismatches(rank1_of_2) == []
    other = LayoutFingerprint("m", "float32", BLOCK, LAYERS, HEADS, HEAD_DIM, "w2", 2, 1, 1, 2)
    assert [m.split()[0] for m in other.mismatches(FP)] == ["weights_checksum"]


@pytest.mark.parametrize(
    ("tp", "field"),
    [
        ((2, 2, 0, 0), "tp_rank"),
        ((2, 0, 1, 2), "heads: \\[1, 2\\) are not the KV heads of rank 0 of 2"),
        ((1, 0, 0, 3), "heads: \\[0, 3\\) is not a range"),
        ((3, 0, 0, 1), "tp_size"),
        ((0, 0, 0, 0), "tp_rank"),
    ],
)
def test_inconsistent_tp_fingerprints_are_refused_by_name(tp, field):
    with pytest.raises(DescriptorError, match=field):
        LayoutFingerprint("m", "float32", BLOCK, LAYERS, HEADS, HEAD_DIM, "w1", *tp)


def test_tp_fingerprint_travels_in_the_hello():
    from splitserve.common.errors import ServingError
    from splitserve.kv_transfer.control import Hello
    from splitserve.kv_transfer.service import sender_from_pb, sender_to_pb

    fp = LayoutFingerprint("m", "float32", BLOCK, LAYERS, HEADS, HEAD_DIM, "w1", 2, 1, 1, 2)
    hello = Hello(1, "p", "i", "", fp, "127.0.0.1")
    assert sender_from_pb(sender_to_pb(hello)) == hello
    assert sender_from_pb(sender_to_pb(Hello(1, "p", "i", "", FP, "h"))).fingerprint == FP
    bad = sender_to_pb(hello)
    bad.hello.fingerprint.heads_start = 0  # rank 1 of 2 claiming head 0 too
    with pytest.raises(ServingError, match="fingerprint: heads"):
        sender_from_pb(bad)


def test_descriptor_heads_round_trip_and_are_decoded_strictly():
    d = make_descriptor(heads=(1, 2), shape=(2, 3, 2, 1, BLOCK, HEAD_DIM))
    assert decode_descriptor(encode_descriptor(d)) == d
    for bad in ([1, 1], [2, 1], [-1, 1], [0], "all", [0, True]):
        with pytest.raises(DescriptorError, match="heads"):
            decode_descriptor(_wire(heads=bad))
    with pytest.raises(DescriptorError, match="missing keys \\['heads'\\]"):
        decode_descriptor(_wire(heads=_DROP))


def test_sends_and_part_ids_follow_transfer_pairs():
    from splitserve.kv_transfer.tp.parts import rank_transfer_id, sends_for

    assert rank_transfer_id("r", 0, 1) == "r"  # TP 1: the request's own id, as before
    assert [rank_transfer_id("r", i, 2) for i in range(2)] == ["r@kv0", "r@kv1"]
    with pytest.raises(ValueError, match="receiver_rank"):
        rank_transfer_id("r", 2, 2)
    # 2 KV heads from TP 4 (each head on two ranks) to TP 1: ranks 0 and 2 send, 1 and 3 stay silent.
    assert [[(p.receiver_rank, p.heads.start, p.heads.stop) for p in sends_for(2, 4, s, 1)] for s in range(4)] == [
        [(0, 0, 1)],
        [],
        [(0, 1, 2)],
        [],
    ]
    assert [(p.receiver_rank, p.heads.start) for p in sends_for(2, 1, 0, 4)] == [(0, 0), (1, 0), (2, 1), (3, 1)]


def test_cache_rows_are_the_layer_block_pairs_gather_blocks_packs():
    """What packing part of the heads reads of the cache: ``row_index`` in ``rows()``, a view of the cache."""
    cache = KVCache(KVCacheSpec(LAYERS, 2, HEAD_DIM, 8, BLOCK, torch.float32), "cpu")
    cache.tensor.copy_(torch.randn(cache.tensor.shape))
    ids, layers = torch.tensor([6, 1, 4]), range(1, 3)
    index = cache.row_index(ids, layers)
    assert index.tolist() == [layer * 8 + block for layer in layers for block in ids.tolist()]
    picked = cache.rows().index_select(0, index)
    assert torch.equal(picked.view(len(layers), len(ids), *picked.shape[1:]), cache.gather_blocks(ids, layers))
    cache.rows()[index[0], 1, 0] = 7.0  # layer 1, block 6, V, head 0
    assert bool((cache.tensor[1, 6, 1, 0] == 7.0).all()), "rows() is a view: a write lands in the cache"


def test_gather_and_scatter_of_part_of_the_heads():
    from splitserve.kv_transfer.tp.heads import gather_heads, scatter_heads

    full = KVCache(KVCacheSpec(LAYERS, 2, HEAD_DIM, 8, BLOCK, torch.float32), "cpu")
    full.tensor.copy_(torch.randn(full.tensor.shape))
    one = KVCache(KVCacheSpec(LAYERS, 1, HEAD_DIM, 8, BLOCK, torch.float32), "cpu")
    src, dst, layers = torch.tensor([5, 2, 7]), torch.tensor([0, 3, 1]), range(1, 3)
    part = gather_heads(full, src, layers, 1, 2, out=torch.empty(10_000))
    assert part.shape == (2, 3, 2, 1, BLOCK, HEAD_DIM)
    scatter_heads(one, dst, part, layers, 0, 1)
    assert torch.equal(one.tensor[1:3][:, dst], full.tensor[1:3][:, src][:, :, :, 1:2])
    assert not one.tensor[0].any() and not one.tensor[3].any()  # other layers untouched
    back = KVCache(KVCacheSpec(LAYERS, 2, HEAD_DIM, 8, BLOCK, torch.float32), "cpu")
    scatter_heads(back, src, gather_heads(one, dst, layers, 0, 1, out=torch.empty(10_000)), layers, 1, 2)
    assert torch.equal(back.tensor[1:3][:, src][:, :, :, 1], full.tensor[1:3][:, src][:, :, :, 1])
    assert not back.tensor[:, :, :, 0].any()  # head 0 never written


def test_part_of_the_heads_of_a_heads_outer_cache():
    """vLLM's CPU cache keeps a block heads first ([kv_heads, block_size, 2 * head_dim]): a head's K and V are
    one run, so part of the heads moves as those runs, not as this package's [2, heads, ...] slices."""
    from splitserve.kv_transfer.tp.heads import gather_heads, scatter_heads

    def vllm_like(heads: int) -> tuple[KVCache, torch.Tensor]:
        spec = KVCacheSpec(LAYERS, heads, HEAD_DIM, 8, BLOCK, torch.float32, heads_outer=True)
        cache = KVCache(spec, "cpu")
        return cache, cache.tensor.view(LAYERS, 8, heads, BLOCK, 2 * HEAD_DIM)  # vLLM's view of it

    full, full_view = vllm_like(2)
    full_view.copy_(torch.randn(full_view.shape))
    one, one_view = vllm_like(1)
    src, dst, layers = torch.tensor([5, 2, 7]), torch.tensor([0, 3, 1]), range(1, 3)
    part = gather_heads(full, src, layers, 1, 2, out=torch.empty(10_000))
    assert part.numel() == 2 * 3 * 2 * BLOCK * HEAD_DIM
    scatter_heads(one, dst, part, layers, 0, 1)
    assert torch.equal(one_view[1:3][:, dst], full_view[1:3][:, src][:, :, 1:2])  # head 1's K and V, whole
    assert not one_view[0].any() and not one_view[3].any()
    with pytest.raises(ValueError, match="head_rows"):
        KVCache(KVCacheSpec(LAYERS, 2, HEAD_DIM, 8, BLOCK, torch.float32), "cpu").head_rows()
