"""RMSNorm of bfloat16 rows on the CPU in one call, bit for bit transformers' chain (``cpu_norm.cpp``).

A bf16 model normalises each layer's input as transformers does: ``weight * rms_norm(x.float()).to(bf16)``
(``reference``), which torch runs as a dozen operators; at a decode step's one row their dispatch is most of the
time (about 16 µs a call here, 49 calls a step for qwen2.5-0.5b). ``rms_norm`` does the same float32 operations in
the same order in one call (about 3 µs): the squares' sum in the order of torch's own vectorized sum, which
depends on the width of torch's float vectors on this CPU (``torch_width``).

Before a model uses it, ``usable`` compares it with ``reference`` on random rows of the model's width at several
scales, once per width and eps; where any bit differs (another torch, another CPU family) it logs why and the
model keeps torch's operators. Float32 models keep ``F.rms_norm`` (one operator already).

Built by ``splitserve.engine.native`` on first use (``make setup`` builds it ahead: ``python -m
splitserve.engine.model.cpu_norm``). When it cannot be built (no compiler, ``SPLITSERVE_CPU_NORM=0``) the reason
is logged once and the model keeps torch's operators.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from splitserve.engine.native import Extension

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_norm.cpp")
EXTENSION = Extension("cpu_norm", SOURCE, "SPLITSERVE_CPU_NORM", "RMSNorm keeps torch's operators", log)
# torch's float vector width (lanes) under each of its CPU kernel builds (torch.backends.cpu.get_cpu_capability()).
TORCH_WIDTHS = {"AVX512": 16, "AVX2": 8, "DEFAULT": 8}
# The rows ``usable`` checks: counts and scales (bf16 activations range from small to a few hundred).
CHECK_ROWS = ((1, 1.0), (7, 0.01), (7, 1.0), (7, 30.0), (7, 300.0))

_checked: dict[tuple[int, float, int], bool] = {}
_lock = threading.Lock()


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of a bf16 (or fp16) x: normalised in float32, rounded back, then scaled in x's dtype."""
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


@functools.cache  # torch picks its kernels once, at start-up ($ATEN_CPU_CAPABILITY): read once, not at every norm
def torch_width() -> int | None:
    """The lanes of torch's float vectors on this CPU (None where this module does not know them)."""
    return TORCH_WIDTHS.get(torch.backends.cpu.get_cpu_capability())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``reference(x, weight, eps)`` for a bf16 ``[rows, n]`` x with contiguous rows and a bf16 ``[n]`` weight, in
    one call. Only where ``usable`` said so."""
    module = EXTENSION.load()
    assert module is not None, "cpu norm: the extension is unavailable (check usable() first)"
    return getattr(torch.ops, module.__name__).rms_norm_bf16(x, weight, float(eps), torch_width())


def usable(weight: torch.Tensor, eps: float) -> bool:
    """Whether ``rms_norm`` runs this norm here, equal to ``reference`` bit for bit: a CPU bf16 weight, torch's
    vector width known, the extension built, and the check on random rows of its width passed (once per width and
    eps; a failure is logged)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 1:
        return False
    width = torch_width()
    if width is None or EXTENSION.load() is None:
        return False
    key = (weight.numel(), float(eps), width)
    with _lock:
        if key not in _checked:
            _checked[key] = _check(weight.numel(), float(eps))
        return _checked[key]


def _check(n: int, eps: float) -> bool:
    gen = torch.Generator().manual_seed(n)
    weight = torch.randn(n, generator=gen).to(torch.bfloat16)
    for rows, scale in CHECK_ROWS:
        x = (torch.randn(rows, n, generator=gen) * scale).to(torch.bfloat16)
        got, want = rms_norm(x, weight, eps), reference(x, weight, eps)
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            differ = int((got.view(torch.int16) != want.view(torch.int16)).sum())
            log.warning(
                "cpu norm: %d of %d elements differ from torch's RMSNorm in rows of %d (torch's %s kernels, "
                "%d-lane sums): RMSNorm keeps torch's operators",
                differ,
                x.numel(),
                n,
                torch.backends.cpu.get_cpu_capability(),
                torch_width(),
            )
            return False
    return True


if __name__ == "__main__":  # `make setup`: build ahead of the first load (a failure is logged, not fatal)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = EXTENSION.load() is not None
    print("cpu norm:", "built" if built else f"unavailable ({EXTENSION.failure()})")
