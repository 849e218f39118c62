"""Rank 0 drives a tensor-parallel engine: each step's plan, sent to the other ranks.

Rank 0 owns the scheduler and the block manager. Each step it turns the scheduler's output into a
``StepPlan`` (everything one forward needs, as plain int64 arrays: no request, no block manager),
broadcasts it, and every rank runs the same forward on its shard of the paged cache (block ids are rank
0's, identical everywhere since every rank's cache has the same number of blocks). Only rank 0 computes
logits and samples; a follower drops the hidden states. ``Stop`` ends a follower's loop.

On the wire a message is one msgpack map (``encode``/``decode``): a version, a kind, and for a step the
plan's fields, each array as its dtype, shape and raw bytes. Decoding is strict (exact keys, the version,
every type, dtype and shape checked) and errors name the field. ``PlanChannel`` sends a message with two
broadcasts from rank 0: its length (an int64 tensor), then the bytes (uint8); both are bounded by the
group's timeout, so a dead rank 0 makes a follower raise ``CollectiveError`` and a dead follower makes rank
0's next collective raise.

Besides plans, rank 0 sends ``Tick`` (a keep-alive while it has nothing to run: every rank then joins one
all-reduce, so a dead or stalled rank fails the group even while idle) and ``Notice`` (opaque bytes for
the layer above, in order with the plans: a serving worker tells its ranks which KV transfers start with
the next step). A follower waits at most the group's timeout for the next message: a rank 0 idle longer
without a tick fails its followers. ``LLM`` steps without pause while it has requests; a serving worker
ticks while idle (``PlanChannel.tick``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import numpy as np
import torch

from splitserve.engine.tp.distributed import TPGroup

PLAN_VERSION = 1
MAX_PLAN_BYTES = 256 << 20  # a length past this is a corrupt message, not a step


class PlanError(ValueError):
    """A message that is not a valid plan; the text starts with the offending field."""


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One forward of a flattened batch (decodes first, then prefill chunks; see engine/attention/paged_attention.py).

    Every array is int64. T tokens, D decodes, P prefill chunks, S sampled rows."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_blocks: np.ndarray  # [T] cache block of every token
    slot_offsets: np.ndarray  # [T] offset within it
    decode_context_lens: np.ndarray  # [D] context of each decode, its new token included
    decode_tables: np.ndarray  # [D, W] block tables of the decodes, 0-padded
    prefill_chunks: np.ndarray  # [P, 3] start, end (rows of the batch) and tokens already cached
    prefill_tables: np.ndarray  # [P, W'] block tables of the chunks' requests, 0-padded
    sample_rows: np.ndarray  # [S] rows whose logits rank 0 samples (followers skip logits)
    max_position: int

    @property
    def num_decodes(self) -> int:
        return len(self.decode_context_lens)


@dataclass(frozen=True)
class Stop:
    """Ends a follower's loop (rank 0's engine closes)."""


@dataclass(frozen=True)
class Tick:
    """Keep-alive: no forward; every rank joins one all-reduce (``PlanChannel.tick``/``receive``)."""


@dataclass(frozen=True)
class Notice:
    """Bytes for the layer above the engine, delivered in order with the plans (the engine never reads them)."""

    payload: bytes


@dataclass(frozen=True)
class Foreign:
    """A step of another engine behind the workers' seam (the vllm backend: vLLM's scheduler output), run by
    every rank's engine of that kind; this module only carries its bytes, in order with the notices."""

    payload: bytes


Message = StepPlan | Stop | Tick | Notice | Foreign

_ARRAY_DIMS = {
    "input_ids": 1,
    "positions": 1,
    "slot_blocks": 1,
    "slot_offsets": 1,
    "decode_context_lens": 1,
    "decode_tables": 2,
    "prefill_chunks": 2,
    "prefill_tables": 2,
    "sample_rows": 1,
}
_PLAN_KEYS = frozenset(_ARRAY_DIMS) | {"max_position"}
_ARRAY_KEYS = frozenset({"dtype", "shape", "data"})
_DTYPE = np.dtype(np.int64)


def encode(message: Message) -> bytes:
    if isinstance(message, Stop | Tick):
        kind = "stop" if isinstance(message, Stop) else "tick"
        return msgpack.packb({"version": PLAN_VERSION, "kind": kind}, use_bin_type=True)
    if isinstance(message, Notice | Foreign):
        kind = "notice" if isinstance(message, Notice) else "foreign"
        return msgpack.packb({"version": PLAN_VERSION, "kind": kind, "payload": message.payload}, use_bin_type=True)
    plan: dict[str, Any] = {name: _encode_array(getattr(message, name)) for name in _ARRAY_DIMS}
    plan["max_position"] = int(message.max_position)
    return msgpack.packb({"version": PLAN_VERSION, "kind": "step", "plan": plan}, use_bin_type=True)


def _encode_array(array: np.ndarray) -> dict[str, Any]:
    array = np.ascontiguousarray(array)
    return {"dtype": array.dtype.str, "shape": list(array.shape), "data": array.tobytes()}


def decode(payload: bytes) -> Message:
    """The message in ``payload``; raises PlanError naming the field when it is not a valid one."""
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for truncated or garbage input
        raise PlanError(f"payload: not a msgpack message ({type(e).__name__}: {e})") from None
    if not isinstance(message, dict):
        raise PlanError(f"payload: expected a map, got {type(message).__name__}")
    version = message.get("version")
    if type(version) is not int or version != PLAN_VERSION:
        raise PlanError(f"version: expected {PLAN_VERSION}, got {version!r}")
    kind = message.get("kind")
    expected = _MESSAGE_KEYS.get(kind)
    if expected is None:
        raise PlanError(f"kind: expected one of {', '.join(map(repr, _MESSAGE_KEYS))}, got {kind!r}")
    _check_keys(message, expected, "message")
    if kind == "stop":
        return Stop()
    if kind == "tick":
        return Tick()
    if kind in ("notice", "foreign"):
        if not isinstance(message["payload"], bytes):
            raise PlanError(f"payload: expected bytes, got {type(message['payload']).__name__}")
        return Notice(message["payload"]) if kind == "notice" else Foreign(message["payload"])
    return _decode_plan(message["plan"])


_MESSAGE_KEYS = {
    "step": {"version", "kind", "plan"},
    "stop": {"version", "kind"},
    "tick": {"version", "kind"},
    "notice": {"version", "kind", "payload"},
    "foreign": {"version", "kind", "payload"},
}


def _check_keys(mapping: dict, expected: set[str] | frozenset[str], what: str) -> None:
    missing, extra = sorted(set(expected) - set(mapping)), sorted(set(mapping) - set(expected), key=str)
    if missing:
        raise PlanError(f"{missing[0]}: missing from the {what}")
    if extra:
        raise PlanError(f"{extra[0]}: not a field of the {what}")


def _decode_plan(plan: Any) -> StepPlan:
    if not isinstance(plan, dict):
        raise PlanError(f"plan: expected a map, got {type(plan).__name__}")
    _check_keys(plan, _PLAN_KEYS, "plan")
    arrays = {name: _decode_array(plan[name], name, ndim) for name, ndim in _ARRAY_DIMS.items()}
    max_position = plan["max_position"]
    if type(max_position) is not int or max_position < 0:
        raise PlanError(f"max_position: expected an int >= 0, got {max_position!r}")
    tokens = len(arrays["input_ids"])
    if tokens == 0:
        raise PlanError("input_ids: a step has at least one token")
    for name in ("positions", "slot_blocks", "slot_offsets"):
        if len(arrays[name]) != tokens:
            raise PlanError(f"{name}: {len(arrays[name])} entries for {tokens} tokens")
    if arrays["decode_tables"].shape[0] != len(arrays["decode_context_lens"]):
        rows, decodes = arrays["decode_tables"].shape[0], len(arrays["decode_context_lens"])
        raise PlanError(f"decode_tables: {rows} rows for {decodes} decodes")
    if arrays["prefill_chunks"].shape[1] != 3:
        raise PlanError(f"prefill_chunks: shape {arrays['prefill_chunks'].shape}, expected [P, 3]")
    if arrays["prefill_tables"].shape[0] != arrays["prefill_chunks"].shape[0]:
        rows, chunks = arrays["prefill_tables"].shape[0], len(arrays["prefill_chunks"])
        raise PlanError(f"prefill_tables: {rows} rows for {chunks} prefill chunks")
    return StepPlan(**arrays, max_position=max_position)


def _decode_array(value: Any, name: str, ndim: int) -> np.ndarray:
    if not isinstance(value, dict):
        raise PlanError(f"{name}: expected an array map, got {type(value).__name__}")
    _check_keys(value, _ARRAY_KEYS, f"array {name}")
    dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if dtype != _DTYPE.str:
        raise PlanError(f"{name}: dtype {dtype!r}, expected {_DTYPE.str!r} (int64)")
    if not (isinstance(shape, list) and len(shape) == ndim and all(type(n) is int and n >= 0 for n in shape)):
        raise PlanError(f"{name}: shape {shape!r}, expected {ndim} sizes >= 0")
    if not isinstance(data, bytes) or len(data) != int(np.prod(shape)) * _DTYPE.itemsize:
        got = len(data) if isinstance(data, bytes) else type(data).__name__
        raise PlanError(f"{name}: {got} bytes of data for shape {shape}")
    return np.frombuffer(data, dtype=_DTYPE).reshape(shape).copy()  # writable: torch.from_numpy takes it


class PlanChannel:
    """Rank 0 sends, every other rank receives, one message per step; each call is a pair of broadcasts
    on the group (every rank must make the matching call, in order with the forward's collectives)."""

    def __init__(self, group: TPGroup, device: torch.device, max_bytes: int = MAX_PLAN_BYTES) -> None:
        self.group, self.device, self.max_bytes = group, torch.device(device), max_bytes
        self.broken = False  # a collective failed: the group is unusable, Stop cannot be sent
        self.stopped = False
        self.last_sent = time.monotonic()  # rank 0: when it last sent anything (keep-alive)

    def send(self, message: Message) -> None:
        assert self.group.rank == 0, "only rank 0 sends plans"
        payload = encode(message)
        try:
            self.group.broadcast(torch.tensor([len(payload)], dtype=torch.int64, device=self.device), src=0)
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
            self.group.broadcast(data, src=0)
            if isinstance(message, Tick):
                self._probe()
        except BaseException:
            self.broken = True
            raise
        self.last_sent = time.monotonic()

    def tick(self) -> None:
        """Rank 0 idle: a keep-alive that every rank answers (one all-reduce), so a dead or stalled rank
        raises ``CollectiveError`` here within the group's timeout, and the followers' wait starts again."""
        self.send(Tick())

    def receive(self) -> Message:
        """The next message from rank 0 (a follower); a ``Tick`` is answered before it is returned."""
        length = self.group.broadcast(torch.zeros(1, dtype=torch.int64, device=self.device), src=0)
        n = int(length.item())
        if not 0 < n <= self.max_bytes:
            raise PlanError(f"length: {n} bytes, expected 1 to {self.max_bytes}")
        data = self.group.broadcast(torch.empty(n, dtype=torch.uint8, device=self.device), src=0)
        message = decode(data.cpu().numpy().tobytes())
        if isinstance(message, Tick):
            self._probe()
        return message

    def _probe(self) -> None:
        self.group.all_reduce(torch.zeros(1, dtype=torch.float32, device=self.device))

    def close(self) -> None:
        """Send Stop once (not after a failed collective: the followers have failed already)."""
        if not (self.stopped or self.broken):
            self.stopped = True
            self.send(Stop())


class PlanRunner(Protocol):
    """What a follower runs plans on (``ModelRunner``)."""

    device: torch.device

    def run_plan(self, plan: StepPlan) -> torch.Tensor: ...


def follow(target: Any, group: TPGroup) -> int:
    """A follower rank's loop: receive a plan, run its forward on the local shard, until ``Stop``; returns
    the number of steps run. ``target``: an ``EngineCore`` (its runner is used) or a ``PlanRunner``.
    Raises ``CollectiveError`` when rank 0 dies or stalls past the group's timeout."""
    if group.rank == 0:
        raise ValueError("group: rank 0 drives the steps; follow runs on the other ranks")
    runner: PlanRunner = getattr(target, "runner", target)
    channel = PlanChannel(group, runner.device)
    steps = 0
    while True:
        message = channel.receive()
        if isinstance(message, Stop):
            return steps
        if isinstance(message, StepPlan):
            runner.run_plan(message)
            steps += 1
