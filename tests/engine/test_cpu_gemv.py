"""The panel linear kernel (engine/model/cpu_gemv.py): against a float64 reference at edge shapes, the Linear
paths that use it, the tuner's decisions with it, and the fallback when it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine import native
from splitserve.engine.model import cpu_gemv, linear_tuner
from splitserve.engine.model.linear_tuner import (
    FORCED_GEMV_ROWS,
    KernelCache,
    KernelPolicy,
    apply_kernels,
    decide,
    forced_path,
    split_times,
)
from splitserve.engine.model.transformer import onednn_runs
from tests.engine.parity import linear_paths, torch_threads
from tests.engine.test_linear_tuner import make_model, random_linear

needs_kernel = pytest.mark.skipif(
    cpu_gemv.EXTENSION.load() is None, reason=f"cpu gemv kernel not built: {cpu_gemv.EXTENSION.failure()}"
)
needs_onednn = pytest.mark.skipif(not onednn_runs(torch.float32), reason="oneDNN is not available in this torch")


@pytest.fixture(scope="module", autouse=True)
def two_torch_threads():
    with torch_threads(2):  # the output rows split over threads: uneven splits included
        yield


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The kernel on ``w`` packed in its panels."""
    return cpu_gemv.gemv(x, cpu_gemv.pack(w), b, w.shape[0])


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (3, 15), (4, 16), (5, 17), (9, 33), (257, 100), (300, 7), (1152, 896)])
def test_matches_a_float64_product_at_edge_shapes(dtype, n, k):
    """Any K; output rows that leave a partial last panel (N not a multiple of 8 or 16) and panel counts that
    are not a multiple of the panels taken at once (1, 2, 4, 6 or 8); every row count up to a pass of 16, a
    second pass and a remainder; with and without a bias."""
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen)
    panels = cpu_gemv.pack(w)
    width = cpu_gemv.EXTENSION.load().panel_width()
    assert panels.shape == (-(-n // width), k, width) and panels.dtype == dtype
    for m in [*range(1, 18), 33]:
        x = torch.randn(m, k, generator=gen).to(dtype)
        for bias in (b, None):
            y = cpu_gemv.gemv(x, panels, bias, n)
            assert y.dtype == dtype and y.shape == (m, n)
            exact = reference(x, w, bias)
            if dtype == torch.float32:
                torch.testing.assert_close(y.double(), exact, atol=1e-5 * k**0.5, rtol=1e-5)
            else:  # float32 sums rounded to bf16 once: within one bf16 step of the exact product, beside the
                # float32 sum's own error (the float32 case's atol), which a sum that cancels to near zero shows
                step = exact.abs() * 2**-7 + 1e-5 * k**0.5
                assert bool(((y.double() - exact).abs() <= step).all()), (m, float((y.double() - exact).abs().max()))


@needs_kernel
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(3, 15), (17, 33), (300, 7), (1152, 96)])
def test_a_bf16_input_equals_the_float32_route_rounded_once(weight_dtype, n, k):
    """A bfloat16 x is widened in the kernel and its output rounded there: bit for bit the float32 x's product
    (its sums plus bias) rounded once by ``.to(torch.bfloat16)``, at every pass size, partial panels, with and
    without a bias, and for a strided 3-d input."""
    module = cpu_gemv.EXTENSION.load()
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen).to(weight_dtype)
    b = torch.randn(n, generator=gen)
    panels = module.pack(w)
    for m in [1, 2, 3, 5, 8, 9, 16, 17, 33]:
        x = torch.randn(m, k, generator=gen).bfloat16()
        for bias in (b, None):
            y = module.gemv(x, panels, bias, n)
            assert y.dtype == torch.bfloat16 and y.shape == (m, n)
            assert torch.equal(y, module.gemv(x.float(), panels, bias, n).bfloat16()), (m, bias is None)
    wide = torch.randn(2, 3, 2 * k, generator=gen).bfloat16()
    y = module.gemv(wide[..., ::2], panels, b, n)
    assert y.shape == (2, 3, n) and y.dtype == torch.bfloat16
    assert torch.equal(y, module.gemv(wide[..., ::2].float().reshape(6, k), panels, b, n).bfloat16().view(2, 3, n))


@needs_kernel
def test_bf16_outputs_round_halfway_sums_to_even_as_torch_does():
    """Sums exactly halfway between two bf16 values (kept bit 0 and 1, either sign), infinities and a NaN, through
    the vector store and the partial last panel: ``.to(torch.bfloat16)``'s values, NaN where it gives NaN."""
    module = cpu_gemv.EXTENSION.load()
    width = module.panel_width()
    n = 3 * width + 5
    halves = torch.tensor([0x3F808000, 0x3F818000, 0x40FF8000, 0x47008000], dtype=torch.int32).view(torch.float32)
    bias = torch.cat([halves, -halves, torch.tensor([float("inf"), -float("inf"), float("nan"), 1e-40])])
    bias = bias.repeat(-(-n // bias.numel()))[:n].contiguous()
    panels = module.pack(torch.zeros(n, 4, dtype=torch.bfloat16))
    for m in (1, 3):
        y = module.gemv(torch.ones(m, 4, dtype=torch.bfloat16), panels, bias, n)
        expected = bias.expand(m, n).to(torch.bfloat16)
        assert torch.equal(y.isnan(), expected.isnan())
        assert torch.equal(y.nan_to_num(0.0), expected.nan_to_num(0.0))


@needs_kernel
def test_takes_any_leading_shape_and_a_non_contiguous_input():
    w, b = torch.randn(64, 48), torch.randn(64)
    wide = torch.randn(2, 3, 96)
    x = wide[..., ::2]  # [2, 3, 48], strided
    y = gemv(x, w, b)
    assert y.shape == (2, 3, 64)
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_bad_inputs_are_refused_with_the_argument_named():
    module = cpu_gemv.EXTENSION.load()
    panels = module.pack(torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="w: float32 or bfloat16"):
        module.pack(torch.randn(4, 8).half())
    with pytest.raises(RuntimeError, match="panels: pack"):
        module.gemv(torch.randn(1, 8), torch.randn(4, 8), None, 4)
    with pytest.raises(RuntimeError, match="K as x's"):
        module.gemv(torch.randn(1, 8), module.pack(torch.randn(4, 9)), None, 4)
    with pytest.raises(RuntimeError, match="N: the packed weight's output rows"):
        module.gemv(torch.randn(1, 8), panels, None, module.panel_width() + 1)
    with pytest.raises(RuntimeError, match="bias: float32"):
        module.gemv(torch.randn(1, 8), panels, torch.randn(5), 4)
    with pytest.raises(RuntimeError, match="x: float32 or bfloat16"):
        module.gemv(torch.randn(1, 8).half(), panels, None, 4)


@needs_kernel
def test_the_vector_path_follows_the_isa_it_was_built_for():
    """-march=native, less what $SPLITSERVE_CPU_ISA takes away: AVX-512 builds take 16 floats and up to 16 rows
    a pass, AVX2 builds 8 and 8."""
    module = cpu_gemv.EXTENSION.load()
    flags = " ".join(f for f in native.compile_flags())
    if "-mno-avx512f" not in flags and " avx512f " in f" {native.cpu_signature()} ":
        assert (module.vector_width(), module.max_rows()) == (16, 16)
    elif module.vector_width() == 8:
        assert module.max_rows() == 8
    assert cpu_gemv.MAX_ROWS % module.max_rows() == 0  # the rows the tuner offers it for: whole passes
    assert cpu_gemv.describe().split()[0] in ("avx-512", "avx2", "portable")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_sums_do_not_depend_on_the_rows_beside_it(dtype):
    """Each row alone gives bit for bit what it gives in a batch of any size (one pass or several), so a
    request's output does not depend on the requests it is batched with."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(515, 200, generator=gen).to(dtype)
    b = torch.randn(515, generator=gen)
    x = torch.randn(23, 200, generator=gen).to(dtype)
    alone = torch.cat([gemv(x[i : i + 1], w, b) for i in range(23)])
    for m in (2, 3, 4, 5, 8, 16, 23):
        assert torch.equal(gemv(x[:m], w, b), alone[:m]), m


def test_a_cap_on_the_isa_takes_its_instructions_out_of_the_build(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_CPU_ISA", raising=False)
    free = cpu_gemv.EXTENSION.build_key()
    assert "-mno-avx512f" not in native.compile_flags()
    monkeypatch.setenv("SPLITSERVE_CPU_ISA", "avx2,fma")
    capped = native.compile_flags()
    if native.X86:
        assert "-mno-avx512f" in capped and "-mno-avx2" not in capped and "-mno-fma" not in capped
        assert cpu_gemv.EXTENSION.build_key() != free
    monkeypatch.setenv("SPLITSERVE_CPU_ISA", "")
    if native.X86:
        assert {"-mno-avx512f", "-mno-avx2", "-mno-fma"} <= set(native.compile_flags())


@needs_kernel
@needs_onednn
@pytest.mark.parametrize("path", ["gemv", "gemv-packed"])
def test_linear_routes_few_rows_to_the_kernel_and_more_to_the_other_path(monkeypatch, path):
    layer = random_linear(64, 4096, seed=1)
    exact = (layer.weight.clone(), layer.bias.clone())
    layer.use(path, split_rows=3)
    assert layer.path == path and layer.gemv_rows == 3
    # "gemv" keeps the plain weight for F.linear above the threshold; "gemv-packed" reads only oneDNN's layout there.
    assert (layer.weight is None) == (path == "gemv-packed") and layer.panels is not None
    calls = []
    real = cpu_gemv.gemv
    monkeypatch.setattr(cpu_gemv, "gemv", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 3, 4, 32):
        torch.testing.assert_close(
            layer(torch.ones(rows, 64)), F.linear(torch.ones(rows, 64), *exact), atol=1e-5, rtol=1e-5
        )
    assert calls == [1, 3]


@needs_kernel
def test_a_bf16_layer_on_the_kernel_rounds_float32_sums_once():
    layer = random_linear(256, 512, seed=2, std=0.05).to(torch.bfloat16)
    layer.use("gemv", split_rows=4)
    x = torch.randn(2, 256).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    y32 = cpu_gemv.EXTENSION.load().gemv(x.float(), layer.panels, layer.bias.float(), 512)
    assert torch.equal(y, y32.bfloat16())
    torch.testing.assert_close(
        y.float(), F.linear(x.float(), layer.weight.float(), layer.bias.float()), atol=0.05, rtol=0.01
    )


def test_decide_takes_the_kernel_below_a_threshold_where_it_wins():
    rows = (1, 4, 16, 64, 256)
    plain = {m: 2.0 * m for m in rows}
    packed = {m: 1.5 + 1.0 * m for m in rows}
    gemv = {1: 1.0, 4: 3.0}  # fastest at 1 and 4 rows: not timed above
    times = {"plain": plain, "packed": packed, "gemv": gemv}
    assert decide(times, allow_split=True) == ("gemv-packed", 4)
    # Every kernel split keeps a second layout of the weight (the panels beside the plain weight for "gemv").
    assert decide(times, allow_split=False) == ("packed", 0)
    assert decide({"plain": plain, "gemv": {1: 1.5, 4: 8.5}}, allow_split=True) == ("gemv", 1)
    assert decide({"plain": plain, "gemv": {1: 1.5, 4: 8.5}}, allow_split=False) == ("plain", 0)
    slow = {"plain": plain, "packed": packed, "gemv": {1: 5.0, 4: 20.0}}
    assert decide(slow, allow_split=True)[0] == "split" or decide(slow, allow_split=True)[0] == "packed"
    assert "gemv" not in decide(slow, allow_split=True)[0]
    chosen = linear_tuner.Choice("gemv-packed", 4, "measured", times)
    assert split_times(chosen) == {1: 1.0, 4: 3.0, 16: 17.5, 64: 65.5, 256: 257.5}


def test_the_kernel_is_never_a_single_path_even_at_one_timed_row():
    """An LM head timed at one row count (max_num_seqs of 1): the kernel, fastest there, is taken as a split
    at that row, over the best single path (packed) where a second layout is allowed."""
    one_row = {"plain": {1: 3.0}, "packed": {1: 2.0}, "gemv": {1: 1.0}}
    assert decide(one_row, allow_split=True) == ("gemv-packed", 1)
    assert decide(one_row, allow_split=False) == ("packed", 0)
    assert decide({"plain": {1: 1.0}, "packed": {1: 2.0}, "gemv": {1: 1.5}}, allow_split=True) == ("plain", 0)


def test_cached_times_need_the_kernel_only_at_its_rows(tmp_path):
    cache = KernelCache(tmp_path / "k.json")
    rows = (1, 4, 16)
    cache.put("key", {"plain": {1: 1.0, 4: 2.0, 16: 3.0, 64: 4.0}, "gemv": {1: 0.5, 4: 1.0, 16: 2.0}})
    assert cache.get("key", rows + (64,), ("plain", "gemv")) is not None  # not timed past cpu_gemv.MAX_ROWS
    assert cache.get("key", rows, ("plain", "packed", "gemv")) is None  # packed never timed: time again
    cache.put("key", {"plain": {1: 1.0, 4: 2.0, 16: 3.0}, "gemv": {1: 0.5, 4: 1.0}})  # the 4-row kernel's times
    assert cache.get("key", rows, ("plain", "gemv")) is None


def test_without_the_kernel_it_is_neither_offered_nor_forced(monkeypatch, caplog):
    ext = cpu_gemv.EXTENSION

    def broken_build():
        raise RuntimeError("no compiler here")

    # The loaded module and any failure are put back afterwards (monkeypatch): loading the same extension again
    # in one process would build it again.
    monkeypatch.setattr(ext, "_module", None)
    monkeypatch.setattr(ext, "_failure", None)
    monkeypatch.setattr(ext, "_build", broken_build)
    with caplog.at_level(logging.WARNING, logger=cpu_gemv.__name__):
        weight = torch.randn(1024, 512)
        assert not cpu_gemv.available(weight)
    assert "no compiler here" in ext.failure()
    assert any("linear layers keep torch's kernels" in r.getMessage() for r in caplog.records)
    assert "gemv" not in linear_tuner.candidates(weight, False)
    assert forced_path("gemv", weight) == "plain"
    assert forced_path("gemv-packed", weight) == ("split" if onednn_runs(torch.float32) else "plain")
    assert cpu_gemv.describe().startswith("unavailable (RuntimeError: no compiler here")


@needs_kernel
def test_forced_paths_on_every_weight_the_kernel_runs():
    weight = torch.randn(1024, 512)
    assert forced_path("gemv", weight) == "gemv"
    assert forced_path("gemv-fp32", weight) == ("gemv-packed" if onednn_runs(torch.float32) else "gemv")
    assert forced_path("gemv", weight.half()) == "plain"  # not a dtype the kernel takes
    bf16 = weight.bfloat16()
    assert forced_path("gemv-fp32", bf16) == ("gemv-fp32" if onednn_runs(torch.float32) else "gemv")


@needs_kernel
@needs_onednn
@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # tied and untied LM head
def test_forced_gemv_paths_reach_every_layer_and_the_lm_head(arch):
    for mode in ("gemv", "gemv-packed"):
        model = make_model(arch)
        head_weight = model.embed_tokens.weight if arch == "qwen2" else model.lm_head.weight
        apply_kernels(model, KernelPolicy(mode))
        assert set(linear_paths(model).values()) == {mode}, (mode, linear_paths(model))
        head = model.lm_head
        assert head.gemv_rows == FORCED_GEMV_ROWS and head.panels is not None
        if mode == "gemv" and arch == "qwen2":  # tied: F.linear above the threshold reads the embedding matrix
            assert head.weight is model.embed_tokens.weight
        if mode == "gemv-packed":
            assert head.weight is None
            if arch == "qwen2":  # the embedding keeps the matrix the head's panels were packed from
                assert model.embed_tokens.weight is head_weight
        for rows in (2, FORCED_GEMV_ROWS + 1):
            x = torch.randn(rows, model.config.hidden_size)
            torch.testing.assert_close(head(x), F.linear(x, head_weight), atol=1e-4, rtol=1e-4)
