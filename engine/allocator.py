"""torch's CPU allocator: freed large blocks kept for the next step (``cpu_block_cache.cpp``).

A prefill step of 2048 tokens makes temporaries of tens of megabytes in every layer (qwen2.5-0.5b: the
gate/up projection's output is 80 MB, the SiLU's 40 MB). torch's default CPU allocator hands each block to
malloc and back when it is freed; glibc maps a block above its mmap threshold (at most 32 MiB) afresh and
unmaps it on free, and trims its heap above twice that, so such a block is page-faulted in, a page at a
time, every time an operator makes it: an 80 MB tensor made and filled took 29-33 ms with torch's allocator
and 2.7-3.4 ms from the cache below on 2 cores (docs/engine.md, "torch's CPU allocator and large blocks").

Making glibc keep them instead (``mallopt``: no mmap, no trim) was measured and not kept: torch asks for
64-byte-aligned blocks, a freed block of exactly one size is too small for the next aligned request of the
same size, and repeating an 80 MB request grew the heap to 803 MB, 720 of them free, before it reused any.

So a cache of our own sits in front of the allocator (an engine's ``cpu_allocator: cache``, the default on
the CPU): blocks of ``MIN_BYTES`` and more are rounded up to a size class (at most 12.5% more) and, when
freed, kept and handed to the next request of their class. Beyond ``MAX_CACHED_BYTES`` of free blocks the
oldest go back to the system, and a block of more than half of it (a KV cache, a weight) goes back at once.
Smaller blocks take torch's allocator as before. Built by ``splitserve.engine.native`` on first use (``make
setup`` builds it ahead); when it cannot be built (``SPLITSERVE_CPU_BLOCK_CACHE=0``, no compiler) the reason
is logged and torch's allocator stays. It is installed for the process's lifetime; a block allocated before
keeps its own allocator.
"""

from __future__ import annotations

import logging
from pathlib import Path

from splitserve.engine.native import Extension

log = logging.getLogger("splitserve.engine")

ALLOCATOR_MODES = ("cache", "default")
SOURCE = Path(__file__).with_name("cpu_block_cache.cpp")
EXTENSION = Extension("cpu_block_cache", SOURCE, "SPLITSERVE_CPU_BLOCK_CACHE", "torch's CPU allocator stays", log)
MIN_BYTES = 1 << 20  # smaller blocks: glibc's heap reuses them without faults
MAX_CACHED_BYTES = 1 << 30  # free blocks kept at most (a 2048-token step of qwen2.5-0.5b frees about 200 MB)


def install() -> str:
    """Install the block cache as torch's CPU allocator (once per process). Returns what is in effect, for the
    engine's log and ``EngineCore.allocator``: ``cache (blocks >= 1 MiB, up to 1024 MiB kept)`` or
    ``default (...)`` with the reason the cache is unavailable."""
    module = EXTENSION.load()
    if module is not None and module.install(MIN_BYTES, MAX_CACHED_BYTES):
        log.info("torch's CPU allocator: %s", describe())
    return describe()


def describe() -> str:
    module = EXTENSION.load()
    if module is None:
        return f"default ({EXTENSION.failure()})"
    if not module.installed():
        return "default"
    s = module.stats()
    return f"cache (blocks >= {s['min_bytes'] >> 20} MiB, up to {s['max_cached_bytes'] >> 20} MiB kept)"


def stats() -> dict[str, int] | None:
    """The cache's counters (hits, misses, evictions, cached_bytes, live_bytes, ...), None when not installed."""
    module = EXTENSION.load()
    if module is None or not module.installed():
        return None
    return dict(module.stats())


if __name__ == "__main__":  # `make setup`: build ahead of the first load (a failure is logged, not fatal)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = EXTENSION.load()
    print("cpu block cache:", "built" if module is not None else f"unavailable ({EXTENSION.failure()})")
