"""What rank 0 of a tensor-parallel prefill worker tells its other ranks in order with the step plans.

A KV transfer streams layer groups while the step that computes them runs, on every rank: so each rank must
start its sends for a request before that step's forward. Rank 0 sends ``StartSends`` as a ``Notice`` on
the plan channel (``splitserve.engine.tp.step``) right before the plan of the step that runs the request's
final chunk; each rank starts the parts it holds heads for (``splitserve.kv_transfer.tp.parts.sends_for``).

One msgpack map, decoded strictly (exact keys, a version, every type and range checked); errors name the
field. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from splitserve.kv_transfer.sender import PeerAddress

NOTICE_VERSION = 1
MAX_BLOCKS = 1 << 20


class NoticeError(ValueError):
    """Not a valid notice; the text starts with the offending field."""


@dataclass(frozen=True)
class StartSends:
    """Start the sends of request ``request_id``'s KV, its blocks in token order, to the receiving worker's
    ranks (``destinations``, rank 0 first)."""

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    destinations: tuple[PeerAddress, ...]


_KEYS = {"version", "kind", "request_id", "block_ids", "num_tokens", "destinations"}
_PEER_KEYS = ("receiver_id", "incarnation", "control")


def encode(notice: StartSends) -> bytes:
    return msgpack.packb(
        {
            "version": NOTICE_VERSION,
            "kind": "start_sends",
            "request_id": notice.request_id,
            "block_ids": list(notice.block_ids),
            "num_tokens": notice.num_tokens,
            "destinations": [[d.receiver_id, d.incarnation, d.control] for d in notice.destinations],
        },
        use_bin_type=True,
    )


def decode(payload: bytes) -> StartSends:
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for truncated or garbage input
        raise NoticeError(f"payload: not a msgpack message ({type(e).__name__}: {e})") from None
    if not isinstance(message, dict):
        raise NoticeError(f"payload: expected a map, got {type(message).__name__}")
    if message.get("version") != NOTICE_VERSION or type(message.get("version")) is not int:
        raise NoticeError(f"version: expected {NOTICE_VERSION}, got {message.get('version')!r}")
    if message.get("kind") != "start_sends":
        raise NoticeError(f"kind: expected 'start_sends', got {message.get('kind')!r}")
    missing, extra = sorted(_KEYS - set(message)), sorted(set(message) - _KEYS, key=str)
    if missing or extra:
        raise NoticeError(f"{(missing or extra)[0]}: {'missing from' if missing else 'not a field of'} the notice")
    request_id, blocks, num_tokens = message["request_id"], message["block_ids"], message["num_tokens"]
    if not isinstance(request_id, str) or not request_id:
        raise NoticeError(f"request_id: expected a non-empty string, got {request_id!r}")
    if not (isinstance(blocks, list) and 0 < len(blocks) <= MAX_BLOCKS and all(_index(b) for b in blocks)):
        raise NoticeError("block_ids: expected a non-empty list of block ids >= 0")
    if not _index(num_tokens) or num_tokens == 0:
        raise NoticeError(f"num_tokens: expected an int >= 1, got {num_tokens!r}")
    return StartSends(request_id, tuple(blocks), num_tokens, _destinations(message["destinations"]))


def _index(value: Any) -> bool:
    return type(value) is int and value >= 0


def _destinations(value: Any) -> tuple[PeerAddress, ...]:
    if not isinstance(value, list) or not value:
        raise NoticeError("destinations: expected a non-empty list of receiving ranks")
    peers = []
    for i, peer in enumerate(value):
        if not (isinstance(peer, list) and len(peer) == len(_PEER_KEYS) and all(isinstance(f, str) for f in peer)):
            raise NoticeError(f"destinations[{i}]: expected [{', '.join(_PEER_KEYS)}] as strings")
        if not peer[0] or not peer[2]:
            raise NoticeError(f"destinations[{i}]: receiver_id and control must not be empty")
        peers.append(PeerAddress(*peer))
    return tuple(peers)
