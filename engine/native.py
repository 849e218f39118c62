"""The engine's C++ kernels: each built with torch's extension builder on first use, cached per machine.

An ``Extension`` compiles one source file with ``torch.utils.cpp_extension`` into
``~/.cache/splitserve/<name>/<key>/`` (``SPLITSERVE_EXTENSION_CACHE`` moves it). The code is built with
``-march=native``, so the key holds the CPU's model and flags, torch's version, the flags and the source's
hash, and where the source and torch are; one build per machine and checkout. When ``$SPLITSERVE_CPU_ISA``
caps the ISA (``scripts/as_avx2.sh``) the build drops the instructions the cap takes away (``-mno-avx512f``,
...), so an emulated AVX2 run runs no AVX-512 code of ours either. When the source cannot be built or loaded
(no compiler, no ninja, its switch set to ``0``) the reason is logged once and ``load`` returns None: each
caller has a torch path to fall back on.
Processes building the same key at once take turns (``file_lock``, at most ``build_wait_s``); a build
killed midway leaves nothing that blocks the next.
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
from splitserve.engine.hardware import cpu_isa, isa_override

X86 = platform.machine() in ("x86_64", "AMD64")
# 512-bit vectors where the CPU has them (gcc's default under -march=native is 256): x86 only, the flag is not
# known elsewhere.
BASE_CFLAGS = ["-O3", "-march=native", "-fopenmp"] + (["-mprefer-vector-width=512"] if X86 else [])
# A tuple: torch's builder appends its own libraries to the ``extra_ldflags`` list it is given, in place, which
# changed every later build key in the process (each build gets a fresh list).
LDFLAGS = ("-fopenmp",)
# The ISA flags a cap ($SPLITSERVE_CPU_ISA) can take away from the build, with the compiler flag that does.
CAPPED_FLAGS = (("avx512f", "-mno-avx512f"), ("avx2", "-mno-avx2"), ("fma", "-mno-fma"))
# How long a load waits for another process's build of the same key (one takes about a minute on 2 cores);
# past it the load fails with the reason and the caller keeps its torch path.
BUILD_WAIT_S = float(os.environ.get("SPLITSERVE_EXTENSION_BUILD_WAIT_S", "600"))


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


def compile_flags() -> list[str]:
    """``BASE_CFLAGS``, less what ``$SPLITSERVE_CPU_ISA`` takes away when it is set (x86)."""
    if not X86 or isa_override() is None:
        return list(BASE_CFLAGS)
    isa = cpu_isa()
    return BASE_CFLAGS + [flag for name, flag in CAPPED_FLAGS if not isa.get(name)]


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


class Extension:
    """One C++ source (``source``), built as ``name`` on first ``load``; ``switch_env`` set to ``0``
    disables it; ``fallback`` says, in the log line of a failure, what runs instead."""

    def __init__(self, name: str, source: Path, switch_env: str, fallback: str, log: logging.Logger) -> None:
        self.name, self.source, self.switch_env, self.fallback, self.log = name, source, switch_env, fallback, log
        self.build_wait_s = BUILD_WAIT_S
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._failure: str | None = None  # why the extension is unavailable, once a load has failed

    def cache_root(self) -> Path:
        root = Path(os.environ.get("SPLITSERVE_EXTENSION_CACHE", Path.home() / ".cache/splitserve"))
        return root / self.name

    def code_key(self) -> str:
        """What the compiled code depends on: the source's text, the flags, torch's version, Python and the CPU
        (the linear tuner keys its timings on it)."""
        digest = hashlib.sha256()
        for part in (
            self.source.read_bytes(),
            " ".join([*compile_flags(), *LDFLAGS]).encode(),
            torch.__version__.encode(),
        ):
            digest.update(part)
            digest.update(b"\0")
        digest.update(f"{sys.version_info[:2]} {cpu_signature()}".encode())
        return digest.hexdigest()[:16]

    def build_key(self) -> str:
        """The build's folder: ``code_key`` and where the source and torch are. torch's builder writes the
        source's path and torch's include folders into the build's ninja file and recompiles when they change,
        so two checkouts or two venvs sharing the cache each keep a build of their own instead of recompiling
        over each other's."""
        where = f"{self.code_key()} {self.source.resolve()} {Path(torch.__file__).resolve().parent}"
        return hashlib.sha256(where.encode()).hexdigest()[:16]

    def _build(self) -> ModuleType:
        from torch.utils import cpp_extension

        _ninja_on_path()
        key = self.build_key()
        directory = self.cache_root() / key
        # torch's builder takes a lock that is a file's existence ("lock" in the build folder) and waits for it
        # with no deadline, so a build killed midway left every later load waiting forever. Builds here take
        # an flock first (released when its holder dies, waited on for at most build_wait_s): whoever holds it
        # is the only splitserve build of this key, so a "lock" file found then was left by a build that died.
        with file_lock(directory / "splitserve-build.lock", self.build_wait_s, f"the {self.name} kernel's build"):
            baton = directory / "lock"
            if baton.exists():
                self.log.warning("removing %s, left by a build of the %s kernel that did not finish", baton, self.name)
                baton.unlink(missing_ok=True)
            return cpp_extension.load(
                name=f"splitserve_{self.name}_{key}",
                sources=[str(self.source)],
                extra_cflags=compile_flags(),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(directory),
                verbose=False,
            )

    def load(self) -> ModuleType | None:
        """The compiled extension, built on first call; None (the reason logged once) when it cannot be."""
        if self._module is not None or self._failure is not None:
            return self._module
        with self._lock:
            if self._module is not None or self._failure is not None:
                return self._module
            if os.environ.get(self.switch_env, "1") == "0":
                self._failure = f"disabled by {self.switch_env}=0"
            else:
                try:
                    self._module = self._build()
                except Exception as e:  # a missing compiler or ninja, a compile error, an unloadable library
                    self._failure = f"{type(e).__name__}: {e}".strip()
            if self._failure is not None:
                name = self.name.replace("_", " ")
                reason = self._failure.splitlines()[0][:500]
                self.log.warning("%s kernel unavailable (%s): %s", name, reason, self.fallback)
            else:
                self.log.info(
                    "%s kernel loaded from %s", self.name.replace("_", " "), self.cache_root() / self.build_key()
                )
        return self._module

    def failure(self) -> str | None:
        """Why the extension is unavailable (None when it loaded or has not been tried)."""
        return self._failure

    def reset(self) -> None:
        """Forget the loaded module and any failure, so the next ``load`` tries again (tests)."""
        with self._lock:
            self._module, self._failure = None, None
