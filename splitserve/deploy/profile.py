"""A profile: what one worker's steps and one KV transfer cost on a device, measured and fitted.

``splitserve profile`` (``splitserve.planning.measure``) times the real engine on a grid of steps and
the real KV transfer on a grid of sizes, and writes one JSON file; ``splitserve simulate`` and
``splitserve plan`` read it. Torch-free.

A step of a continuous batch is described by five features (``StepShape``)::

    1                      the step's fixed cost (weights read once, launch and Python overheads)
    prefill_tokens         prompt tokens computed (GEMM rows)
    prefill_attention      sum over prompt chunks of new x (cached + new / 2), in thousands of
                           token pairs: attention's quadratic part
    decodes                sequences decoding one token
    decode_context         their context tokens, in thousands (attention reads the whole KV)

and its time is the dot product with the fitted coefficients (least squares, each coefficient >= 0),
so prefill-only, decode-only and mixed (colocated) steps share one model. A KV transfer costs
``latency_s + bytes / bytes_per_s`` (``TransferCost``).

A profile says of each of its parts (``PARTS``: the steps, the KV transfer, the serving overheads) where
it came from, in ``parts``: ``"measured"``, ``"not measured"``, or what else it is (a roofline's
published figures and assumptions, a fit the samples did not determine). A transfer that was not
measured is absent (``transfer`` None), never a stand-in number: timing a KV hand-off with such a profile
raises ``MissingPart``. Profiles are strict JSON both ways: no Infinity or NaN is written or read.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROFILE_VERSION = 2  # 2: per-part labels (``parts``), the transfer optional (``transfer``)
FEATURES = ("const", "prefill_tokens", "prefill_attention", "decodes", "decode_context")
PARTS = ("steps", "transfer", "serving")
MEASURED = "measured"
NOT_MEASURED = "not measured"


class ProfileError(ValueError):
    """Not a valid profile; the message names the field."""


class MissingPart(ProfileError):
    """The profile lacks a part (it was not measured) that this use of it needs; the message names it."""


class TransferFitError(ProfileError):
    """The transfer samples do not determine a latency and a bandwidth."""


@dataclass(frozen=True)
class StepShape:
    """What one step computes, as the cost model sees it."""

    prefill_tokens: int = 0
    prefill_attention: float = 0.0  # thousands of token pairs
    decodes: int = 0
    decode_context: float = 0.0  # thousands of context tokens

    @classmethod
    def of(cls, chunks: list[tuple[int, int]] = (), contexts: list[int] = ()) -> StepShape:
        """From prompt chunks ``(cached, new)`` and decode contexts (tokens in the KV, the new one included)."""
        return cls(
            prefill_tokens=sum(new for _, new in chunks),
            prefill_attention=sum(new * (cached + new / 2) for cached, new in chunks) / 1e3,
            decodes=len(contexts),
            decode_context=sum(contexts) / 1e3,
        )

    def features(self) -> tuple[float, ...]:
        return (1.0, float(self.prefill_tokens), self.prefill_attention, float(self.decodes), self.decode_context)

    @property
    def is_empty(self) -> bool:
        return self.prefill_tokens == 0 and self.decodes == 0


@dataclass(frozen=True)
class ModelShape:
    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096

    @classmethod
    def of(cls, model, name: str) -> ModelShape:
        """The shape of a loaded model's config (``splitserve.engine.model.config.ModelConfig``)."""
        return cls(
            name=name,
            architecture=model.architecture,
            num_layers=model.num_layers,
            hidden_size=model.hidden_size,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            intermediate_size=model.intermediate_size,
            vocab_size=model.vocab_size,
            max_position_embeddings=model.max_position_embeddings,
        )

    @property
    def kv_elements_per_token(self) -> int:
        """K and V of every layer's KV heads: elements one token adds to the cache (whole model)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class StepSample:
    shape: StepShape
    seconds: float


@dataclass(frozen=True)
class TransferSample:
    bytes: int
    seconds: float


@dataclass(frozen=True)
class TransferCost:
    """One KV transfer: ``latency_s + bytes / bytes_per_s``."""

    latency_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if not (isinstance(self.latency_s, (int, float)) and math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ProfileError(f"transfer.latency_s: must be a finite number >= 0, got {self.latency_s!r}")
        if not (
            isinstance(self.bytes_per_s, (int, float)) and math.isfinite(self.bytes_per_s) and self.bytes_per_s > 0
        ):
            raise ProfileError(f"transfer.bytes_per_s: must be a finite number > 0, got {self.bytes_per_s!r}")

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Profile:
    model: ModelShape
    dtype: str
    dtype_bytes: int
    device: str  # cpu | cuda
    device_name: str  # the CPU model or GPU name the figures were measured on
    threads: int  # torch threads per rank (CPU)
    tensor_parallel_size: int
    step_coefficients: dict[str, float]  # FEATURES -> seconds per unit
    transfer: TransferCost | None  # None: not measured (``parts["transfer"]`` says why)
    steps: tuple[StepSample, ...] = ()
    transfers: tuple[TransferSample, ...] = ()
    source: str = "measured"  # "measured", or where published figures came from
    created: str = ""
    notes: dict[str, Any] = field(default_factory=dict)
    # PARTS -> "measured", "not measured", or where the part came from; a part left out is "not measured".
    parts: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if set(self.step_coefficients) != set(FEATURES):
            raise ProfileError(
                f"step_coefficients: expected {', '.join(FEATURES)}, got {sorted(self.step_coefficients)}"
            )
        bad = [k for k, v in self.step_coefficients.items() if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise ProfileError(f"step_coefficients.{bad[0]}: must be a finite number >= 0")
        if self.transfer is not None and not isinstance(self.transfer, TransferCost):
            raise ProfileError("transfer: expected a TransferCost (latency_s, bytes_per_s) or None")
        if self.tensor_parallel_size < 1:
            raise ProfileError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        unknown = sorted(set(self.parts) - set(PARTS))
        if unknown:
            raise ProfileError(f"parts.{unknown[0]}: not a part of a profile ({', '.join(PARTS)})")
        parts = {part: self.parts.get(part, NOT_MEASURED) for part in PARTS}
        bad = [part for part, label in parts.items() if not (isinstance(label, str) and label)]
        if bad:
            raise ProfileError(f"parts.{bad[0]}: must be a label such as {MEASURED!r} or {NOT_MEASURED!r}")
        object.__setattr__(self, "parts", parts)
        # A part said to be measured carries what was measured.
        if parts["transfer"] == MEASURED and (self.transfer is None or not self.transfers):
            raise ProfileError("parts.transfer: measured, but the profile has no transfer fit and samples")
        if parts["steps"] == MEASURED and not self.steps:
            raise ProfileError("parts.steps: measured, but the profile has no step samples")
        if parts["serving"] == MEASURED and "ttft_overhead_s" not in self.notes:
            raise ProfileError("parts.serving: measured, but notes hold no serving overheads")

    def measured(self, part: str) -> bool:
        """Whether ``part`` (one of PARTS) was measured on the device."""
        return self.parts[part] == MEASURED

    # ---- what things cost ---------------------------------------------------------------------

    def step_s(self, shape: StepShape) -> float:
        """Seconds of one step of this shape (0 for an empty one)."""
        if shape.is_empty:
            return 0.0
        c = self.step_coefficients
        return sum(c[name] * x for name, x in zip(FEATURES, shape.features()))

    def serving_step_s(self, shape: StepShape, tokens: int) -> float:
        """A step as a serving worker takes it: the engine's, its prompt part scaled by the measured
        ``prefill_factor``, plus the measured overheads of serving, a fixed part and a part for each of the
        ``tokens`` it streams."""
        if shape.is_empty:
            return 0.0
        c = self.step_coefficients
        prompt = c["prefill_tokens"] * shape.prefill_tokens + c["prefill_attention"] * shape.prefill_attention
        extra = (self.prefill_factor - 1.0) * prompt
        return self.step_s(shape) + extra + self.step_overhead_s + tokens * self.token_overhead_s

    @property
    def prefill_factor(self) -> float:
        """How much more a prompt's tokens cost in a serving worker than in the engine alone (1: as much)."""
        return float(self.notes.get("prefill_factor", 1.0))

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of ``tokens`` tokens of KV, whole model (what a hand-off moves in all)."""
        return tokens * self.model.kv_elements_per_token * self.dtype_bytes

    def block_bytes(self, block_size: int, tensor_parallel_size: int = 1) -> int:
        """Bytes of one KV block on one rank of a worker of this TP size (its share of the KV heads)."""
        from splitserve.engine.tp.layout import kv_head_range

        heads = kv_head_range(self.model.num_kv_heads, tensor_parallel_size, 0).count
        return block_size * 2 * self.model.num_layers * heads * self.model.head_dim * self.dtype_bytes

    @property
    def step_overhead_s(self) -> float:
        """Measured time a serving worker's step takes beyond the engine's (0 when not measured)."""
        return float(self.notes.get("step_overhead_s", 0.0))

    @property
    def token_overhead_s(self) -> float:
        """Measured serving cost of one streamed token, in its worker's step (0 when not measured)."""
        return float(self.notes.get("token_overhead_s", 0.0))

    @property
    def ttft_overhead_s(self) -> float:
        """Measured time a request spends outside the steps before its first token (0 when not measured)."""
        return float(self.notes.get("ttft_overhead_s", 0.0))

    def transfer_s(self, nbytes: int) -> float:
        """Seconds of one KV transfer of ``nbytes``; ``MissingPart`` when the profile has no transfer."""
        return self.require_transfer("a KV transfer is timed").seconds(nbytes)

    def require_transfer(self, why: str) -> TransferCost:
        """The transfer, or ``MissingPart`` saying that ``why`` needs it and that it is absent."""
        if self.transfer is None:
            raise MissingPart(
                f"transfer: the profile of {self.model.name} has no KV transfer ({self.parts['transfer']}), and "
                f"{why}: measure it (`splitserve profile` without --no-transfer)"
            )
        return self.transfer

    # ---- JSON ---------------------------------------------------------------------------------

    def to_json(self) -> dict:
        data = asdict(self)
        data["version"] = PROFILE_VERSION
        data["steps"] = [{**asdict(s.shape), "seconds": s.seconds} for s in self.steps]
        data["transfers"] = [asdict(t) for t in self.transfers]
        return data

    def save(self, path: str | Path) -> None:
        """Strict JSON: a value JSON cannot hold (Infinity, NaN) raises rather than being written."""
        try:
            text = json.dumps(self.to_json(), indent=1, allow_nan=False)
        except ValueError as e:
            raise ProfileError(f"{path}: {e}") from None
        Path(path).write_text(text + "\n")

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        if not isinstance(data, dict):
            raise ProfileError("profile: expected a JSON object")
        if data.get("version") != PROFILE_VERSION:
            hint = (
                ": a profile written before its parts were labelled; measure it again with `splitserve profile`"
                if data.get("version") == 1
                else ""
            )
            raise ProfileError(f"version: expected {PROFILE_VERSION}, got {data.get('version')!r}{hint}")
        _refuse_non_finite(data, "")
        if "parts" not in data:
            raise ProfileError("parts: missing from the profile (which parts were measured)")
        if not isinstance(data.get("transfer"), (dict, type(None))):
            raise ProfileError("transfer: expected an object (latency_s, bytes_per_s) or null")
        try:
            model = ModelShape(**data["model"])
            steps = tuple(
                StepSample(StepShape(**{k: v for k, v in s.items() if k != "seconds"}), float(s["seconds"]))
                for s in data.get("steps", [])
            )
            transfers = tuple(TransferSample(int(t["bytes"]), float(t["seconds"])) for t in data.get("transfers", []))
            transfer = TransferCost(**data["transfer"]) if data.get("transfer") is not None else None
            fields = {k: v for k, v in data.items() if k not in ("version", "model", "steps", "transfers", "transfer")}
            return cls(model=model, steps=steps, transfers=transfers, transfer=transfer, **fields)
        except KeyError as e:
            raise ProfileError(f"{e.args[0]}: missing from the profile") from None
        except TypeError as e:
            raise ProfileError(f"profile: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Strict JSON: Infinity and NaN (which Python's json reads by default) are refused by field."""
        try:
            data = json.loads(Path(path).read_text(), parse_constant=_NonFinite)
        except (OSError, json.JSONDecodeError) as e:
            raise ProfileError(f"{path}: {e}") from None
        return cls.from_json(data)


class _NonFinite(str):
    """What the strict loader reads for Infinity, -Infinity or NaN, so that the field can be named."""


def _refuse_non_finite(value: Any, where: str) -> None:
    if isinstance(value, _NonFinite) or (isinstance(value, float) and not math.isfinite(value)):
        raise ProfileError(f"{where or 'profile'}: {value} is not a number strict JSON holds")
    if isinstance(value, dict):
        for key, item in value.items():
            _refuse_non_finite(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_non_finite(item, f"{where}[{i}]")


# ---- fitting ----------------------------------------------------------------------------------------


def fit_steps(samples: list[StepSample]) -> dict[str, float]:
    """Non-negative least squares of step time on the features, weighted by 1/time (so that relative,
    not absolute, errors count: a 1 ms decode step matters as much as a 1 s prefill)."""
    rows = [s.shape.features() for s in samples]
    target = [s.seconds for s in samples]
    weights = [1.0 / max(t, 1e-6) for t in target]
    coefficients = nnls(
        [[x * w for x in row] for row, w in zip(rows, weights)], [t * w for t, w in zip(target, weights)]
    )
    return dict(zip(FEATURES, coefficients))


def fit_transfer(samples: list[TransferSample]) -> TransferCost:
    """``latency + bytes / bandwidth`` fitted by non-negative least squares on relative errors.

    Refuses (``TransferFitError``) rather than invent a figure when the samples do not determine both: fewer
    than two sizes, a time that is not a positive number, times that do not grow with the bytes (no
    bandwidth: it would be infinite), or a fit that puts the fixed cost at its bound of 0 (every real
    transfer has one: a control message and a payload send)."""
    bad = [i for i, s in enumerate(samples) if not (math.isfinite(s.seconds) and s.seconds > 0)]
    if bad:
        raise TransferFitError(f"transfers[{bad[0]}].seconds: must be a positive number, got {samples[bad[0]].seconds}")
    sizes = sorted({s.bytes for s in samples})
    if len(sizes) < 2:
        raise TransferFitError(f"transfers: a latency and a bandwidth need at least two sizes, got {sizes}")
    weights = [1.0 / s.seconds for s in samples]
    latency, per_byte = nnls(
        [[w, s.bytes * w] for s, w in zip(samples, weights)], [s.seconds * w for s, w in zip(samples, weights)]
    )
    seen = ", ".join(f"{s.bytes} B in {s.seconds * 1e3:.3g} ms" for s in samples)
    if not per_byte > 0 or not math.isfinite(1.0 / per_byte):
        raise TransferFitError(f"transfers: the times do not grow with the bytes ({seen}): no bandwidth to fit")
    if not latency > 0:
        raise TransferFitError(f"transfers: the fit puts the fixed cost at 0 ({seen}): no latency to fit")
    return TransferCost(latency, 1.0 / per_byte)


def relative_errors(profile: Profile) -> list[float]:
    """The fit's relative error on each measured step (for the profile's own report)."""
    return [abs(profile.step_s(s.shape) - s.seconds) / s.seconds for s in profile.steps if s.seconds > 0]


def nnls(a: list[list[float]], b: list[float], iterations: int = 500) -> list[float]:
    """min ||a x - b|| with x >= 0 (Lawson-Hanson active set; small problems). numpy only."""
    import numpy as np

    A, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n = A.shape[1]
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    A = A / scale
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(iterations):
        gradient = A.T @ (y - A @ x)
        candidates = ~passive & (gradient > 1e-12)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            negative = passive & (z <= 0)
            alpha = np.min(x[negative] / (x[negative] - z[negative]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return (x / scale).tolist()
