"""scripts/gpu_bench.py's arithmetic: the prefill FLOPs behind its GEMM bound, its table rows and the targets;
and that it reports the decode path and backend its timed steps ran, from the engine's own count.

The script itself runs end to end in `make test` through `scripts/gpu_check.sh --device cpu`."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from splitserve.engine.model.config import ModelConfig
from splitserve.tools.make_model import PRESETS

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_bench.py"


@pytest.fixture(scope="module")
def gpu_bench():
    saved_path = list(sys.path)
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    for name in ("gpu_bench", "bench_engine"):  # it puts scripts/ on the path and imports bench_engine from there
        sys.modules.pop(name, None)
    sys.path[:] = saved_path


def test_prefill_flops_of_llama31_8b(gpu_bench):
    cfg = ModelConfig.from_dict(PRESETS["llama3.1-8b"])
    per_layer = (4096 + 2 * 1024) * 4096 + 4096 * 4096 + 2 * 14336 * 4096 + 4096 * 14336  # qkv, o, gate+up, down
    n = 2048
    expected = 2 * n * 32 * per_layer + 32 * 2 * n * n * 4096 + 2 * 128256 * 4096
    assert gpu_bench.prefill_flops(cfg, n) == expected


def make_result(ms_q1: float, ms_l1: float, ms_l32: float, bound_l1: float) -> dict:
    def decode(ms, bound=1.0):
        return {"ms_per_step": ms, "bytes_bound_ms": bound, "mean_context": 128.0, "tok_s": 1e3 / ms}

    return {
        "device": "cuda",
        "dtype": "bfloat16",
        "copy_bandwidth_gb_s": 4000.0,
        "gemm_peak_flops": 1e15,
        "models": {
            "qwen2.5-0.5b": {
                "splitserve": {"decode_1": decode(ms_q1), "prefill_2048": 1e5},
                "transformers": {"decode_1": {"ms_per_step": 2 * ms_q1}},
                "prefill_flops": {2048: 2048 * 2e9},
            },
            "llama3.1-8b": {
                "splitserve": {
                    "decode_1": decode(ms_l1, bound_l1),
                    "decode_32": decode(ms_l32),
                    "prefill_2048": "timed out",
                },
                "transformers": {},
                "prefill_flops": {2048: 2048 * 3e10},
            },
        },
    }


def test_targets_say_met_or_not(gpu_bench):
    met = gpu_bench.targets(make_result(ms_q1=3.0, ms_l1=10.0, ms_l32=12.0, bound_l1=7.0))
    assert met == [
        "qwen2.5-0.5b batch-1 decode <= 3.6 ms/step: 3.00 (met)",
        "llama3.1-8b batch-1 decode >= 0.6 of the bytes bound: 0.70 (met)",
        "llama3.1-8b batch-32 step <= 1.3x the batch-1 step: 1.20 (met)",
        "qwen2.5-0.5b prefill 2048 >= 0.5 of the GEMM peak: 0.20 (NOT met)",  # 1e5 tok/s * 2e9 FLOP / 1e15
    ]
    missed = gpu_bench.targets(make_result(ms_q1=4.0, ms_l1=20.0, ms_l32=30.0, bound_l1=7.0))
    assert [line.endswith("(NOT met)") for line in missed] == [True, True, True, True]


def test_rows_show_ratios_bounds_and_failures(gpu_bench):
    plan = gpu_bench.PLANS["cuda"]
    rows = {(r[0], r[2]): r for r in gpu_bench.rows(make_result(3.0, 10.0, 12.0, 7.0), plan)}
    assert rows[("qwen2.5-0.5b", "batch 1")][3:] == ["3.00", "6.00", "2.00x", "1.000 (bytes)", "0.33"]
    assert rows[("qwen2.5-0.5b", "2048 tokens")][3:] == ["100000", "-", "-", "500000 (GEMM)", "0.20"]
    assert rows[("llama3.1-8b", "2048 tokens")][3] == "timed out"
    assert rows[("llama3.1-8b", "batch 8")][3:5] == ["-", "-"]


def test_decode_ran_names_the_paths_the_engine_counted(gpu_bench):
    path, backend = gpu_bench.decode_ran(Counter({"graph": 30, "dynamic": 2}), "paged_decode triton")
    assert path == "static, CUDA graphs replayed in 30 of 32 timed steps; dynamic in 2 of 32 timed steps"
    assert backend == "paged_decode triton and gather (splitserve.engine.attention)"
    assert gpu_bench.decode_ran(Counter(), "paged_decode triton") == ("no decode step timed", "-")


@pytest.mark.parametrize("buckets_hold_the_batch", [True, False])
def test_the_report_says_what_the_timed_steps_ran_not_what_was_configured(
    gpu_bench, tiny_model_dir, monkeypatch, buckets_hold_the_batch
):
    """An engine configured static (CPU: no graphs) runs its timed decode steps static, eager, with the
    paged_decode backend; when its buckets hold no batch, the same configuration runs them dynamic."""
    from splitserve.engine import LLM
    from splitserve.engine.runner.static_decode import StaticDecodeInputs

    class StaticLLM(LLM):
        def __init__(self, *args, **options) -> None:
            super().__init__(*args, **{**options, "decode_path": "static", "kv_cache_bytes": 4 << 20})

    monkeypatch.setattr(gpu_bench, "LLM", StaticLLM)
    if not buckets_hold_the_batch:
        monkeypatch.setattr(StaticDecodeInputs, "fits", lambda self, items: False)
    args = SimpleNamespace(dtype="float32", device="cpu", threads=1)
    plan = gpu_bench.PLANS["cpu"]
    out = gpu_bench.bench_splitserve(tiny_model_dir, plan, args, gpu_bench.Budget(120))
    timed = (plan.new_tokens - 1) * len(plan.decode_batches)  # every step after the prefill, each batch
    assert all(isinstance(out["splitserve"][f"decode_{b}"], dict) for b in plan.decode_batches), out
    if buckets_hold_the_batch:
        assert out["decode_path"] == f"static, eager in {timed} of {timed} timed steps"
        # The backend the registry prefers for float32 on this CPU: the in-place kernel where it builds.
        import torch

        from splitserve.engine.attention.paged_decode import select_backend

        assert out["decode_backend"] == f"paged_decode {select_backend('cpu', torch.float32).name}"
    else:
        assert out["decode_path"] == f"dynamic in {timed} of {timed} timed steps"
        # The dynamic path reads the cache in place with that backend too, and gathers only where the reference
        # is all there is.
        import torch

        from splitserve.engine.attention.paged_decode import select_backend

        preferred = select_backend("cpu", torch.float32).name
        expected = "gather (splitserve.engine.attention)" if preferred == "torch" else f"paged_decode {preferred}"
        assert out["decode_backend"] == expected
