"""Which kernel each linear layer runs on this CPU: timed once per weight shape at load, cached, logged.

The fastest product for ``x W^T`` depends on the CPU, the dtype and the rows m: on an AVX2 EPYC,
``F.linear`` (MKL) beat oneDNN's prepacked fp32 kernel at m = 1 and lost 3x at m = 8, and oneDNN refused
bf16 outright; on an AVX-512 BF16 EPYC the prepacked kernel won at nearly every m in both dtypes. So at load,
for each distinct (out, in, dtype, bias) of the model's linear layers (the tied LM head counts as one):

1. time the candidates at rows ``ROW_GRID`` (decode batches to prefill chunks; the LM head only up to the
   engine's ``max_num_seqs``, as it only sees sampled rows), interleaved, best of a few reps, at the
   engine's thread count, each call with the weight out of the CPU's caches (``COLD_BYTES`` read first, as
   the rest of a model's step evicts it): "plain" (``F.linear``) and "packed" (oneDNN prepacked) where
   oneDNN runs the dtype;
   for a bf16 (or fp16) weight also the paths that compute in float32 (``FP32_COMPUTE_PATHS``): "upcast"
   (bf16 kept, upcast per call) and, where memory allows a float32 copy (``fp32_allowed``), "fp32"
   (``F.linear`` on it) and "fp32-packed" (oneDNN on it): on a CPU without native bf16 every bf16 product
   is emulated, and these can be the fastest;
2. score each path by ``sum_m ROW_WEIGHTS[m] * t_path(m) / t_best(m)`` (decode rows weigh most), and
   "split" (plain up to a row threshold, packed above) by the same sum over the measured times of the
   two; split is taken only where memory allows it and it beats every single path by ``SPLIT_GAIN``. A
   bf16 weight with float32 copies allowed may also split "plain" against "fp32-packed" ("split-fp32"):
   on a CPU without native bf16, ``F.linear``'s emulated bf16 product of one row streams the weight at
   memory speed while a few rows already lose 2-4x to float32 (the AVX2 emulation in
   docs/performance.md);
3. keep the times in a JSON cache keyed by machine (CPU model, ISA flags, torch version, threads) and shape,
   so a second load times nothing; one log line per shape says what was chosen and why.

Shapes under ``UNTIMED_BELOW`` weights stay plain untimed (oneDNN's fixed cost per call dominates there).
Larger-than-``TIMED_MAX_WEIGHTS`` matrices (the LM head) are timed on their first rows: these kernels
cost the same per output row, and timing 150K rows would take seconds. Other kernels torch 2.13 has on
CPU were measured and left out: ``mkldnn._reorder_linear_weight`` with a batch-size hint (slower than
without one at every m here), MKL's packed GEMM ``mkl._mkl_linear`` (prepacked for one m only, else it
falls back to ``F.linear``; no faster at m = 1), and int8 or Inductor paths (other numerics, or minutes of
compiling at load).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from splitserve.common.file_lock import file_lock
from splitserve.common.validate import check_choice
from splitserve.engine.hardware import cpu_isa, describe_machine, native_bf16
from splitserve.engine.model import cpu_gemv
from splitserve.engine.model.transformer import (
    FP32_COMPUTE_PATHS,
    GEMV_PATHS,
    SPLIT_FP32,
    CausalLM,
    Linear,
    can_pack,
    onednn_runs,
)

logger = logging.getLogger(__name__)

LINEAR_KERNELS = ("auto", "plain", "packed", "split", *FP32_COMPUTE_PATHS, SPLIT_FP32, *GEMV_PATHS)
# The two-kernel paths: (the path timed up to the threshold, the single path above it).
SPLITS = {
    "split": ("plain", "packed"),
    SPLIT_FP32: ("plain", "fp32-packed"),
    **{kind: ("gemv", above) for kind, above in GEMV_PATHS.items()},
}
SPLIT_ABOVE = {kind: above for kind, (_, above) in SPLITS.items()}
# The paths that keep the weight in its own dtype (no float32 copy): what a bf16 model stores.
BF16_STORAGE_PATHS = ("plain", "packed", "split", "upcast", "gemv", "gemv-packed")
FP32_WEIGHT_PATHS = ("fp32", "fp32-packed")
ROW_GRID = (1, 4, 16, 64, 256)
ROW_WEIGHTS = {1: 4.0, 4: 2.0, 16: 2.0, 64: 1.0, 256: 1.0}
UNTIMED_BELOW = 1 << 18
TIMED_MAX_WEIGHTS = 1 << 24
FORCED_SPLIT_ROWS = 8  # linear_kernel="split": decodes of up to 8 sequences run plain, larger steps packed
FORCED_GEMV_ROWS = cpu_gemv.MAX_ROWS  # linear_kernel="gemv" and the like: up to 16 rows through the kernel
SPLIT_GAIN = 0.05
SPLIT_RAM_FRACTION = 0.25  # auto: split allowed when all linear weights take at most this share of RAM
REP_BUDGET_S = 0.03  # per candidate and row count, after one warm-up call
MIN_REPS, MAX_REPS = 3, 9
SPIKE, RETRIES = 1.5, 2
# 2: timed with the weights out of the CPU's caches (COLD_BYTES); version 1's warm times are not reused.
# 3: the row kernel ("gemv") reads the weight in panels and is timed up to 16 rows.
CACHE_VERSION = 3
# The version of compare_fp32's rule, in the key of the --dtype auto decisions it caches: a decision taken
# by an older rule is not reused (2: split-fp32 layers count as bf16 storage; 3: the row kernel's paths, gemv
# on the bf16 weight, count as bf16 storage). The timings stay valid.
AUTO_RULE = 3
# How long an engine waits for another on this machine to finish timing its kernels (cache_lock).
CACHE_LOCK_WAIT_S = 600.0

# (path, rows, fn) -> seconds of one call of fn; injectable so tests can fake the clock.
Timer = Callable[[str, int, Callable[[], object]], float]
# Read before every timed call on the real clock, so that the weight comes from memory as in a model's
# step, where each layer's weight was pushed out of the caches by the rest of the model's since its last
# use. Timed warm, a weight that fits in the last-level cache looked up to 3x faster than it runs in the
# model: 896x896 and 1152x896 in float32 at 0.07-0.11 ms a row against 0.24-0.32 ms in a decode step
# (AMD EPYC, 2 threads, AVX2 emulation, 2026-12-05), which made the tuner keep float32 copies that lose.
COLD_BYTES = 64 << 20


def wall_clock(path: str, rows: int, fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass(frozen=True)
class KernelPolicy:
    """How the loader picks kernels: ``mode`` is EngineConfig.linear_kernel; ``allow_split`` None means
    allowed on CPU when the linear weights take at most ``SPLIT_RAM_FRACTION`` of RAM; ``allow_fp32_weights``
    (the bf16 layers' "fp32" and "fp32-packed" paths, a float32 copy of the weight) None means allowed when
    the linear weights in float32 take at most that share of RAM; ``fp32_compute`` (whether bf16 layers
    time the ``FP32_COMPUTE_PATHS`` at all) None means on a CPU without native bf16 (``native_bf16``: with
    it they lost at every shape and m measured, and timing them made tuning 4x longer); ``cache_path``
    None means $SPLITSERVE_KERNEL_CACHE, else ~/.cache/splitserve/linear_kernels.json ("" caches nothing)."""

    mode: str = "auto"
    allow_split: bool | None = None
    lm_head_rows: int = 64
    cache_path: str | None = None
    allow_fp32_weights: bool | None = None
    fp32_compute: bool | None = None

    def __post_init__(self) -> None:
        check_choice(self, "mode", LINEAR_KERNELS, label="linear_kernel")

    def resolved_cache_path(self) -> Path | None:
        path = self.cache_path
        if path is None:
            path = os.environ.get("SPLITSERVE_KERNEL_CACHE", str(Path.home() / ".cache/splitserve/linear_kernels.json"))
        return Path(path) if path else None


@dataclass(frozen=True)
class ShapeKey:
    out_features: int
    in_features: int
    dtype: str
    bias: bool

    def __str__(self) -> str:
        return f"{self.out_features}x{self.in_features} {self.dtype}{' +bias' if self.bias else ''}"


@dataclass(frozen=True)
class Choice:
    path: str  # one of transformer.LINEAR_PATHS
    split_rows: int = 0  # a path of SPLITS: inputs of at most this many rows run its first kernel
    source: str = "measured"  # measured | cached | forced | untimed
    times_ms: dict[str, dict[int, float]] | None = None  # path -> rows -> best ms


def machine_key(threads: int, machine: dict | None = None) -> str:
    """What a timing depends on besides the shape: CPU model, its ISA flags, torch, threads, and the panel
    kernel's build (its source and flags: a changed kernel is timed again, not judged by its old times)."""
    m = describe_machine(probe_torch=False) if machine is None else machine
    flags = ",".join(sorted(name for name, on in m["isa"].items() if on))
    digest = hashlib.blake2b(flags.encode(), digest_size=4).hexdigest()
    gemv = cpu_gemv.EXTENSION.code_key()[:8]
    return f"{m['cpu_model']} [isa {digest}] torch {torch.__version__} threads {threads} gemv {gemv}"


def candidates(weight: torch.Tensor, fp32_weights: bool, fp32_compute: bool = True) -> tuple[str, ...]:
    """The kernels timed for this weight (the ``SPLITS`` are scored from their two kernels' times): "plain";
    "packed" where oneDNN runs the dtype; "gemv" (timed up to ``cpu_gemv.MAX_ROWS`` rows only) where the
    panel kernel is built and runs the dtype; the ``FP32_COMPUTE_PATHS`` of a bf16 or fp16 weight with
    ``fp32_compute``, the float32 copies among them with ``fp32_weights`` too."""
    paths = ["plain"]
    if onednn_runs(weight.dtype, weight.device):
        paths.append("packed")
    if cpu_gemv.available(weight):
        paths.append("gemv")
    if fp32_compute and weight.dtype != torch.float32 and weight.device.type == "cpu":
        paths.append("upcast")
        if fp32_weights:
            paths.append("fp32")
            if onednn_runs(torch.float32, weight.device):
                paths.append("fp32-packed")
    return tuple(paths)


def kernel_fn(path: str, weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A call of ``path``'s kernel on an input in the weight's dtype, as ``Linear.forward`` runs it (any
    packing or float32 copy made here, once)."""
    linear_pointwise = torch.ops.mkldnn._linear_pointwise
    if path == "plain":
        return lambda x: F.linear(x, weight, bias)
    if path == "packed":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        return lambda x: linear_pointwise(x, packed, bias, "none", [], "")
    b32 = None if bias is None else bias.float()
    if path == "gemv":
        panels = cpu_gemv.pack(weight)
        return lambda x: cpu_gemv.gemv(x, panels, b32, weight.shape[0])
    if path == "upcast":
        return lambda x: F.linear(x.float(), weight.float(), b32).to(x.dtype)
    w32 = weight.float()
    if path == "fp32":
        return lambda x: F.linear(x.float(), w32, b32).to(x.dtype)
    packed32 = torch.ops.mkldnn._reorder_linear_weight(w32)  # fp32-packed
    return lambda x: linear_pointwise(x.float(), packed32, b32, "none", [], "").to(x.dtype)


def timed_rows(path: str, rows: tuple[int, ...]) -> tuple[int, ...]:
    """The row counts of ``rows`` that ``path`` is timed at: "gemv" only up to ``cpu_gemv.MAX_ROWS``."""
    return tuple(m for m in rows if m <= cpu_gemv.MAX_ROWS) if path == "gemv" else rows


def cache_evictor(nbytes: int = COLD_BYTES) -> Callable[[], object]:
    """A call that reads ``nbytes`` of fresh memory, pushing what was cached out of the CPU's caches."""
    scratch = torch.ones(max(1, nbytes // 4))
    return scratch.sum


def measure(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: tuple[int, ...],
    timer: Timer = wall_clock,
    paths: tuple[str, ...] | None = None,
    evict: Callable[[], object] | None = None,
) -> dict[str, dict[int, float]]:
    """Best ms per candidate path (default: ``candidates(weight, False)``) and row count, the candidates
    interleaved so that noise from other processes falls on all of them alike; ``evict`` runs before every
    timed call (default: on the real clock and a CPU weight, ``cache_evictor()``)."""
    if weight.shape[0] * weight.shape[1] > TIMED_MAX_WEIGHTS:
        keep = max(1, TIMED_MAX_WEIGHTS // weight.shape[1])
        weight, bias = weight[:keep], None if bias is None else bias[:keep]
    weight = weight.detach()
    kernels = {path: kernel_fn(path, weight, bias) for path in paths or candidates(weight, False)}
    times: dict[str, dict[int, float]] = {path: {} for path in kernels}
    if evict is None and timer is wall_clock and weight.device.type == "cpu":
        evict = cache_evictor()

    def timed(path: str, m: int, fn: Callable[[], object]) -> float:
        if evict is not None:
            evict()  # the weight leaves the caches
        return timer(path, m, fn)

    def time_rows(m: int, paths: list[str], warm_up: bool) -> None:
        x = torch.randn(m, weight.shape[1], dtype=weight.dtype, device=weight.device)
        calls = {path: (lambda k=kernels[path]: k(x)) for path in paths if m in timed_rows(path, (m,))}
        first = {path: timed(path, m, fn) for path, fn in calls.items()} if warm_up else {}
        longest = max(first.values(), default=0.0) or min(times[p][m] for p in paths) / 1e3
        reps = int(min(MAX_REPS, max(MIN_REPS, REP_BUDGET_S / max(longest, 1e-9))))
        for _ in range(reps):
            for path, fn in calls.items():
                ms = timed(path, m, fn) * 1e3
                times[path][m] = min(times[path].get(m, float("inf")), ms)

    with torch.inference_mode():
        for m in rows:
            time_rows(m, list(kernels), warm_up=True)
        # More rows never cost a kernel less time, so a row count slower than the next one by SPIKE was
        # hit by another process: timed again, up to RETRIES times.
        for _ in range(RETRIES):
            spikes = [
                (m, path)
                for path, t in times.items()
                for m, bigger in zip(timed_rows(path, rows), timed_rows(path, rows)[1:])
                if t[m] > SPIKE * t[bigger]
            ]
            for m, path in spikes:
                time_rows(m, [path], warm_up=False)
    return times


def is_steady(times: dict[str, dict[int, float]]) -> bool:
    """No row count still timed ``SPIKE`` times slower than the next larger one (see ``measure``)."""
    return not any(t[m] > SPIKE * t[bigger] for t in times.values() for m, bigger in zip(sorted(t), sorted(t)[1:]))


def score(times: dict[str, dict[int, float]], rows: tuple[int, ...], path_at: Callable[[int], str]) -> float:
    """Mean slowdown against the best candidate at each m, weighted by ``ROW_WEIGHTS`` (1.0: best everywhere)."""
    total = sum(ROW_WEIGHTS.get(m, 1.0) for m in rows)
    best = {m: min(t[m] for t in times.values() if m in t) for m in rows}
    return sum(ROW_WEIGHTS.get(m, 1.0) * times[path_at(m)][m] / best[m] for m in rows) / total


def decide(times: dict[str, dict[int, float]], allow_split: bool) -> tuple[str, int]:
    """(path, split_rows) from measured times: the best-scoring single path, or one of ``SPLITS`` (its first
    kernel up to a timed row count, its second above it) where that scores ``SPLIT_GAIN`` better than every
    single path. The splits keep two layouts of the weight ("gemv": the panels and the plain weight) and
    need ``allow_split``. The
    fp32-packed splits are scored only when fp32-packed was timed (a bf16 weight with float32 copies allowed)."""
    rows = tuple(sorted(times["plain"]))
    singles = {
        path: score(times, rows, lambda m, p=path: p)
        for path in times
        if path != "gemv" and set(rows) <= times[path].keys()  # the row kernel is only ever a split's first
    }
    path = min(singles, key=singles.get)
    # A threshold has timed rows on each side of it; with one timed row count (an LM head timed for
    # max_num_seqs below the second grid row) only "gemv" splits at it (their paths above it untimed), and,
    # among those that score alike, the one whose path above is the best single path.
    thresholds = rows[:-1] if len(rows) > 1 else rows
    splits = {
        (kind, t): score(times, rows, lambda m, t=t, below=below, above=above: below if m <= t else above)
        for kind, (below, above) in SPLITS.items()
        if {below, above} <= times.keys() and allow_split
        if len(rows) > 1 or below == "gemv"
        for t in thresholds
        if set(m for m in rows if m <= t) <= times[below].keys()
    }
    if splits:
        best = min(splits, key=lambda k: (splits[k], SPLITS[k[0]][1] != path))
        if splits[best] < singles[path] * (1 - SPLIT_GAIN):
            return best
    return path, 0


def split_times(choice: Choice) -> dict[int, float] | None:
    """A split choice's time at each timed row count (its first kernel's up to its threshold, the other's above)."""
    if choice.path not in SPLITS or not choice.times_ms:
        return None
    below, above = SPLITS[choice.path]
    first, other = choice.times_ms[below], choice.times_ms[above]
    return {m: first[m] if m <= choice.split_rows else other[m] for m in choice.times_ms["plain"]}


class KernelCache:
    """The measured times in a JSON file: {"version", "entries": {"<machine> | <shape>": {"times_ms": ...}},
    "decisions": {"<machine> | dtype auto rule <AUTO_RULE> | <model>": Fp32Comparison's fields}}.
    Written whole through a temporary file and a rename, so a reader never sees half a file; two engines
    saving at once can lose one's new entries, which are then timed again at its next load."""

    def __init__(self, path: Path | None) -> None:
        self.path, self.entries, self.decisions = path, {}, {}
        if path is not None and path.exists():
            try:
                raw = json.loads(path.read_text())
                if raw.get("version") == CACHE_VERSION:
                    self.entries = raw["entries"]
                    self.decisions = raw.get("decisions", {})
            except (OSError, ValueError, KeyError, AttributeError) as e:
                logger.warning("linear kernel cache %s unreadable (%s): timing again", path, e)

    def get(
        self, key: str, rows: tuple[int, ...], paths: tuple[str, ...] = ("plain", "packed")
    ) -> dict[str, dict[int, float]] | None:
        """The saved times of ``paths`` at ``rows``; None unless every one of ``paths`` was saved at them
        (an entry from before a path was timed is timed again)."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        saved = entry["times_ms"]
        times = {path: {int(m): ms for m, ms in saved[path].items()} for path in paths if path in saved}
        complete = times.keys() == set(paths)
        return times if complete and all(set(timed_rows(p, rows)) <= t.keys() for p, t in times.items()) else None

    def put(self, key: str, times: dict[str, dict[int, float]]) -> None:
        self.entries[key] = {"times_ms": {p: {str(m): round(ms, 4) for m, ms in t.items()} for p, t in times.items()}}

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            saved = {"version": CACHE_VERSION, "entries": self.entries}
            if self.decisions:
                saved["decisions"] = self.decisions
            json.dump(saved, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


def linear_weights(model: CausalLM) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Module name -> (weight, bias) of every linear layer, "lm_head" being the embedding when tied."""
    found = {name: (m.weight, m.bias) for name, m in model.named_modules() if isinstance(m, Linear)}
    found.setdefault("lm_head", (model.embed_tokens.weight, None))
    return found


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def split_allowed(policy: KernelPolicy, model: CausalLM) -> bool:
    if policy.allow_split is not None:
        return policy.allow_split
    weight_bytes = sum(w.numel() * w.element_size() for w, _ in linear_weights(model).values())
    return weight_bytes <= SPLIT_RAM_FRACTION * ram_bytes()


def fp32_allowed(policy: KernelPolicy, model: CausalLM) -> bool:
    """Whether bf16 layers may keep a float32 copy ("fp32", "fp32-packed"): ``allow_fp32_weights``, or when
    the model's linear weights in float32 take at most ``SPLIT_RAM_FRACTION`` of RAM."""
    if policy.allow_fp32_weights is not None:
        return policy.allow_fp32_weights
    return 4 * sum(w.numel() for w, _ in linear_weights(model).values()) <= SPLIT_RAM_FRACTION * ram_bytes()


def forced_path(mode: str, weight: torch.Tensor) -> str:
    """What a forced ``linear_kernel`` runs on this weight: a float32 weight takes "upcast" and "fp32" as
    "plain", "fp32-packed" as "packed" and "gemv-fp32" as "gemv-packed"; a path oneDNN cannot run here falls
    back to "plain"; a "gemv" path where the row kernel is not built (or not for this dtype) to its
    counterpart with "plain" below ("plain", "split", "split-fp32")."""
    if mode in GEMV_PATHS:
        if weight.dtype == torch.float32 and mode == "gemv-fp32":
            mode = "gemv-packed"
        if not cpu_gemv.available(weight):
            return forced_path({"gemv": "plain", "gemv-packed": "split", "gemv-fp32": SPLIT_FP32}[mode], weight)
        above = forced_path(SPLITS[mode][1], weight)
        return mode if above == SPLITS[mode][1] else "gemv"
    if weight.dtype == torch.float32 and mode in FP32_COMPUTE_PATHS:
        mode = "packed" if mode == "fp32-packed" else "plain"
    if mode == SPLIT_FP32:
        if weight.dtype == torch.float32:
            mode = "split"
        else:
            return mode if onednn_runs(torch.float32, weight.device) else "plain"
    if mode in ("packed", "split"):
        return mode if can_pack(weight) else "plain"
    if mode == "fp32-packed":
        return mode if onednn_runs(torch.float32, weight.device) else "fp32"
    return mode


def choose_kernels(
    model: CausalLM, policy: KernelPolicy, timer: Timer = wall_clock, machine: str | None = None
) -> dict[ShapeKey, Choice]:
    """One choice per distinct shape of the model's linear layers, timing what the cache lacks."""
    weights = linear_weights(model)
    device = next(iter(weights.values()))[0].device
    forced = "plain" if device.type != "cpu" else policy.mode
    allow_split = forced == "auto" and split_allowed(policy, model)
    fp32_compute = forced == "auto" and (
        policy.fp32_compute if policy.fp32_compute is not None else not native_bf16(cpu_isa())
    )
    allow_fp32 = fp32_compute and fp32_allowed(policy, model)
    cache = KernelCache(policy.resolved_cache_path()) if forced == "auto" else None
    machine = machine or machine_key(torch.get_num_threads())
    choices: dict[ShapeKey, Choice] = {}
    start, measured = time.perf_counter(), 0
    for name, (weight, bias) in weights.items():
        key = shape_key(weight, bias is not None)
        if key in choices:
            continue
        if forced != "auto":
            path = forced_path(forced, weight)
            rows = FORCED_GEMV_ROWS if path in GEMV_PATHS else FORCED_SPLIT_ROWS if path in SPLITS else 0
            choices[key] = Choice(path, rows, "forced")
            continue
        paths = candidates(weight, allow_fp32, fp32_compute)
        if weight.numel() < UNTIMED_BELOW or len(paths) == 1:
            choices[key] = Choice("plain", 0, "untimed")  # the only candidate, or oneDNN's fixed cost dominates
            continue
        rows = tuple(m for m in ROW_GRID if name != "lm_head" or m <= max(policy.lm_head_rows, ROW_GRID[0]))
        times, source = cache.get(f"{machine} | {key}", rows, paths), "cached"
        if times is None:
            times, measured = measure(weight, bias, rows, timer, paths), measured + 1
            # Timings still spiky after the retries were taken while other processes held the cores:
            # used for this load only, so the next load times again rather than keeping a wrong choice.
            source = "measured" if is_steady(times) else "measured while the CPU was busy, not cached"
            if is_steady(times):
                cache.put(f"{machine} | {key}", times)
        times = {p: {m: t[m] for m in timed_rows(p, rows)} for p, t in times.items()}
        choices[key] = Choice(*decide(times, allow_split), source, times)
    if measured and cache.entries:
        cache.save()
    seconds = time.perf_counter() - start
    for key, choice in choices.items():
        logger.info("linear %s: %s", key, describe(choice))
    if forced == "auto":
        split = "allowed" if allow_split else "not allowed"
        fp32 = "float32 copies allowed" if allow_fp32 else "no float32 copies"
        fp32 = f"float32-compute bf16 paths timed, {fp32}" if fp32_compute else "float32-compute bf16 paths not timed"
        summary = "linear kernels: %d shapes, %d timed, %.2f s (%s; split %s; %s)"
        logger.info(summary, len(choices), measured, seconds, machine, split, fp32)
    return choices


def describe(choice: Choice) -> str:
    """``packed (measured; plain 1:0.07 4:0.18 ms, packed 1:0.06 4:0.06 ms)`` for one log line."""
    path = f"{choice.path} at {choice.split_rows} rows" if choice.path in SPLIT_ABOVE else choice.path
    if not choice.times_ms:
        return f"{path} ({choice.source})"
    per_path = ", ".join(
        f"{p} " + " ".join(f"{m}:{ms:.3g}" for m, ms in t.items()) + " ms" for p, t in choice.times_ms.items()
    )
    return f"{path} ({choice.source}; {per_path})"


def apply_kernels(model: CausalLM, policy: KernelPolicy, timer: Timer = wall_clock) -> dict[ShapeKey, Choice]:
    """Choose (``choose_kernels``) and switch every linear layer to its shape's path."""
    choices = choose_kernels(model, policy, timer)

    def choose(name: str, weight: torch.Tensor, has_bias: bool) -> tuple[str, int]:
        key = shape_key(weight, has_bias)
        return choices[key].path, choices[key].split_rows

    model.pack_weights(choose)
    return choices


def shape_key(weight: torch.Tensor, has_bias: bool) -> ShapeKey:
    return ShapeKey(weight.shape[0], weight.shape[1], str(weight.dtype).removeprefix("torch."), has_bias)


@dataclass(frozen=True)
class Fp32Comparison:
    """A bf16 model's linear layers timed both ways: ``bf16_ms`` the weighted time (``ROW_WEIGHTS`` over
    the rows timed, each shape times its number of layers) of the fastest path that keeps the weights in
    bf16 (``BF16_STORAGE_PATHS``) at each row count, ``fp32_ms`` that of the fastest on float32 weights
    (``FP32_WEIGHT_PATHS``); ``shapes`` the shapes timed (0: none large enough, nothing to compare)."""

    bf16_ms: float
    fp32_ms: float
    shapes: int
    source: str = "measured"  # measured | cached

    @property
    def fp32_faster(self) -> bool:
        return self.shapes > 0 and self.fp32_ms < self.bf16_ms


def compare_fp32(model: CausalLM, policy: KernelPolicy, timer: Timer = wall_clock) -> Fp32Comparison:
    """Time every path of the bf16 model's shapes, float32 copies included (through the cache, as
    ``choose_kernels``), and sum them both ways (``Fp32Comparison``): the measurement behind ``--dtype
    auto``'s float32 on a CPU without native bf16 (``splitserve.engine.model.loader.build_model``)."""
    choices = choose_kernels(model, replace(policy, mode="auto", allow_fp32_weights=True, fp32_compute=True), timer)
    counts = Counter(shape_key(w, b is not None) for w, b in linear_weights(model).values())
    split_fp32_ok = fp32_allowed(policy, model) and split_allowed(policy, model)
    bf16 = fp32 = 0.0
    shapes = 0
    for key, choice in choices.items():
        times = choice.times_ms
        if not times or "fp32" not in times:
            continue
        shapes += 1
        # A bf16 model keeps split-fp32 (and gemv-fp32) layers where the tuner chose them (bf16 storage, float32
        # above the split), if the engine's own policy lets it keep float32 copies: the comparison itself times
        # them regardless.
        shape_bf16, shape_fp32 = weighted_both_ways(choice, counts[key], split_fp32_ok)
        bf16, fp32 = bf16 + shape_bf16, fp32 + shape_fp32
    return Fp32Comparison(bf16, fp32, shapes)


def weighted_both_ways(choice: Choice, layers: int, split_fp32_ok: bool = True) -> tuple[float, float]:
    """One timed shape's (bf16-storage, float32-weight) ms, each the fastest path of its kind at every row
    count weighted by ``ROW_WEIGHTS`` and the shape's number of layers; a ``split-fp32`` or ``gemv-fp32``
    choice counts on the bf16 side where ``split_fp32_ok``. The float32 side is timed without the row
    kernel: on a float32 copy it would read twice the bytes the kernel reads on the bf16 weight."""
    times = choice.times_ms
    split = split_times(choice) if choice.path in (SPLIT_FP32, "gemv-fp32") and split_fp32_ok else None
    bf16 = fp32 = 0.0
    for m in times["plain"]:
        weight = ROW_WEIGHTS.get(m, 1.0) * layers
        bf16_best = min(t[m] for p, t in times.items() if p in BF16_STORAGE_PATHS and m in t)
        bf16 += weight * (bf16_best if split is None else min(bf16_best, split[m]))
        fp32 += weight * min(t[m] for p, t in times.items() if p in FP32_WEIGHT_PATHS)
    return bf16, fp32


def summarize(choices: dict[ShapeKey, Choice]) -> str:
    """Every shape's chosen path on one line, for ``splitserve status``: ``1152x896 bfloat16 +bias packed, ...``."""

    def one(choice: Choice) -> str:
        return f"{choice.path} at {choice.split_rows} rows" if choice.path in SPLIT_ABOVE else choice.path

    return ", ".join(f"{key} {one(choice)}" for key, choice in choices.items())


@contextmanager
def cache_lock(path: Path | None) -> Iterator[None]:
    """An exclusive lock on ``<cache>.lock`` (none without a cache): engines loading at once on this machine
    take ``--dtype auto``'s decision one after the other, so the second reads the first's."""
    if path is None:
        yield
        return
    with file_lock(path.with_name(path.name + ".lock"), CACHE_LOCK_WAIT_S, "the linear-kernel cache"):
        yield


def auto_dtype_comparison(model: CausalLM, policy: KernelPolicy, timer: Timer = wall_clock) -> Fp32Comparison:
    """``compare_fp32`` once per machine and model: the result is kept in the kernel cache (``decisions``)
    and read back by every later load, under ``cache_lock``, so that the workers and tensor-parallel ranks
    of one machine, loading at once, all compute in the same dtype (a prefill and a decode worker in
    different dtypes could not exchange KV). Kept even when measured while the CPU was busy, for that
    reason: delete the cache file to decide again."""
    path = policy.resolved_cache_path()
    shapes = Counter(str(shape_key(w, b is not None)) for w, b in linear_weights(model).values())
    digest = hashlib.blake2b(json.dumps(sorted(shapes.items())).encode(), digest_size=6).hexdigest()
    key = f"{machine_key(torch.get_num_threads())} | dtype auto rule {AUTO_RULE} | {digest}"
    with cache_lock(path):
        saved = KernelCache(path).decisions.get(key)
        if saved is not None:
            return Fp32Comparison(saved["bf16_ms"], saved["fp32_ms"], saved["shapes"], "cached")
        compared = compare_fp32(model, policy, timer)
        cache = KernelCache(path)  # compare_fp32 may have saved new times since
        if cache.path is not None:
            cache.decisions[key] = {"bf16_ms": compared.bf16_ms, "fp32_ms": compared.fp32_ms, "shapes": compared.shapes}
            cache.save()
        return compared
