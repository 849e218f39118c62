"""The CPU paged-decode backend: a C++ kernel that reads K/V in place from the cache through the block tables.

``paged_decode_torch`` gathers every row's ``max_blocks`` blocks into one padded tensor before attending;
this kernel (``cpu_paged_decode.cpp``) walks each row's own blocks instead, one work item per (row, KV head)
on torch's intra-op threads, the KV head's query group at once, with an online softmax in float32. It meets
``PagedDecodeFn`` (``paged_decode.py``) for float32 and bfloat16.

It is built on first use by ``splitserve.engine.native`` (``make setup`` builds it ahead: ``python -m
splitserve.engine.attention.cpu_paged_decode``), one build per machine. When it cannot be built or loaded (no
compiler, no ninja, ``SPLITSERVE_CPU_PAGED_DECODE=0``) the reason is logged once and the backend reports itself
unavailable, so ``select_backend`` falls back to the reference and the dynamic decode path keeps its gather.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch

from splitserve.engine.native import Extension, cpu_signature

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_decode.cpp")
DTYPES = (torch.float32, torch.bfloat16)
EXTENSION = Extension(
    "cpu_paged_decode", SOURCE, "SPLITSERVE_CPU_PAGED_DECODE", "decode attention falls back to the torch reference", log
)
__all__ = ["cpu_signature", "load", "failure", "reset", "paged_decode_cpu", "tiled", "EXTENSION"]


def load() -> ModuleType | None:
    """The compiled extension, built on first call; None (the reason logged once) when it cannot be."""
    return EXTENSION.load()


def failure() -> str | None:
    """Why the extension is unavailable (None when it loaded or has not been tried)."""
    return EXTENSION.failure()


def reset() -> None:
    """Forget the loaded module and any failure, so the next ``load`` tries again (tests)."""
    EXTENSION.reset()


def is_available(device: torch.device, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype in DTYPES and load() is not None


def paged_decode_cpu(
    q: torch.Tensor,
    cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """``PagedDecodeFn`` on the CPU, reading the cache in place (see the module docstring)."""
    module = load()
    assert module is not None, "cpu paged decode: the extension is unavailable (check is_available first)"
    op = getattr(torch.ops, module.__name__).paged_decode
    lanes, poly = sdpa_form()
    return op(q, cache_layer, block_tables.long(), context_lens.long(), float(scale), window or 0, lanes, poly)


# How torch's flash attention (SDPA on the CPU) sums and exponentiates a bf16 softmax, by the kernels it picked at
# start-up ($ATEN_CPU_CAPABILITY): the lanes of its float vectors and whether its vectorized exp is the polynomial
# ``fexp_u20`` (AVX2, AVX-512) or std::exp (its default build, and where this module does not know the kernels).
SDPA_FORMS = {"AVX512": (16, True), "AVX2": (8, True), "DEFAULT": (8, False)}


@functools.cache  # torch picks its kernels once, at start-up: read once, not at every layer
def sdpa_form() -> tuple[int, bool]:
    """(lanes, poly) of torch's SDPA softmax here: what the bf16 decode follows (see ``cpu_paged_decode.cpp``)."""
    return SDPA_FORMS.get(torch.backends.cpu.get_cpu_capability(), (8, False))


def tiled() -> bool:
    """Whether the loaded kernel has its AVX-512 path (built on a CPU with AVX-512; False when unavailable)."""
    module = load()
    return module is not None and bool(module.tiled())


# Registered by paged_decode.py's registry on first selection (OPTIONAL_BACKEND_MODULES), for float32 and bfloat16.
# bfloat16 follows SDPA's softmax step for step (``sdpa_form``; the .cpp's bf16 section), so greedy bf16 output keeps
# transformers' within the tie rule as the gather and SDPA did (tests/engine/test_parity_paths.py), without the
# gather (docs/performance.md, "bf16 decode attention in place").
REGISTERED_DTYPES = (torch.float32, torch.bfloat16)
BACKENDS = (("cpu", paged_decode_cpu, lambda device: is_available(device, torch.float32), REGISTERED_DTYPES),)


if __name__ == "__main__":  # `make setup`: build ahead of the first decode (a failure is logged, not fatal)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("cpu paged decode:", "built" if load() is not None else f"unavailable ({failure()})")
