"""The row-streaming linear kernel for decode-sized inputs on the CPU (``cpu_gemv.cpp``).

At one to a few rows a linear layer is bound by reading its weight from memory. ``gemv`` streams the weight
in its own ``[out, in]`` layout, float32 or bfloat16 (widened exactly to float32 in registers), and sums in
float32; a bfloat16 layer's output is rounded back to bfloat16 once, as a bf16 GEMM rounds its float32 sums.
The linear tuner (``linear_tuner``) times it against torch's kernels at decode rows and uses it only where
it wins ("gemv" below a row threshold, another path above it: ``transformer.Linear``).

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
# where this kernel reads it again every max_rows() rows.
MAX_ROWS = 4
EXTENSION = Extension("cpu_gemv", SOURCE, "SPLITSERVE_CPU_GEMV", "linear layers keep torch's kernels", log)


def available(weight: torch.Tensor) -> bool:
    """Whether ``gemv`` runs this weight here: a CPU float32 or bfloat16 ``[out, in]`` weight, and the kernel built."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in WEIGHT_DTYPES
        and weight.dim() == 2
        and EXTENSION.load() is not None
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias32: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` for ``x`` of shape ``[..., in]`` in the weight's dtype (float32 or bfloat16); ``bias32``
    is the bias in float32 (or None). Sums in float32; the output is in ``x``'s dtype."""
    module = EXTENSION.load()
    assert module is not None, "cpu gemv: the extension is unavailable (check available() first)"
    rows = x.reshape(-1, x.shape[-1])
    y = module.gemv(rows.float().contiguous(), weight, bias32)
    return y.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)


def describe() -> str:
    """``"avx-512 (16 floats, 4 rows a pass)"`` or why it is unavailable, for logs and benchmark headers."""
    module = EXTENSION.load()
    if module is None:
        return f"unavailable ({EXTENSION.failure()})"
    width = module.vector_width()
    isa = {16: "avx-512", 8: "avx2"}.get(width, "portable loops")
    return f"{isa} ({width} floats, {module.max_rows()} rows a pass)"


if __name__ == "__main__":  # `make setup`: build ahead of the first load (a failure is logged, not fatal)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("cpu gemv:", describe())
