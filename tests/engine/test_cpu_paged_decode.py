"""The CPU paged-decode kernel (engine/attention/cpu_paged_decode.py) against the torch reference, and its
fallback when it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from splitserve.engine import native
from splitserve.engine.attention import cpu_paged_decode
from splitserve.engine.attention.paged_decode import BackendRegistry, paged_decode_torch
from splitserve.engine.hardware import cpu_isa
from tests.common.test_file_lock import start_holder

needs_kernel = pytest.mark.skipif(
    cpu_paged_decode.load() is None, reason=f"cpu paged decode kernel not built: {cpu_paged_decode.failure()}"
)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_case(lens, heads, kv_heads, head_dim, block_size, dtype, shared=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(1, max(-(-n // block_size) for n in lens))
    num_blocks = len(lens) * max_blocks + 2
    cache = torch.randn(num_blocks, 2, kv_heads, block_size, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    if shared:  # every row's first block is row 0's (a shared prefix)
        tables[:, 0] = tables[0, 0]
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    return q, cache, tables, torch.tensor(lens)


def check(lens, heads=14, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, window=None, shared=False):
    q, cache, tables, lens_t = make_case(lens, heads, kv_heads, head_dim, block_size, dtype, shared)
    scale = head_dim**-0.5
    want = paged_decode_torch(q, cache, tables, lens_t, scale, window)
    got = cpu_paged_decode.paged_decode_cpu(q, cache, tables, lens_t, scale, window)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_block_boundaries(block_size, dtype):
    k = 3
    check([k * block_size, k * block_size - 1, k * block_size + 1, 1], block_size=block_size, dtype=dtype)


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (14, 2)])  # GQA ratios 1, 2, 7
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_and_head_dims(heads, kv_heads, head_dim):
    check([1, 17, 40, 5], heads=heads, kv_heads=kv_heads, head_dim=head_dim)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [8, 40, 100])  # below, equal to and above the longest context
def test_windows(window, dtype):
    check([40, 33, 7, 1, 16], window=window, dtype=dtype)


@needs_kernel
def test_one_token_contexts_and_shared_blocks():
    check([1, 1, 1])
    check([20, 37, 16, 3], shared=True)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_length_rows_are_finite_and_leave_live_rows_alone(dtype):
    q, cache, tables, lens = make_case([30, 0, 12, 0], 14, 2, 64, 16, dtype)
    scale = 0.125
    got = cpu_paged_decode.paged_decode_cpu(q, cache, tables, lens, scale, None)
    assert torch.isfinite(got.float()).all()
    live = torch.tensor([0, 2])
    want = paged_decode_torch(q[live], cache, tables[live], lens[live], scale, None)
    torch.testing.assert_close(got[live].float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_kernel
def test_int32_tables_and_lengths():
    q, cache, tables, lens = make_case([5, 21], 4, 2, 64, 16, torch.float32)
    want = paged_decode_torch(q, cache, tables, lens, 0.125, None)
    got = cpu_paged_decode.paged_decode_cpu(q, cache, tables.int(), lens.int(), 0.125, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_registry_selects_it_for_float32_and_bfloat16_on_cpu_only():
    registry = BackendRegistry()
    registry.register("torch", paged_decode_torch, lambda device, dtype: True, priority=0)
    assert registry.select("cpu", torch.float32).name == "cpu"
    assert registry.select("cpu", torch.bfloat16).name == "cpu"
    assert registry.select("cpu", torch.float16).name == "torch"


@needs_kernel
def test_tiled_path_follows_the_cpu():
    """-march=native, less what $SPLITSERVE_CPU_ISA takes away: the AVX-512 path is built exactly where the CPU
    (or the cap standing for one) has AVX-512F."""
    assert cpu_paged_decode.tiled() == bool(cpu_isa().get("avx512f"))


def test_build_failure_falls_back_with_a_logged_reason(monkeypatch, caplog):
    def broken_build():
        raise RuntimeError("no compiler here")

    cpu_paged_decode.reset()
    monkeypatch.setattr(cpu_paged_decode.EXTENSION, "_build", broken_build)
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_paged_decode.__name__):
            assert not cpu_paged_decode.is_available(torch.device("cpu"), torch.float32)
        assert "no compiler here" in cpu_paged_decode.failure()
        assert any("falls back to the torch reference" in r.getMessage() for r in caplog.records)
        registry = BackendRegistry()
        registry.register("torch", paged_decode_torch, lambda device, dtype: True, priority=0)
        assert registry.select("cpu", torch.float32).name == "torch"
        with pytest.raises(ValueError, match="not available"):
            registry.select("cpu", torch.float32, name="cpu")
    finally:
        cpu_paged_decode.reset()


def test_disabled_by_environment(monkeypatch):
    cpu_paged_decode.reset()
    monkeypatch.setenv("SPLITSERVE_CPU_PAGED_DECODE", "0")
    try:
        assert cpu_paged_decode.load() is None
        assert "SPLITSERVE_CPU_PAGED_DECODE" in cpu_paged_decode.failure()
    finally:
        cpu_paged_decode.reset()


def test_build_key_follows_the_cpu(monkeypatch):
    ext = cpu_paged_decode.EXTENSION
    key = ext.build_key()
    monkeypatch.setattr(native, "cpu_signature", lambda: "flags: sse2 avx2")
    other = ext.build_key()
    monkeypatch.setattr(native, "cpu_signature", lambda: "flags: sse2 avx2 avx512f")
    assert len({key, other, ext.build_key()}) == 3


def test_a_build_leaves_the_keys_of_the_next_builds_as_they_were(monkeypatch, tmp_path):
    """torch's builder appends its libraries to the ``extra_ldflags`` list it is given: with the module's own
    list passed in, every later build in the process got another key, and compiled again what ``make setup``
    had built."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("SPLITSERVE_EXTENSION_CACHE", str(tmp_path))
    ext = cpu_paged_decode.EXTENSION
    before = {name: e.build_key() for name, e in extensions().items()}

    def builder(**kwargs):  # what torch's builder does to the lists it is given
        kwargs["extra_ldflags"] += ["-L/torch/lib", "-lc10", "-ltorch"]
        kwargs["extra_cflags"] += ["-I/torch/include"]
        return "module"

    monkeypatch.setattr(cpp_extension, "load", builder)
    assert ext._build() == "module" and ext._build() == "module"
    assert {name: e.build_key() for name, e in extensions().items()} == before
    assert "-L/torch/lib" not in native.LDFLAGS and "-I/torch/include" not in native.compile_flags()


def test_a_second_checkout_of_the_same_source_builds_in_a_folder_of_its_own(monkeypatch, tmp_path):
    """torch's builder recompiles when the source's path in its ninja file changes, so two checkouts sharing the
    cache would rebuild over each other: the folder follows the path, the tuner's code key only the text."""
    ext = cpu_paged_decode.EXTENSION
    key, code = ext.build_key(), ext.code_key()
    copy = tmp_path / ext.source.name
    copy.write_bytes(ext.source.read_bytes())
    monkeypatch.setattr(ext, "source", copy)
    assert ext.code_key() == code and ext.build_key() != key
    copy.write_bytes(copy.read_bytes() + b"\n// another build\n")
    assert ext.code_key() != code


def extensions() -> dict:
    from splitserve.engine import allocator
    from splitserve.engine.model import cpu_gemv, cpu_norm

    return {
        e.name: e for e in (cpu_paged_decode.EXTENSION, cpu_gemv.EXTENSION, cpu_norm.EXTENSION, allocator.EXTENSION)
    }


def test_a_build_killed_midway_leaves_nothing_that_blocks_the_next(monkeypatch, tmp_path):
    """torch's builder waits with no deadline while its "lock" file exists, and a killed build leaves it:
    a build that holds splitserve's flock removes that file before it calls the builder."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("SPLITSERVE_EXTENSION_CACHE", str(tmp_path))
    directory = cpu_paged_decode.EXTENSION.cache_root() / cpu_paged_decode.EXTENSION.build_key()
    directory.mkdir(parents=True)
    (directory / "lock").write_text("")  # what a killed build leaves
    seen = {}

    def builder(**kwargs):
        seen["baton"] = (directory / "lock").exists()
        seen["build_directory"] = kwargs["build_directory"]
        return "module"

    monkeypatch.setattr(cpp_extension, "load", builder)
    assert cpu_paged_decode.EXTENSION._build() == "module"
    assert seen == {"baton": False, "build_directory": str(directory)}


def test_a_build_held_by_another_process_past_the_deadline_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SPLITSERVE_EXTENSION_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_paged_decode.EXTENSION, "build_wait_s", 0.3)
    holder = start_holder(
        cpu_paged_decode.EXTENSION.cache_root() / cpu_paged_decode.EXTENSION.build_key() / "splitserve-build.lock"
    )
    cpu_paged_decode.reset()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_paged_decode.__name__):
            assert cpu_paged_decode.load() is None
        assert "another process has held" in cpu_paged_decode.failure()
        assert any("falls back to the torch reference" in r.getMessage() for r in caplog.records)
    finally:
        holder.kill()
        holder.wait(10)
        cpu_paged_decode.reset()
