"""bf16 on CPUs without native bf16: the float32-compute linear paths, the tuner's choice among every bf16
path (a fake clock forces each), ``--dtype auto``'s float32 rule and its greedy parity with transformers.

This machine's own flags do not matter here: ``SPLITSERVE_CPU_ISA`` (engine/hardware.py) stands for an
AVX2-only CPU, and the decisions that depend on time are forced through the tuner's injectable clock or
a fixed comparison. Models are small (one packable layer for the tuner, the 4-layer qwen2 parity model in
bf16 for the engine), so the module runs in seconds.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.core import EngineConfig
from splitserve.engine.model import cpu_gemv, loader
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.linear_tuner import (
    BF16_STORAGE_PATHS,
    Fp32Comparison,
    KernelPolicy,
    apply_kernels,
    auto_dtype_comparison,
    candidates,
    choose_kernels,
    compare_fp32,
    decide,
    summarize,
)
from splitserve.engine.model.transformer import FP32_COMPUTE_PATHS, SPLIT_FP32, CausalLM, Linear, onednn_runs
from tests.conftest import PACKABLE_ARCH_CONFIGS, PACKABLE_INIT
from tests.engine.parity import (
    assert_greedy_parity,
    assert_no_blocks_in_use,
    assert_not_degenerate,
    hf_greedy,
    linear_paths,
    make_prompts,
    prompt_logits,
    torch_threads,
)

AVX2_ONLY = "avx2,fma"
needs_onednn = pytest.mark.skipif(not onednn_runs(torch.float32), reason="oneDNN is not available in this torch")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


def bf16_model(arch: str = "qwen2") -> CausalLM:
    """A one-layer packable model in bf16 with random weights (the tuner only needs shapes)."""
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_dict({**PACKABLE_ARCH_CONFIGS[arch], "num_hidden_layers": 1}))
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    return model.to(torch.bfloat16).requires_grad_(False)


def fastest(winner: str):
    """A fake clock on which ``winner`` costs 1 us a row and every other path 5 us."""

    def timer(path, rows, fn):
        return (1e-6 if path == winner else 5e-6) * rows

    return timer


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory, test_tokenizer):
    """The 4-layer qwen2 parity model (tests/conftest.py's PACKABLE_ARCH_CONFIGS) stored in bf16."""
    from splitserve.tools import random_weights
    from splitserve.tools.make_model import write_random_checkpoint

    with pytest.MonkeyPatch.context() as patch:
        for name, value in PACKABLE_INIT.items():
            patch.setattr(random_weights, name, value)
        root = tmp_path_factory.mktemp("bf16-models")
        cfg = PACKABLE_ARCH_CONFIGS["qwen2"]
        return write_random_checkpoint(root / "qwen2", cfg, dtype="bfloat16", seed=7, tokenizer=test_tokenizer)


def bf16_layer(seed: int) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    """A plain 512 -> 768 bf16 layer with a bias, random, and copies of its weight and bias."""
    torch.manual_seed(seed)
    layer = Linear(512, 768, bias=True).requires_grad_(False)
    layer.weight.normal_(0, 0.05)
    layer.bias.normal_()
    layer = layer.to(torch.bfloat16)
    return layer, layer.weight.clone(), layer.bias.clone()


@pytest.mark.parametrize("path", FP32_COMPUTE_PATHS)
def test_fp32_compute_paths_round_the_float32_product_once(path):
    """upcast, fp32 and fp32-packed give the float32 product of the bf16 values, rounded to bf16 once; fp32
    keeps a float32 weight, fp32-packed only oneDNN's copy of it, upcast the bf16 weight."""
    if path == "fp32-packed" and not onednn_runs(torch.float32):
        pytest.skip("oneDNN is not available in this torch")
    layer, weight, bias = bf16_layer(seed=2)
    layer.use(path)
    assert layer.path == path
    if path == "upcast":
        assert layer.weight.dtype == torch.bfloat16
    elif path == "fp32":
        assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, weight.float())
    else:
        assert layer.weight is None and layer.packed is not None
    for rows in (1, 5, 64):
        x = torch.randn(rows, 512).to(torch.bfloat16)
        expected = F.linear(x.float(), weight.float(), bias.float()).to(torch.bfloat16)
        out = layer(x)
        assert out.dtype == torch.bfloat16
        if path == "fp32-packed":  # oneDNN sums in its own order: at most one bf16 rounding step apart
            torch.testing.assert_close(out, expected, atol=1e-6, rtol=2**-7)
        else:
            assert torch.equal(out, expected)


@needs_onednn
def test_split_fp32_runs_plain_bf16_up_to_its_rows_and_fp32_packed_above():
    """split-fp32 keeps the bf16 weight and oneDNN's float32 copy: inputs of at most split_rows rows give
    exactly F.linear in bf16, larger ones the float32 product rounded once (one bf16 step, as fp32-packed)."""
    layer, weight, bias = bf16_layer(seed=3)
    layer.use(SPLIT_FP32, 4)
    assert layer.path == SPLIT_FP32 and layer.split_rows == 4
    assert layer.weight.dtype == torch.bfloat16 and layer.packed is not None
    for rows in (1, 4, 5, 64):
        x = torch.randn(rows, 512).to(torch.bfloat16)
        out = layer(x)
        assert out.dtype == torch.bfloat16
        if rows <= 4:
            assert torch.equal(out, F.linear(x, weight, bias)), rows
        else:
            expected = F.linear(x.float(), weight.float(), bias.float()).to(torch.bfloat16)
            torch.testing.assert_close(out, expected, atol=1e-6, rtol=2**-7)
    x3 = torch.randn(2, 2, 512).to(torch.bfloat16)  # rows are counted over the leading dims
    torch.testing.assert_close(layer(x3), F.linear(x3.float(), weight.float(), bias.float()).to(torch.bfloat16))


def split_clock(small: str, large: str, threshold: int):
    """A fake clock on which ``small`` is fastest up to ``threshold`` rows and ``large`` above them."""

    def timer(path, rows, fn):
        winner = small if rows <= threshold else large
        return (1e-6 if path == winner else 4e-6) * rows

    return timer


@needs_onednn
def test_the_tuner_splits_plain_bf16_against_fp32_packed(tmp_path):
    """The emulated bf16 product of one row at memory speed, float32 from a few rows on: "split-fp32" at the
    crossing, logged and shown in the summary; not offered without float32 copies or without splits."""
    policy = KernelPolicy(
        cache_path=str(tmp_path / "k.json"), allow_fp32_weights=True, allow_split=True, fp32_compute=True
    )
    model = bf16_model()
    choices = apply_kernels(model, policy, split_clock("plain", "fp32-packed", 4))
    timed = [c for c in choices.values() if c.source == "measured"]
    assert timed and all((c.path, c.split_rows) == (SPLIT_FP32, 4) for c in timed), choices
    assert SPLIT_FP32 in set(linear_paths(model).values())
    assert f"{SPLIT_FP32} at 4 rows" in summarize(choices)
    x = torch.randn(16, model.config.hidden_size).to(torch.bfloat16)
    assert model.layers[0].mlp(x).dtype == torch.bfloat16
    no_split = replace(policy, cache_path=str(tmp_path / "k2.json"), allow_split=False)
    assert SPLIT_FP32 not in summarize(choose_kernels(bf16_model(), no_split, split_clock("plain", "fp32-packed", 4)))
    no_fp32 = replace(policy, cache_path=str(tmp_path / "k3.json"), allow_fp32_weights=False)
    assert SPLIT_FP32 not in summarize(choose_kernels(bf16_model(), no_fp32, split_clock("plain", "fp32-packed", 4)))


def test_decide_takes_a_split_only_when_it_beats_every_single_path():
    rows = (1, 4, 16, 64, 256)
    times = {
        "plain": {1: 1.0, 4: 4.0, 16: 64.0, 64: 256.0, 256: 1024.0},
        "fp32-packed": {1: 3.0, 4: 5.0, 16: 16.0, 64: 64.0, 256: 256.0},
        "upcast": {m: 10.0 * m for m in rows},
    }
    assert decide(times, allow_split=True) == (SPLIT_FP32, 4)
    assert decide(times, allow_split=False)[0] == "fp32-packed"
    times["upcast"] = {m: 0.5 * m for m in rows}  # a single path as fast as the split everywhere
    assert decide(times, allow_split=True) == ("upcast", 0)


@needs_onednn
def test_compare_fp32_counts_split_fp32_as_bf16_storage(tmp_path):
    """A bf16 model whose layers split plain (1 row) against fp32-packed is at least as fast as the float32
    model at every row count, so ``--dtype auto`` keeps bf16 (with those layers) where the tuner split."""
    policy = KernelPolicy(cache_path=str(tmp_path / "k.json"), allow_split=True)
    compared = compare_fp32(bf16_model(), policy, split_clock("plain", "fp32-packed", 1))
    assert compared.shapes >= 4 and not compared.fp32_faster and compared.bf16_ms < compared.fp32_ms
    unsplit = compare_fp32(
        bf16_model(),
        replace(policy, cache_path=str(tmp_path / "k2.json"), allow_split=False),
        split_clock("plain", "fp32-packed", 1),
    )
    assert unsplit.fp32_faster  # without the split, the float32 model wins from 4 rows on
    no_copies = compare_fp32(
        bf16_model(),
        replace(policy, cache_path=str(tmp_path / "k3.json"), allow_fp32_weights=False),
        split_clock("plain", "fp32-packed", 1),
    )
    assert no_copies.fp32_faster  # the engine could not keep the split's float32 copies: not counted


@needs_onednn
@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # tied and untied LM head
def test_forced_split_fp32_reaches_every_layer_and_means_split_on_float32(arch):
    model = bf16_model(arch)
    choices = apply_kernels(model, KernelPolicy(SPLIT_FP32))
    assert set(linear_paths(model).values()) == {SPLIT_FP32}
    assert all(c.source == "forced" and c.split_rows == 8 for c in choices.values())
    fp32_model = bf16_model(arch).float()
    apply_kernels(fp32_model, KernelPolicy(SPLIT_FP32))
    assert set(linear_paths(fp32_model).values()) <= {"split", "plain"}


def test_bf16_candidates_follow_onednn_and_the_fp32_permission(monkeypatch):
    weight = torch.zeros(1024, 512, dtype=torch.bfloat16)
    gemv = ("gemv",) if cpu_gemv.available(weight) else ()
    assert (
        candidates(torch.zeros(1024, 512), True)
        == (("plain", "packed") if onednn_runs(torch.float32) else ("plain",)) + gemv
    )
    with_fp32 = candidates(weight, True)
    assert {"plain", "upcast", "fp32"} <= set(with_fp32)
    assert not {"fp32", "fp32-packed"} & set(candidates(weight, False))
    monkeypatch.setenv("SPLITSERVE_CPU_ISA", AVX2_ONLY)  # oneDNN refuses bf16 on such a CPU
    assert "packed" not in candidates(weight, True) and "upcast" in candidates(weight, True)


@pytest.mark.parametrize("winner", ["plain", "packed", "upcast", "fp32", "fp32-packed"])
def test_the_tuner_picks_each_bf16_path_when_it_is_fastest(winner, tmp_path):
    """Every path the tuner can pick for a bf16 layer, forced by a fake clock; each shape logs its choice and
    the summary names it (what ``splitserve status`` shows)."""
    model = bf16_model()
    offered = candidates(model.embed_tokens.weight, True)
    if winner not in offered:
        pytest.skip(f"{winner}: not a candidate on this machine ({offered})")
    policy = KernelPolicy(
        cache_path=str(tmp_path / "k.json"), allow_fp32_weights=True, allow_split=False, fp32_compute=True
    )
    choices = apply_kernels(model, policy, fastest(winner))
    timed = [c for c in choices.values() if c.source == "measured"]
    assert timed and all(c.path == winner for c in timed), choices
    assert set(linear_paths(model).values()) == {winner}
    assert f"bfloat16 {winner}" in summarize(choices) or f"+bias {winner}" in summarize(choices)
    x = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    assert model.layers[0].mlp(x).dtype == torch.bfloat16


def test_fp32_copies_are_not_timed_where_not_allowed(tmp_path):
    calls = []

    def timer(path, rows, fn):
        calls.append(path)
        return 1e-6 * rows

    policy = KernelPolicy(cache_path=str(tmp_path / "k.json"), allow_fp32_weights=False, fp32_compute=True)
    choices = choose_kernels(bf16_model(), policy, timer)
    assert calls and "upcast" in calls and not {"fp32", "fp32-packed"} & set(calls)
    assert all(c.path in BF16_STORAGE_PATHS for c in choices.values())


def test_float32_compute_paths_are_timed_by_default_only_without_native_bf16(tmp_path, monkeypatch):
    """On a CPU with native bf16 they lost everywhere (docs/performance.md): not timed unless asked."""

    def timed_paths(**policy) -> set[str]:
        calls = []
        choose_kernels(
            bf16_model(),
            KernelPolicy(cache_path="", **policy),
            lambda path, rows, fn: calls.append(path) or 1e-6 * rows,
        )
        return set(calls)

    monkeypatch.setenv("SPLITSERVE_CPU_ISA", "avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512_bf16")
    assert not set(FP32_COMPUTE_PATHS) & timed_paths()
    assert "upcast" in timed_paths(fp32_compute=True)
    monkeypatch.setenv("SPLITSERVE_CPU_ISA", AVX2_ONLY)
    assert "upcast" in timed_paths() and not timed_paths(fp32_compute=False) & set(FP32_COMPUTE_PATHS)


@needs_onednn
@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # tied and untied LM head
def test_forced_fp32_compute_paths_reach_every_layer_and_the_lm_head(arch):
    for mode in FP32_COMPUTE_PATHS:
        model = bf16_model(arch)
        choices = apply_kernels(model, KernelPolicy(mode))
        assert set(linear_paths(model).values()) == {mode}, (mode, linear_paths(model))
        assert all(c.source == "forced" for c in choices.values())
        assert model.embed_tokens.weight.dtype == torch.bfloat16  # the lookup keeps its bf16 table
    fp32_model = bf16_model().float()  # on a float32 model the same modes are plain and packed
    apply_kernels(fp32_model, KernelPolicy("fp32-packed"))
    assert set(linear_paths(fp32_model).values()) == {"packed"}
    fp32_model = bf16_model().float()
    apply_kernels(fp32_model, KernelPolicy("upcast"))
    assert set(linear_paths(fp32_model).values()) == {"plain"}


def test_compare_fp32_sums_the_fastest_path_of_each_kind(tmp_path):
    policy = KernelPolicy(cache_path=str(tmp_path / "k.json"))
    fp32_wins = compare_fp32(bf16_model(), policy, fastest("fp32"))
    assert fp32_wins.shapes >= 4 and fp32_wins.fp32_faster and fp32_wins.fp32_ms < fp32_wins.bf16_ms
    bf16_wins = compare_fp32(bf16_model(), KernelPolicy(cache_path=str(tmp_path / "k2.json")), fastest("upcast"))
    assert not bf16_wins.fp32_faster
    assert not Fp32Comparison(0.0, 0.0, 0).fp32_faster  # nothing timed: no evidence for float32


def test_the_auto_decision_is_kept_in_the_cache_and_reused(tmp_path):
    """Engines of one machine and model loading one after the other (or at once: the cache's lock) take the
    first one's decision, so a prefill and a decode worker, or the ranks of one, compute in one dtype."""
    policy = KernelPolicy(cache_path=str(tmp_path / "k.json"))
    first = auto_dtype_comparison(bf16_model(), policy, fastest("fp32"))
    again = auto_dtype_comparison(bf16_model(), policy, fastest("upcast"))  # a clock that would decide otherwise
    assert (first.source, first.fp32_faster) == ("measured", True)
    assert (again.source, again.fp32_faster) == ("cached", True)
    assert len(json.loads((tmp_path / "k.json").read_text())["decisions"]) == 1
    uncached = auto_dtype_comparison(bf16_model(), KernelPolicy(cache_path=""), fastest("upcast"))
    assert (uncached.source, uncached.fp32_faster) == ("measured", False)


def test_loads_at_once_take_the_decision_in_turn(tmp_path):
    """A second engine loading while the first measures waits for the cache's lock, then reads the first's
    decision instead of measuring its own (which its clock would make the other way)."""
    policy = KernelPolicy(cache_path=str(tmp_path / "k.json"))
    started, release, results = threading.Event(), threading.Event(), {}

    def held(path, rows, fn):
        started.set()
        release.wait(10)
        return fastest("fp32")(path, rows, fn)

    def load(name, timer):
        results[name] = auto_dtype_comparison(bf16_model(), policy, timer)

    first = threading.Thread(target=load, args=("first", held))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=load, args=("second", fastest("upcast")))
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second load did not wait for the first's decision"
    release.set()
    first.join(30)
    second.join(30)
    assert (results["first"].source, results["first"].fp32_faster) == ("measured", True)
    assert (results["second"].source, results["second"].fp32_faster) == ("cached", True)


@pytest.mark.parametrize(("winner", "expected"), [("fp32", torch.float32), ("upcast", torch.bfloat16)])
def test_build_model_auto_float32_follows_the_measurement(winner, expected, bf16_dir, tmp_path):
    cfg = ModelConfig.from_model_dir(bf16_dir)
    policy = KernelPolicy(cache_path=str(tmp_path / "k.json"))
    model, checksum = loader.build_model(
        cfg, bf16_dir, torch.bfloat16, torch.device("cpu"), policy, auto_float32=True, timer=fastest(winner)
    )
    assert all(p.dtype == expected for p in model.parameters())
    assert model.dtype_note.startswith(str(expected).removeprefix("torch."))
    plain, plain_checksum = loader.build_model(
        cfg, bf16_dir, torch.bfloat16, torch.device("cpu"), KernelPolicy("plain")
    )
    assert checksum == plain_checksum  # of the weights as stored, whatever the model computes in
    assert plain.dtype_note == "" and plain.embed_tokens.weight.dtype == torch.bfloat16


def test_auto_float32_that_would_not_fit_warns_naming_the_sizes(bf16_dir, monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(loader, "available_memory_bytes", lambda: 1 << 20)
    cfg = ModelConfig.from_model_dir(bf16_dir)
    policy = KernelPolicy(cache_path=str(tmp_path / "k.json"))
    with caplog.at_level(logging.WARNING, logger="splitserve.engine.model.loader"):
        model, _ = loader.build_model(
            cfg, bf16_dir, torch.bfloat16, torch.device("cpu"), policy, auto_float32=True, timer=fastest("fp32")
        )
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert "float32 weights would take 50.0 MiB (bf16 25.0 MiB)" in caplog.text and "1.0 MiB available" in caplog.text


def test_auto_float32_applies_only_to_auto_bf16_on_a_cpu_without_native_bf16(bf16_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITSERVE_KERNEL_CACHE", str(tmp_path / "k.json"))
    monkeypatch.setattr(loader, "auto_dtype_comparison", lambda model, policy: Fp32Comparison(2.0, 1.0, 5))
    monkeypatch.setenv("SPLITSERVE_CPU_ISA", AVX2_ONLY)
    llm = LLM(bf16_dir, dtype="auto", num_blocks=32, linear_kernel="plain")
    assert llm.core.dtype == torch.float32 and llm.core.kv_cache.spec.dtype == torch.float32
    assert llm.core.linear_kernels.startswith("float32 (float32: no native bf16")
    asked = LLM(bf16_dir, dtype="bfloat16", num_blocks=32, linear_kernel="plain")
    assert asked.core.dtype == torch.bfloat16 and not asked.core.auto_float32_applies()
    monkeypatch.setenv("SPLITSERVE_CPU_ISA", "avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512_bf16")
    native = LLM(bf16_dir, dtype="auto", num_blocks=32, linear_kernel="plain")
    assert native.core.dtype == torch.bfloat16 and native.core.linear_kernels.startswith("bfloat16; ")
    assert EngineConfig(model_dir="m", linear_fp32_weights=False).kernel_policy.allow_fp32_weights is False


@pytest.mark.parametrize("kernel", ["plain", "packed", "auto"])
def test_auto_float32_greedy_is_exact_against_transformers_fp32(kernel, bf16_dir, monkeypatch, tmp_path):
    """``--dtype auto`` computing a bf16 checkpoint in float32 is transformers-fp32 on the same (upcast)
    weights: prefill logits allclose, greedy token for token for 48 tokens on 4 prompts (fp32 rule)."""
    if kernel == "packed" and not onednn_runs(torch.float32):
        pytest.skip("oneDNN is not available in this torch")
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("SPLITSERVE_KERNEL_CACHE", str(tmp_path / "k.json"))
    monkeypatch.setenv("SPLITSERVE_CPU_ISA", AVX2_ONLY)
    monkeypatch.setattr(loader, "auto_dtype_comparison", lambda model, policy: Fp32Comparison(2.0, 1.0, 5))
    llm = LLM(bf16_dir, dtype="auto", num_blocks=96, linear_kernel=kernel)
    assert llm.core.dtype == torch.float32
    if kernel != "auto":
        assert set(linear_paths(llm.model).values()) == {kernel}
    reference = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32).eval()
    prompt = make_prompts(1, [40])[0]
    with torch.inference_mode():
        ref_logits = reference(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(prompt_logits(llm, prompt).cpu(), ref_logits, atol=2e-4, rtol=2e-4)
    prompts = make_prompts(2, [3, 17, 30, 47])
    outputs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    refs = [hf_greedy(reference, p, 48) for p in prompts]
    assert_greedy_parity([o.token_ids for o in outputs], refs, 1e-3, len(prompts) - 1, f"auto-fp32/{kernel}")
    assert_not_degenerate([o.token_ids for o in outputs])
    assert_no_blocks_in_use(llm)
