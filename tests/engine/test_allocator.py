"""torch's CPU allocator with freed large blocks kept for reuse (engine/allocator.py, cpu_block_cache.cpp).

The cache replaces torch's CPU allocator for the rest of the process, so what it does is checked in fresh
processes; the engine tests of this session run with it installed (the engine's default), which holds it
against every operator the engine calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from splitserve.engine import allocator

pytestmark = pytest.mark.skipif(allocator.EXTENSION.load() is None, reason="the block cache is not built here")

# Makes and fills an 80 MB tensor (qwen2.5-0.5b's gate/up output at 2048 tokens) eight times, from a thread
# started after the install, as a worker's steps do, and prints each time's minor page faults and the stats.
PROBE = """
import json, resource, sys, threading
import torch
from splitserve.engine import allocator
out = {"mode": allocator.install() if sys.argv[1] == "cache" else "default", "faults": []}
def run():
    for _ in range(8):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(20 << 20).fill_(1.0)
        out["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
t = threading.Thread(target=run); t.start(); t.join()
out["stats"] = allocator.stats()
print(json.dumps(out))
"""


def probe(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=300, env=os.environ, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_blocks_are_reused_without_page_faults():
    default, cached = probe("default"), probe("cache")
    assert default["mode"] == "default" and default["stats"] is None
    # torch's allocator through glibc maps every 80 MB block afresh: each fill faults its pages in again.
    assert min(default["faults"][1:]) > 1000, default
    assert cached["mode"] == "cache (blocks >= 1 MiB, up to 1024 MiB kept)"
    # The cache hands the freed block back: after the first, no faults at all.
    assert sum(cached["faults"][1:]) == 0, cached
    stats = cached["stats"]
    assert (stats["misses"], stats["hits"], stats["cached_blocks"], stats["live_blocks"]) == (1, 7, 1, 0), stats


def test_size_classes_round_up_at_most_an_eighth():
    module = allocator.EXTENSION.load()
    for n in (1 << 20, (1 << 20) + 1, 3_000_000, 80 << 20, (80 << 20) + 64, 123_456_789):
        size = module.size_class(n)
        assert n <= size <= n * 1.125 + 4096 and size % 4096 == 0, (n, size)
    assert module.size_class(80 << 20) == module.size_class((80 << 20) - 4096)  # near sizes share a class


# Run in one fresh process: blocks of several sizes, the cap, raw allocations, values kept across reuse.
BEHAVIOUR = """
import json, torch
from splitserve.engine import allocator
module = allocator.EXTENSION.load()
assert module.install(1 << 20, 64 << 20) and not module.install(1 << 20, 1 << 30)  # once; the first settings stay
out = {"installed": module.installed()}
a = torch.arange(3 << 18, dtype=torch.float32)  # 3 MiB, through the cache
out["small_bypasses"] = module.stats()["live_blocks"] == 1 and torch.ones(100).sum().item() == 100.0
del a
b = torch.full((3 << 18,), 2.0)  # the same class: the freed block again, filled anew
out["reuse"] = [module.stats()["hits"], b.sum().item() == 2.0 * (3 << 18)]
del b
big = torch.empty(40 << 18)  # 40 MiB: more than half of the 64 MiB cap, returned at once when freed
del big
out["over_half"] = module.stats()["cached_bytes"]
blocks = [torch.empty((9 << 18) + i * 4096) for i in range(10)]  # ten 9 MiB blocks of distinct classes
del blocks
s = module.stats()
out["cap"] = [s["cached_bytes"] <= 64 << 20, s["evictions"] > 0, s["live_bytes"]]
storage = torch.UntypedStorage(5 << 20)  # raw-sized storage, resized through the allocator
storage.resize_(6 << 20)
del storage
module.empty()
out["empty"] = module.stats()["cached_bytes"]
print(json.dumps(out))
"""


def test_cache_behaviour_in_a_fresh_process():
    run = subprocess.run(
        [sys.executable, "-c", BEHAVIOUR], capture_output=True, text=True, timeout=300, env=os.environ, check=True
    )
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["installed"] and out["small_bypasses"]
    assert out["reuse"] == [1, True]
    assert out["over_half"] == allocator.EXTENSION.load().size_class(3 << 20)  # only the 3 MiB block is kept
    assert out["cap"] == [True, True, 0]
    assert out["empty"] == 0


def test_bad_settings_are_refused_by_name():
    module = allocator.EXTENSION.load()
    with pytest.raises(RuntimeError, match="min_bytes: must be at least 4096"):
        module.install(16, 1 << 30)
    with pytest.raises(RuntimeError, match="max_cached_bytes: must be >= 0"):
        module.install(1 << 20, -1)


def test_engine_reports_its_allocator(tiny_model_dir):
    from splitserve.engine import LLM

    llm = LLM(tiny_model_dir, dtype="float32", num_blocks=16, cpu_allocator="default")
    assert llm.core.allocator == "default"
    with pytest.raises(ValueError, match="cpu_allocator: must be one of cache, default"):
        LLM(tiny_model_dir, dtype="float32", num_blocks=16, cpu_allocator="tcmalloc")
