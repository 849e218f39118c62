"""KV transfer between real processes over gloo, with the gRPC control path: exactness, concurrency,
every failure phase reached through the fault points, and no block left behind on any survivor."""

from __future__ import annotations

import time
import zlib

import grpc
import pytest

from splitserve.common.arith import ceil_div
from splitserve.common.faults import Faults
from splitserve.kv_transfer.config import FaultPoint, TransferConfig
from splitserve.kv_transfer.descriptor import Commit
from tests.kv_transfer.harness import SPEC, Worker, make_fingerprint

BLOCK = SPEC["block_size"]
FAST = {"op_timeout_s": 2.0, "pair_setup_timeout_s": 5.0, "transfer_timeout_s": 20.0}
# Small messages so that even small transfers take many messages (and layer groups stream).
SMALL = {"max_message_bytes": 8 << 10, "whole_request_bytes": 16 << 10, "layer_group_size": 2}


def make_config(**overrides) -> TransferConfig:
    return TransferConfig(**{**FAST, **SMALL, **overrides})


def commit_for(transfer_id: str) -> Commit:
    """A first token that differs between the transfers of a test, to show each commit lands with its own KV."""
    return Commit(first_token=zlib.crc32(transfer_id.encode()) % 2**31)


def start_transfer(p: Worker, d: Worker, tid: str, tokens: int, stream: bool = False) -> None:
    d.call("expect", tid, tokens)
    p.call("send", tid, d.peer, tokens, stream=stream, commit=commit_for(tid))


def finish_transfer(p: Worker, d: Worker, tid: str, tokens: int) -> None:
    received, sent = d.call("wait", tid), p.call("wait", tid)
    assert received["state"] == "done", received
    assert sent["state"] == "done", sent
    assert received["commit"] == commit_for(tid)  # this transfer's commit, not another's
    n = ceil_div(tokens, BLOCK)
    assert d.call("checksums", tid, n) == p.call("checksums", tid, n), f"{tid}: KV differs after transfer"
    d.call("release", tid)
    p.call("release", tid)


def assert_no_blocks_held(*workers: Worker) -> None:
    for w in workers:
        status = w.call("status")  # also runs the block manager's check_integrity
        assert status["used_blocks"] == 0 and status["live"] == [], f"{w.name}: {status}"


@pytest.fixture(scope="module")
def quad():
    """Two senders and two receivers shared by the tests that break nothing."""
    cfg = make_config()
    workers = [
        Worker.start(role, name, cfg)
        for role, name in [("sender", "p0"), ("sender", "p1"), ("receiver", "d0"), ("receiver", "d1")]
    ]
    yield workers
    for w in workers:
        w.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "layer-groups"])
def test_byte_exact_for_random_block_sets(quad, stream):
    p0, _, d0, _ = quad
    for i, tokens in enumerate([1, 3, 4, 17, 64, 201]):
        start_transfer(p0, d0, f"exact-{stream}-{i}", tokens, stream)
        finish_transfer(p0, d0, f"exact-{stream}-{i}", tokens)
    assert_no_blocks_held(p0, d0)


def test_bf16_and_another_layout():
    spec = {"num_layers": 3, "num_kv_heads": 1, "head_dim": 64, "num_blocks": 64, "block_size": 16}
    cfg = make_config()
    p = Worker.start("sender", "pb", cfg, dtype="bfloat16", spec=spec)
    d = Worker.start("receiver", "db", cfg, dtype="bfloat16", spec=spec)
    try:
        for i, tokens in enumerate([5, 16, 130]):
            d.call("expect", f"bf{i}", tokens)
            p.call("send", f"bf{i}", d.peer, tokens, stream=True, commit=None)
            assert d.call("wait", f"bf{i}")["state"] == "done"
            n = ceil_div(tokens, 16)
            assert d.call("checksums", f"bf{i}", n) == p.call("checksums", f"bf{i}", n)
            d.call("release", f"bf{i}")
            p.call("release", f"bf{i}")
        assert_no_blocks_held(p, d)
    finally:
        p.stop()
        d.stop()


def test_many_concurrent_transfers_on_one_pair(quad):
    p0, _, d0, _ = quad
    sizes = {f"many-{i}": 7 + 13 * i for i in range(12)}
    for tid, tokens in sizes.items():
        start_transfer(p0, d0, tid, tokens, stream=bool(len(tid) % 2))
    for tid, tokens in sizes.items():
        finish_transfer(p0, d0, tid, tokens)
    assert_no_blocks_held(p0, d0)


def test_one_sender_two_receivers_and_two_senders_one_receiver(quad):
    p0, p1, d0, d1 = quad
    plan = [(p0, d0, "fan-a"), (p0, d1, "fan-b"), (p1, d0, "fan-c"), (p1, d1, "fan-d"), (p0, d0, "fan-e")]
    for p, d, tid in plan:
        start_transfer(p, d, tid, 45, stream=True)
    for p, d, tid in plan:
        finish_transfer(p, d, tid, 45)
    assert_no_blocks_held(*quad)


def test_fingerprint_mismatch_is_refused(quad):
    _, _, d0, _ = quad
    other = Worker.start("sender", "px", make_config(), checksum="other-weights")
    try:
        d0.call("expect", "fp", 8)
        other.call("send", "fp", d0.peer, 8)
        sent = other.call("wait", "fp")
        assert sent["state"] == "failed"
        assert "fingerprint mismatch" in sent["error"] and "weights_checksum" in sent["error"]
        assert d0.call("state", "fp") == "waiting"  # nothing arrived
        d0.call("release", "fp")
        other.call("release", "fp")
        assert_no_blocks_held(other, d0)
    finally:
        other.stop()


def test_malformed_descriptors_are_refused_and_the_receiver_lives_on(quad):
    from splitserve.kv_transfer.control import Hello
    from splitserve.kv_transfer.descriptor import PROTOCOL_VERSION
    from splitserve.kv_transfer.service import sender_to_pb
    from splitserve.rpc import kv_transfer_pb2 as pb
    from splitserve.rpc import kv_transfer_pb2_grpc as pb_grpc

    p0, _, d0, _ = quad
    hello = Hello(PROTOCOL_VERSION, "fuzzer", "x", "", make_fingerprint("float32", SPEC), "127.0.0.1")
    cases = [b"\xc1not msgpack", b"\x93\x01\x02\x03", b"\x81\xa1v\x01", b"\xd4\x01\x00" * 3]
    with grpc.insecure_channel(d0.info["control"]) as channel:
        stub = pb_grpc.KVTransferStub(channel)
        for garbage in cases:
            messages = iter([sender_to_pb(hello), pb.SenderMessage(descriptor=garbage)])
            with pytest.raises(grpc.RpcError) as e:
                for _ in stub.Pair(messages, timeout=10):
                    pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed descriptor" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Pair(iter([pb.SenderMessage(descriptor=b"x")]), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    start_transfer(p0, d0, "after-fuzz", 30)
    finish_transfer(p0, d0, "after-fuzz", 30)
    assert_no_blocks_held(p0, d0)


def test_stores_and_services_listen_on_the_advertised_address_only(quad):
    _, _, d0, _ = quad
    listening = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":  # LISTEN
                    address, port = local.rsplit(":", 1)
                    listening.setdefault(int(port, 16), set()).add(address)
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, and as a v4-mapped IPv6 address
    for port in (d0.info["store_port"], int(d0.info["control"].rsplit(":", 1)[1])):
        assert listening.get(port) and listening[port] <= loopback, f"port {port} listens on {listening.get(port)}"


# ---- failures: each test gets its own processes, since they break on purpose ------------------------


def pair_of(sender_faults=(), receiver_faults=()):
    p = Worker.start("sender", "pf", make_config(), faults=Faults(transfer=tuple(sender_faults)))
    d = Worker.start("receiver", "df", make_config(), faults=Faults(transfer=tuple(receiver_faults)))
    return p, d


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_sender_killed_mid_transfer():
    p, d = pair_of(sender_faults=[FaultPoint("sender", "die", after_messages=3)])
    try:
        start_transfer(p, d, "doomed", 200)  # 200 tokens: 25 messages of 8 KiB
        start = time.monotonic()
        received = d.call("wait", "doomed")
        assert received["state"] == "failed", received
        assert time.monotonic() - start < 3 * FAST["op_timeout_s"]
        # On a loaded machine the receiver's deadline can fire just before the sender reaches its
        # fault point; it must still die there.
        wait_until(lambda: not p.alive(), 10)
        d.call("release", "doomed")
        assert_no_blocks_held(d)
    finally:
        p.stop()
        d.stop()


def test_receiver_killed_mid_transfer():
    p, d = pair_of(receiver_faults=[FaultPoint("receiver", "die", after_messages=3)])
    try:
        start_transfer(p, d, "doomed", 200)
        start = time.monotonic()
        sent = p.call("wait", "doomed")
        assert sent["state"] == "failed", sent
        assert time.monotonic() - start < 3 * FAST["op_timeout_s"]
        wait_until(lambda: not d.alive(), 10)  # as above, from the other side
        p.call("release", "doomed")
        assert_no_blocks_held(p)
    finally:
        p.stop()
        d.stop()


def test_silent_receiver_times_out_and_the_pair_is_rebuilt():
    p, d = pair_of(
        receiver_faults=[
            FaultPoint(
                "receiver", "pause", after_messages=2, seconds=3 * FAST["op_timeout_s"], request_id_prefix="stalled"
            )
        ]
    )
    try:
        start_transfer(p, d, "stalled", 200)
        sent = p.call("wait", "stalled")
        assert sent["state"] == "failed" and "send failed" in sent["error"], sent
        assert sent["waited"] < 3 * FAST["op_timeout_s"]
        assert d.call("wait", "stalled")["state"] == "failed"
        for w in (p, d):
            w.call("release", "stalled")
        # The broken group was discarded; the next transfer builds a new one and succeeds.
        start_transfer(p, d, "next", 40)
        finish_transfer(p, d, "next", 40)
        assert_no_blocks_held(p, d)
    finally:
        p.stop()
        d.stop()


def test_dropped_connection_fails_both_sides_then_recovers():
    p, d = pair_of(sender_faults=[FaultPoint("sender", "drop", after_messages=2, request_id_prefix="dropped")])
    try:
        start_transfer(p, d, "dropped", 200)
        assert p.call("wait", "dropped")["state"] == "failed"
        assert d.call("wait", "dropped")["state"] == "failed"
        for w in (p, d):
            w.call("release", "dropped")
        start_transfer(p, d, "again", 60)
        finish_transfer(p, d, "again", 60)
        assert_no_blocks_held(p, d)
    finally:
        p.stop()
        d.stop()


@pytest.mark.parametrize("side", ["receiver", "sender"])
def test_cancel_mid_transfer_frees_both_sides_and_keeps_the_pair(side):
    # The sender pauses after its third message, so the transfer is reliably mid-way when cancelled.
    p, d = pair_of(
        sender_faults=[FaultPoint("sender", "pause", after_messages=3, seconds=1.5, request_id_prefix="cancelled")]
    )
    try:
        start_transfer(p, d, "cancelled", 200)
        wait_until(lambda: d.call("state", "cancelled") == "transferring")
        (d if side == "receiver" else p).call("cancel", "cancelled")
        received, sent = d.call("wait", "cancelled"), p.call("wait", "cancelled")
        assert received["state"] in ("cancelled", "failed") and sent["state"] in ("cancelled", "failed")
        assert "done" not in (received["state"], sent["state"])
        for w in (p, d):
            w.call("release", "cancelled")
        start_transfer(p, d, "after-cancel", 50)  # same pair, still in step
        finish_transfer(p, d, "after-cancel", 50)
        assert p.call("status")["pairs"] == 1
        assert_no_blocks_held(p, d)
    finally:
        p.stop()
        d.stop()
