"""Layout fingerprints and payload descriptors, and their strict msgpack encoding. Torch-free.

A descriptor announces one payload message on a pair's FIFO: which transfer, which layers and which
of the transfer's blocks it carries, and exactly how many bytes follow on the process group. The
transfer's last message also carries its ``Commit``: what the receiver needs, besides the KV, to go on
with the request (the first token, sampled by the sender).
Decoding trusts nothing: a size limit (and limits on every string, bytes, array and map inside), an
exact key set, a type and range check per field (``commit`` included: a versioned record with its own
exact key set), and no msgpack extension types (nothing is ever unpickled or constructed from the wire).

Tensor parallelism: a worker of TP size ``t`` is ``t`` ranks, each holding only its KV heads
(``splitserve.engine.tp.layout``). A rank's fingerprint says its TP size, its rank and its head range; two
ranks can exchange KV when their layouts agree (``mismatches``), whatever their sizes. A descriptor's
``heads`` says which of the model's KV heads its payload holds (docs/kv_transfer.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import msgpack

from splitserve.engine.tp.layout import HeadRange, kv_head_range

PROTOCOL_VERSION = 1
COMMIT_VERSION = 1
DTYPES = ("bfloat16", "float16", "float32")
_MAX_ID_CHARS = 256
_MAX_SHAPE_DIMS = 8
_MAX_STRING_BYTES = 16 << 10
_MAX_TOKEN_ID = 2**31  # token ids are int32 on the wire (workers.proto); the vocabulary check is the receiver's
_ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class DescriptorError(ValueError):
    """A descriptor or fingerprint failed validation; the message names the field."""


@dataclass(frozen=True)
class LayoutFingerprint:
    """One rank's KV layout. ``num_kv_heads`` is the model's total; the rank holds ``heads``.

    The first seven fields must agree between a sender and a receiver; the tensor-parallel ones
    (``tp_size``, ``tp_rank``, ``heads_start``/``heads_stop``) may differ: the transfer then moves only the
    heads both ranks hold. ``heads_stop`` 0 means "to the last head", so a TP-1 fingerprint needs none of them.
    """

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    weights_checksum: str
    tp_size: int = 1
    tp_rank: int = 0
    heads_start: int = 0
    heads_stop: int = 0  # 0: num_kv_heads

    def __post_init__(self) -> None:
        # Fingerprints arrive from the wire (the pair's hello): refuse an inconsistent one by field.
        if self.heads_stop == 0:
            object.__setattr__(self, "heads_stop", self.num_kv_heads)
        if self.num_kv_heads < 1:
            raise DescriptorError(f"num_kv_heads: must be >= 1, got {self.num_kv_heads}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise DescriptorError(f"tp_rank: must be 0 to tp_size - 1 ({self.tp_size - 1}), got {self.tp_rank}")
        if not 0 <= self.heads_start < self.heads_stop <= self.num_kv_heads:
            raise DescriptorError(
                f"heads: [{self.heads_start}, {self.heads_stop}) is not a range within the model's "
                f"{self.num_kv_heads} KV heads"
            )
        kv, tp = self.num_kv_heads, self.tp_size
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):  # engine/tp/layout.py: whole or replicated heads
            raise DescriptorError(f"tp_size: {tp} ranks cannot share the model's {kv} KV heads")
        expected = kv_head_range(kv, tp, self.tp_rank)
        if self.heads != expected:
            raise DescriptorError(
                f"heads: [{self.heads_start}, {self.heads_stop}) are not the KV heads of rank {self.tp_rank} of "
                f"{self.tp_size} ([{expected.start}, {expected.stop}))"
            )

    @property
    def heads(self) -> HeadRange:
        """The model's KV heads this rank holds (its cache's dimension 3)."""
        return HeadRange(self.heads_start, self.heads_stop)

    def mismatches(self, other: LayoutFingerprint) -> list[str]:
        """Names of the layout fields that differ, with both values, for an error message. The
        tensor-parallel fields are not compared: ranks of workers of any sizes may pair."""
        return [
            f"{f.name} ({getattr(self, f.name)!r} != {getattr(other, f.name)!r})"
            for f in fields(self)
            if f.name not in _TP_FIELDS and getattr(self, f.name) != getattr(other, f.name)
        ]

    @property
    def bytes_per_block_layer(self) -> int:
        """Bytes of one block of one layer in this rank's cache: K and V for every head it holds."""
        return self.bytes_per_block_layer_of(self.heads.count)

    def bytes_per_block_layer_of(self, num_heads: int) -> int:
        """Bytes of one block of one layer for ``num_heads`` heads: K and V."""
        return 2 * num_heads * self.block_size * self.head_dim * _ELEMENT_BYTES[self.dtype]


_TP_FIELDS = frozenset(("tp_size", "tp_rank", "heads_start", "heads_stop"))


@dataclass(frozen=True)
class Commit:
    """What the receiver needs, besides the KV, to go on with the request: the first token the sender
    sampled. ``version`` changes when a field is added or changes meaning; a receiver refuses a version
    it does not know rather than guess."""

    first_token: int
    version: int = COMMIT_VERSION


@dataclass(frozen=True)
class PayloadDescriptor:
    seq: int  # position in the pair's FIFO
    transfer_id: str
    layer_start: int
    layer_end: int
    block_start: int  # range within the transfer's block list
    block_end: int
    num_blocks: int  # blocks in the whole transfer
    num_tokens: int  # tokens in the whole transfer
    dtype: str
    shape: tuple[int, ...]  # [layers, blocks, 2, heads, block_size, head_dim]
    nbytes: int
    last: bool  # the sending rank's final message for the transfer
    commit: Commit | None = None  # delivered to the receiver with the last message
    version: int = PROTOCOL_VERSION
    heads: tuple[int, int] | None = None  # the model's KV heads [start, stop) in the payload; None: all of them

    @property
    def num_units(self) -> int:
        """(layer, block) pairs this message fills."""
        return (self.layer_end - self.layer_start) * (self.block_end - self.block_start)


_WIRE_KEYS = frozenset(
    (
        "v",
        "seq",
        "id",
        "layers",
        "blocks",
        "heads",
        "num_blocks",
        "num_tokens",
        "dtype",
        "shape",
        "nbytes",
        "last",
        "commit",
    )
)
_COMMIT_KEYS = frozenset(("version", "first_token"))


def encode_descriptor(d: PayloadDescriptor) -> bytes:
    return msgpack.packb(
        {
            "v": d.version,
            "seq": d.seq,
            "id": d.transfer_id,
            "layers": [d.layer_start, d.layer_end],
            "blocks": [d.block_start, d.block_end],
            "heads": None if d.heads is None else list(d.heads),
            "num_blocks": d.num_blocks,
            "num_tokens": d.num_tokens,
            "dtype": d.dtype,
            "shape": list(d.shape),
            "nbytes": d.nbytes,
            "last": d.last,
            "commit": None if d.commit is None else {"version": d.commit.version, "first_token": d.commit.first_token},
        },
        use_bin_type=True,
    )


def decode_descriptor(data: bytes, max_bytes: int = 64 << 10) -> PayloadDescriptor:
    """Parse and validate one descriptor; DescriptorError names the first bad field."""
    if not isinstance(data, (bytes, bytearray)):
        raise DescriptorError("descriptor: must be bytes")
    if len(data) > max_bytes:
        raise DescriptorError(f"descriptor: {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=_MAX_STRING_BYTES,
            max_str_len=_MAX_STRING_BYTES,
            max_array_len=64,
            max_map_len=64,
            max_ext_len=0,
            ext_hook=_refuse_ext,
        )
    except DescriptorError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise DescriptorError(f"descriptor: not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(raw, dict):
        raise DescriptorError("descriptor: must be a map")
    if not all(isinstance(key, str) for key in raw):  # msgpack's strict_map_key lets bytes keys through
        raise DescriptorError(f"descriptor: keys must be strings, got {sorted(map(repr, raw))}")
    if set(raw) != set(_WIRE_KEYS):
        missing, extra = sorted(set(_WIRE_KEYS) - set(raw)), sorted(set(raw) - set(_WIRE_KEYS))
        raise DescriptorError(f"descriptor: missing keys {missing}, unknown keys {extra}")
    version = _int(raw, "v", 0)
    if version != PROTOCOL_VERSION:
        raise DescriptorError(f"v: protocol version {version} is not {PROTOCOL_VERSION}")
    layer_start, layer_end = _range(raw, "layers")
    block_start, block_end = _range(raw, "blocks")
    heads = None if raw["heads"] is None else _range(raw, "heads")
    num_blocks = _int(raw, "num_blocks", 1)
    if block_end > num_blocks:
        raise DescriptorError(f"blocks: end {block_end} exceeds num_blocks {num_blocks}")
    transfer_id = raw["id"]
    if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= _MAX_ID_CHARS:
        raise DescriptorError(f"id: must be a non-empty string of at most {_MAX_ID_CHARS} characters")
    dtype = raw["dtype"]
    if dtype not in DTYPES:
        raise DescriptorError(f"dtype: {dtype!r} is not one of {DTYPES}")
    shape = raw["shape"]
    if not isinstance(shape, list) or not 0 < len(shape) <= _MAX_SHAPE_DIMS:
        raise DescriptorError("shape: must be a list of 1 to 8 dimensions")
    if not all(isinstance(s, int) and not isinstance(s, bool) and 0 < s < 2**40 for s in shape):
        raise DescriptorError("shape: dimensions must be positive integers")
    last = raw["last"]
    if not isinstance(last, bool):
        raise DescriptorError("last: must be a boolean")
    commit = _commit(raw["commit"])
    return PayloadDescriptor(
        seq=_int(raw, "seq", 0),
        transfer_id=transfer_id,
        layer_start=layer_start,
        layer_end=layer_end,
        block_start=block_start,
        block_end=block_end,
        num_blocks=num_blocks,
        num_tokens=_int(raw, "num_tokens", 1),
        dtype=dtype,
        shape=tuple(shape),
        nbytes=_int(raw, "nbytes", 1),
        last=last,
        commit=commit,
        version=version,
        heads=heads,
    )


def _refuse_ext(code: int, data: bytes) -> Any:
    raise DescriptorError("descriptor: msgpack extension types are not accepted")


def _commit(value: Any) -> Commit | None:
    """nil, or exactly {"version": COMMIT_VERSION, "first_token": a token id}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise DescriptorError(f"commit: must be a map or nil, got {type(value).__name__}")
    if set(value) != _COMMIT_KEYS:  # a bytes key, too, is neither missing nor known
        missing = sorted(_COMMIT_KEYS - set(value))
        extra = ", ".join(sorted(map(repr, set(value) - _COMMIT_KEYS)))  # repr: str and bytes keys do not sort
        raise DescriptorError(f"commit: missing keys {missing}, unknown keys [{extra}]")
    version = value["version"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise DescriptorError(f"commit.version: must be an integer, got {version!r}")
    if version != COMMIT_VERSION:
        raise DescriptorError(f"commit.version: {version} is not {COMMIT_VERSION}")
    first_token = value["first_token"]
    if isinstance(first_token, bool) or not isinstance(first_token, int) or not 0 <= first_token < _MAX_TOKEN_ID:
        raise DescriptorError(f"commit.first_token: must be an integer in [0, {_MAX_TOKEN_ID}), got {first_token!r}")
    return Commit(first_token=first_token, version=version)


def _int(raw: Mapping, key: str, low: int) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**63:
        raise DescriptorError(f"{key}: must be an integer >= {low}, got {value!r}")
    return value


def _range(raw: Mapping, key: str) -> tuple[int, int]:
    value = raw[key]
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        or not 0 <= value[0] < value[1] < 2**31
    ):
        raise DescriptorError(f"{key}: must be [start, end) with 0 <= start < end, got {value!r}")
    return value[0], value[1]
