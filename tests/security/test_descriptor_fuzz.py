"""Fuzzing the descriptor decoder, the one place our code decodes msgpack from the network: random
bytes, random msgpack values (extension types included) and mutations of a valid descriptor either
decode to a valid descriptor or raise DescriptorError, never anything else, and never slowly."""

from __future__ import annotations

import time
from datetime import timedelta

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.kv_transfer.descriptor import (
    COMMIT_VERSION,
    DTYPES,
    Commit,
    DescriptorError,
    PayloadDescriptor,
    decode_descriptor,
    encode_descriptor,
)
from tests.kv_transfer.test_units import make_descriptor

# A fixed number of examples, each with a deadline: the whole file runs in a few seconds.
FUZZ = settings(max_examples=300, deadline=timedelta(milliseconds=500), suppress_health_check=[HealthCheck.too_slow])
VALID = msgpack.unpackb(encode_descriptor(make_descriptor()))
KEYS = sorted(VALID)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=40)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8))
    | st.builds(msgpack.Timestamp, st.integers(0, 2**32 - 1))
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(st.text(max_size=12) | st.binary(max_size=4) | st.integers(-5, 5), inner, max_size=6)
    ),
    max_leaves=20,
)


def check(data: bytes) -> None:
    """The property: a valid descriptor (that survives a round trip), or DescriptorError."""
    try:
        d = decode_descriptor(data)
    except DescriptorError:
        return
    assert isinstance(d, PayloadDescriptor)
    assert all(
        isinstance(getattr(d, f), int) and not isinstance(getattr(d, f), bool)
        for f in ("seq", "layer_start", "layer_end", "block_start", "block_end", "num_blocks", "num_tokens", "nbytes")
    )
    assert 0 <= d.layer_start < d.layer_end and 0 <= d.block_start < d.block_end <= d.num_blocks
    assert d.heads is None or (
        all(type(h) is int for h in d.heads) and len(d.heads) == 2 and 0 <= d.heads[0] < d.heads[1]
    )
    assert isinstance(d.transfer_id, str) and d.dtype in DTYPES and isinstance(d.last, bool) and d.nbytes >= 1
    assert d.commit is None or (
        isinstance(d.commit, Commit)
        and d.commit.version == COMMIT_VERSION
        and type(d.commit.first_token) is int
        and 0 <= d.commit.first_token < 2**31
    )
    assert decode_descriptor(encode_descriptor(d)) == d


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes(data):
    check(data)


@FUZZ
@given(values)
def test_random_msgpack_values(value):
    check(msgpack.packb(value, use_bin_type=True))


@FUZZ
@given(st.dictionaries(st.sampled_from([*KEYS, "extra"]), values, max_size=len(KEYS) + 1))
def test_random_maps_of_descriptor_keys(raw):
    check(msgpack.packb(raw, use_bin_type=True))


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["version", "first_token", "extra"]) | st.binary(max_size=12),
        st.integers(-(2**33), 2**33) | values,
        max_size=4,
    )
)
def test_random_commit_records(commit):
    check(msgpack.packb({**VALID, "commit": commit}, use_bin_type=True))


@FUZZ
@given(
    st.lists(st.tuples(st.sampled_from(["set", "drop", "add"]), st.sampled_from(KEYS), values), min_size=1, max_size=3)
)
def test_field_mutations_of_a_valid_descriptor(edits):
    raw = dict(VALID)
    for action, key, value in edits:
        if action == "set":
            raw[key] = value
        elif action == "drop":
            raw.pop(key, None)
        else:
            raw[f"{key}_"] = value
    check(msgpack.packb(raw, use_bin_type=True))


@FUZZ
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["flip", "insert", "delete", "truncate"]), st.integers(0, 10**6), st.integers(0, 255)
        ),
        min_size=1,
        max_size=4,
    )
)
def test_byte_mutations_of_a_valid_descriptor(edits):
    data = bytearray(encode_descriptor(make_descriptor()))
    for action, at, byte in edits:
        at %= max(len(data), 1)
        if action == "flip" and data:
            data[at] ^= byte or 1
        elif action == "insert":
            data.insert(at, byte)
        elif action == "delete" and data:
            del data[at]
        elif action == "truncate":
            del data[at:]
    check(bytes(data))


def test_hostile_shapes_are_refused_quickly():
    """Deep nesting, lengths that claim gigabytes, extension types, and the largest input allowed."""
    hostile = [
        b"\x91" * 65_000,  # arrays nested 65,000 deep
        b"\x81\xa1a" * 20_000,  # maps nested 20,000 deep
        b"\xdd\xff\xff\xff\xff",  # an array that claims 4 billion items
        b"\xdb\xff\xff\xff\xff" + b"x" * 100,  # a string that claims 4 GiB
        # the one extension msgpack decodes itself
        msgpack.packb({**VALID, "commit": {"version": 1, "first_token": msgpack.Timestamp(1)}}),
        msgpack.packb({**VALID, "commit": {"version": 1, "first_token": msgpack.ExtType(42, b"\x80\x04")}}),
        msgpack.packb({**VALID, "commit": {"version": 1, "first_token": {"a": 1}}}),
        msgpack.packb({**VALID, "commit": {"version": 1, "first_token": 5, **{str(i): i for i in range(17)}}}),
        msgpack.packb({**VALID, "commit": {"version": 99, "first_token": 5}}),
        msgpack.packb({**VALID, "id": b"r1"}),  # bytes where a string belongs
        msgpack.packb({"": None, b"": None}),  # str and bytes keys together (once a TypeError)
        msgpack.packb({**VALID, "id": "x" * 70_000}),  # over the size limit
    ]
    for data in hostile:
        # CPU time of this process: the work a hostile input costs, not how long a busy machine's other
        # processes kept it waiting (wall time read 0.58 s once with the suite's workers still exiting)
        start = time.process_time()
        try:
            decode_descriptor(data)
            raise AssertionError(f"accepted {data[:40]!r}")
        except DescriptorError:
            pass
        assert time.process_time() - start < 0.5, data[:40]
