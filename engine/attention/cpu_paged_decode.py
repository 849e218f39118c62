"""The CPU paged-decode backend: a C++ kernel that reads K/V in place from the cache through the block tables.

``paged_decode_torch`` gathers every row's ``max_blocks`` blocks into one padded tensor before attending;
this kernel (``cpu_paged_decode.cpp``) walks each row's own blocks instead, one work item per (row, KV head)
on torch's intra-op threads, the KV head's query group at once, with an online softmax in float32. It meets
``PagedDecodeFn`` (``paged_decode.py``) for float32 and bfloat16.

It is compiled with ``torch.utils.cpp_extension`` on first use (``make setup`` builds it ahead:
``python -m splitserve.engine.attention.cpu_paged_decode``) into ``~/.cache/splitserve/cpu_paged_decode/``
(``SPLITSERVE_EXTENSION_CACHE`` moves it), one build per machine: the code is built with ``-march=native``,
so the build key holds the CPU's model and flags, torch's version and the source's hash. When it cannot be
built or loaded (no compiler, no ninja, ``SPLITSERVE_CPU_PAGED_DECODE=0``) the reason is logged once and the
backend reports itself unavailable, so ``select_backend`` falls back to the reference and the dynamic decode
path keeps its gather. Processes building the same key at once take turns (``file_lock``, at most
``BUILD_WAIT_S``); a build killed midway leaves nothing that blocks the next.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

from splitserve.common.file_lock import file_lock

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_decode.cpp")
DTYPES = (torch.float32, torch.bfloat16)
# 512-bit vectors where the CPU has them (gcc's default under -march=native is 256): x86 only, the flag is not
# known elsewhere.
CFLAGS = ["-O3", "-march=native", "-fopenmp"] + (
    ["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else []
)
LDFLAGS = ["-fopenmp"]
# How long a load waits for another process's build of the same key (one takes about a minute on 2 cores);
# past it the load fails with the reason and decode attention keeps the reference.
BUILD_WAIT_S = float(os.environ.get("SPLITSERVE_EXTENSION_BUILD_WAIT_S", "600"))

_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None  # why the extension is unavailable, once a load has failed


def cache_root() -> Path:
    return Path(os.environ.get("SPLITSERVE_EXTENSION_CACHE", Path.home() / ".cache/splitserve")) / "cpu_paged_decode"


def cpu_signature() -> str:
    """The CPU's model name and flags (Linux: /proc/cpuinfo), else the platform's description."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags", "Features", "CPU part") and key not in fields:
            fields[key] = value.strip()
    return " | ".join(f"{k}: {v}" for k, v in sorted(fields.items())) or platform.machine()


def build_key() -> str:
    """What the build depends on: the source, the flags, torch, Python and the CPU."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS + LDFLAGS).encode(), torch.__version__.encode()):
        digest.update(part)
        digest.update(b"\0")
    digest.update(f"{sys.version_info[:2]} {cpu_signature()}".encode())
    return digest.hexdigest()[:16]


def _ninja_on_path() -> None:
    """torch's extension builder runs ``ninja`` from PATH; the pip package's binary is there only when the
    venv is activated, so add its folder when ninja is not found."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja  # the pip package (a project dependency)
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    _ninja_on_path()
    key = build_key()
    directory = cache_root() / key
    # torch's builder takes a lock that is a file's existence ("lock" in the build folder) and waits for it
    # with no deadline, so a build killed midway left every later load waiting forever. Builds here take
    # an flock first (released when its holder dies, waited on for at most BUILD_WAIT_S): whoever holds it
    # is the only splitserve build of this key, so a "lock" file found then was left by a build that died.
    with file_lock(directory / "splitserve-build.lock", BUILD_WAIT_S, "the cpu paged decode kernel's build"):
        baton = directory / "lock"
        if baton.exists():
            log.warning("removing %s, left by a build of the cpu paged decode kernel that did not finish", baton)
            baton.unlink(missing_ok=True)
        return cpp_extension.load(
            name=f"splitserve_cpu_paged_decode_{key}",
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            build_directory=str(directory),
            verbose=False,
        )


def load() -> ModuleType | None:
    """The compiled extension, built on first call; None (the reason logged once) when it cannot be."""
    global _module, _failure
    if _module is not None or _failure is not None:
        return _module
    with _lock:
        if _module is not None or _failure is not None:
            return _module
        if os.environ.get("SPLITSERVE_CPU_PAGED_DECODE", "1") == "0":
            _failure = "disabled by SPLITSERVE_CPU_PAGED_DECODE=0"
        else:
            try:
                _module = _build()
            except Exception as e:  # a missing compiler or ninja, a compile error, an unloadable library
                _failure = f"{type(e).__name__}: {e}".strip()
        if _failure is not None:
            log.warning(
                "cpu paged decode kernel unavailable (%s): decode attention falls back to the torch reference",
                _failure.splitlines()[0][:500],
            )
        else:
            log.info("cpu paged decode kernel loaded from %s", cache_root() / build_key())
    return _module


def failure() -> str | None:
    """Why the extension is unavailable (None when it loaded or has not been tried)."""
    return _failure


def reset() -> None:
    """Forget the loaded module and any failure, so the next ``load`` tries again (tests)."""
    global _module, _failure
    with _lock:
        _module, _failure = None, None


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
    return op(q, cache_layer, block_tables.long(), context_lens.long(), float(scale), window or 0)


def tiled() -> bool:
    """Whether the loaded kernel has its AVX-512 path (built on a CPU with AVX-512; False when unavailable)."""
    module = load()
    return module is not None and bool(module.tiled())


# Registered by paged_decode.py's registry on first selection (OPTIONAL_BACKEND_MODULES), for float32 only. The
# kernel runs bfloat16 too (``paged_decode_cpu``): its portable loops measured slower than the reference's SDPA
# there past short contexts, and its AVX-512 path faster than both the reference and the gather, but greedy bf16
# output through it drifted from transformers' past the tie rule (tests/engine/test_parity_paths.py), where the
# gather, cut to the span and summed by SDPA as transformers does, stays within it (docs/performance.md).
REGISTERED_DTYPES = (torch.float32,)
BACKENDS = (("cpu", paged_decode_cpu, lambda device: is_available(device, torch.float32), REGISTERED_DTYPES),)


if __name__ == "__main__":  # `make setup`: build ahead of the first decode (a failure is logged, not fatal)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("cpu paged decode:", "built" if load() is not None else f"unavailable ({failure()})")
