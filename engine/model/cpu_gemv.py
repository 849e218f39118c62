"""The panel linear kernel for decode-sized inputs on the CPU (``cpu_gemv.cpp``).

At one to a few rows a linear layer is bound by reading its weight from memory, and at 16 rows by that and
the arithmetic together. ``pack`` lays the weight out once in panels of 16 output rows (8 on AVX2), k-major,
in its own dtype (float32 or bfloat16, widened exactly to float32 in registers); ``gemv`` reads each weight
vector once per pass of up to 16 rows and multiplies it by every row, summing in float32 over k in order (a
row's outputs do not depend on the rows beside it); a bfloat16 layer's output is rounded back to bfloat16
once, as a bf16 GEMM rounds its float32 sums. The linear tuner (``linear_tuner``) times it against torch's
kernels at decode rows and uses it only where it wins ("gemv" below a row threshold, another path above it:
``transformer.Linear``).

Built by ``splitserve.engine.native`` on first use (``make setup`` builds it ahead: ``python -m
splitserve.engine.model.cpu_gemv``). When it cannot be built (no compiler, ``SPLITSERVE_CPU_GEMV=0``) the
reason is logged once and the tuner does not offer it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from splitserve.engine.native import Extension

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_gemv.cpp")
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
# The most rows "gemv" is offered for: past them a blocked GEMM reads the weight once for every row block,
# where this kernel reads it again every max_rows() rows (16 on AVX-512, 8 on AVX2).
MAX_ROWS = 16
EXTENSION = Extension("cpu_gemv", SOURCE, "SPLITSERVE_CPU_GEMV", "linear layers keep torch's kernels", log)


def available(weight: torch.Tensor) -> bool:
    """Whether ``gemv`` runs this weight here: a CPU float32 or bfloat16 ``[out, in]`` weight, and the kernel built."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in WEIGHT_DTYPES
        and weight.dim() == 2
        and EXTENSION.load() is not None
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The ``[out, in]`` weight in ``gemv``'s panels (the same dtype, about the same bytes: the last panel is
    padded to the panel width)."""
    module = EXTENSION.load()
    assert module is not None, "cpu gemv: the extension is unavailable (check available() first)"
    return module.pack(weight.detach().contiguous())


def gemv(x: torch.Tensor, panels: torch.Tensor, bias32: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x W^T + b`` for ``x`` of shape ``[..., in]`` in float32 or bfloat16 (the weight's dtype, in the
    engine), ``panels`` the weight from ``pack`` and ``bias32`` the bias in float32 (or None). Sums in float32;
    the output is in ``x``'s dtype, a bfloat16 one rounded once. The extension takes x as it is (any strides,
    widened in the kernel) and rounds the output there: one call, no conversions dispatched around it."""
    module = EXTENSION.load()
    assert module is not None, "cpu gemv: the extension is unavailable (check available() first)"
    return module.gemv(x, panels, bias32, out_features)


def describe() -> str:
    """``"avx-512 (16 floats, 16 rows a pass)"`` or why it is unavailable, for logs and benchmark headers."""
    module = EXTENSION.load()
    if module is None:
        return f"unavailable ({EXTENSION.failure()})"
    width = module.vector_width()
    isa = {16: "avx-512", 8: "avx2"}.get(width, "portable loops")
    return f"{isa} ({width} floats, {module.max_rows()} rows a pass)"


if __name__ == "__main__":  # `make setup`: build ahead of the first load (a failure is logged, not fatal)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("cpu gemv:", describe())
