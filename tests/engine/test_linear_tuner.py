"""The linear-kernel tuner: decisions from (fake) timings, the cache and its key, split routing, config checks."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.core import EngineConfig
from splitserve.engine.model import cpu_gemv, linear_tuner
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.linear_tuner import (
    CACHE_VERSION,
    FORCED_SPLIT_ROWS,
    KernelPolicy,
    ShapeKey,
    apply_kernels,
    choose_kernels,
    decide,
    machine_key,
    measure,
)
from splitserve.engine.model.transformer import CausalLM, Linear, onednn_runs
from tests.conftest import PACKABLE_ARCH_CONFIGS
from tests.engine.parity import linear_paths, torch_threads

needs_onednn = pytest.mark.skipif(not onednn_runs(torch.float32), reason="oneDNN is not available in this torch")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


def make_model(arch: str = "qwen2") -> CausalLM:
    """A packable-size model with random weights (no checkpoint: the tuner only needs shapes)."""
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_dict({**PACKABLE_ARCH_CONFIGS[arch], "num_hidden_layers": 1}))
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    return model.requires_grad_(False)


def random_linear(in_features: int, out_features: int, seed: int, std: float = 0.02) -> Linear:
    """A plain Linear with a bias, random weights of ``std`` and a standard-normal bias."""
    torch.manual_seed(seed)
    layer = Linear(in_features, out_features, bias=True).requires_grad_(False)
    layer.weight.normal_(0, std)
    layer.bias.normal_()
    return layer


def make_timer(ms: dict[str, float], calls: list | None = None, crossover: int | None = None):
    """A fake clock: path p costs ms[p] per row (a path not in ``ms``, as "gemv" where it is built, 1 s a row:
    never chosen); with ``crossover``, plain costs 10x more above that many rows."""

    def timer(path, rows, fn):
        if calls is not None:
            calls.append((path, rows))
        cost = ms.get(path, 1e3) * rows * (10 if crossover is not None and path == "plain" and rows > crossover else 1)
        return cost / 1e3

    return timer


@needs_onednn
@pytest.mark.parametrize(
    ("ms", "expected"), [({"plain": 1.0, "packed": 2.0}, "plain"), ({"plain": 2.0, "packed": 1.0}, "packed")]
)
def test_the_faster_of_two_fake_timed_candidates_wins(ms, expected, tmp_path):
    choices = choose_kernels(make_model(), KernelPolicy(cache_path=str(tmp_path / "k.json")), make_timer(ms))
    timed = [c for c in choices.values() if c.source == "measured"]
    assert timed and all(c.path == expected for c in timed)
    assert all(c.path == "plain" for c in choices.values() if c.source == "untimed")


def test_split_only_where_it_beats_both_and_is_allowed():
    rows = (1, 4, 16, 64, 256)
    packed = {m: 3.0 * m for m in rows}
    plain_wins_small = {"plain": {m: 1.0 * m if m <= 4 else 30.0 * m for m in rows}, "packed": packed}
    assert decide(plain_wins_small, allow_split=True) == ("split", 4)
    assert decide(plain_wins_small, allow_split=False)[0] == "packed"
    close = {"plain": {m: 1.0 * m for m in rows}, "packed": {m: 1.01 * m for m in rows}}
    assert decide(close, allow_split=True) == ("plain", 0)


def test_one_timed_row_count_chooses_a_single_path():
    """An LM head timed at one row count only (max_num_seqs below the grid's second row) has no split to
    weigh: the faster path wins (this raised on an empty choice of thresholds)."""
    assert decide({"plain": {1: 2.0}, "packed": {1: 1.0}}, allow_split=True) == ("packed", 0)
    assert decide({"plain": {1: 1.0}, "packed": {1: 2.0}}, allow_split=True) == ("plain", 0)


@needs_onednn
def test_cache_round_trips_and_is_keyed_by_machine_and_threads(tmp_path):
    policy = KernelPolicy(cache_path=str(tmp_path / "kernels.json"))
    model, calls = make_model(), []
    first = choose_kernels(model, policy, make_timer({"plain": 2.0, "packed": 1.0}, calls), machine="cpu A threads 1")
    assert calls and json.loads((tmp_path / "kernels.json").read_text())["version"] == CACHE_VERSION
    calls.clear()
    again = choose_kernels(model, policy, make_timer({"plain": 2.0, "packed": 1.0}, calls), machine="cpu A threads 1")
    assert not calls, "a second load with the same machine key must time nothing"
    assert {k: c.path for k, c in again.items()} == {k: c.path for k, c in first.items()}
    assert {c.source for c in again.values()} <= {"cached", "untimed"}
    other = choose_kernels(model, policy, make_timer({"plain": 1.0, "packed": 2.0}, calls), machine="cpu A threads 2")
    assert calls and all(c.path == "plain" for c in other.values())
    isa = {"avx2": True, "avx512f": False}
    keys = {machine_key(t, {"cpu_model": cpu, "isa": isa}) for cpu in ("EPYC 1", "EPYC 2") for t in (1, 2)}
    keys.add(machine_key(1, {"cpu_model": "EPYC 1", "isa": {**isa, "avx512f": True}}))
    assert len(keys) == 5


def test_machine_key_changes_with_the_panel_kernels_source(tmp_path, monkeypatch):
    """Timings of an older build of the panel kernel are not reused: its source is in the key."""
    machine = {"cpu_model": "EPYC 1", "isa": {"avx2": True}}
    before = machine_key(1, machine)
    assert machine_key(1, machine) == before
    changed = tmp_path / "cpu_gemv.cpp"
    changed.write_bytes(cpu_gemv.SOURCE.read_bytes() + b"\n// another build\n")
    monkeypatch.setattr(cpu_gemv.EXTENSION, "source", changed)
    assert machine_key(1, machine) != before


@needs_onednn
def test_forced_split_routes_small_inputs_plain_and_large_ones_packed():
    layer = random_linear(64, 4096, seed=1)
    reference = layer.weight.clone()
    layer.use("split", split_rows=4)
    assert layer.path == "split"
    layer.weight.zero_()  # the plain copy now gives the bias alone: which kernel ran shows in the output
    for rows in (1, 4, 5, 32):
        x = torch.randn(rows, 64)
        expected = layer.bias.expand(rows, -1) if rows <= 4 else F.linear(x, reference, layer.bias)
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


@needs_onednn
@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # tied and untied LM head
def test_forced_paths_reach_every_layer_and_the_lm_head(arch):
    for mode in ("plain", "packed", "split"):
        model = make_model(arch)
        choices = apply_kernels(model, KernelPolicy(mode))
        assert set(linear_paths(model).values()) == {mode}, (mode, linear_paths(model))
        assert all(c.source == "forced" for c in choices.values())
        head = model.lm_head
        if mode == "split":
            assert head.split_rows == FORCED_SPLIT_ROWS
            if arch == "qwen2":  # tied: the split head shares the embedding matrix instead of copying it
                assert head.weight is model.embed_tokens.weight
    key = ShapeKey(2048, 512, "float32", False)
    assert key in choices and str(key) == "2048x512 float32"


def test_engine_config_checks_linear_kernel():
    with pytest.raises(ValueError, match="linear_kernel: must be one of auto, plain, packed, split"):
        EngineConfig(model_dir="m", linear_kernel="fast")
    with pytest.raises(ValueError, match="linear_kernel: 'split' contradicts pack_weights=False"):
        EngineConfig(model_dir="m", linear_kernel="split", pack_weights=False)
    with pytest.raises(ValueError, match="linear_kernel: 'packed' is a CPU kernel"):
        EngineConfig(model_dir="m", linear_kernel="packed", device="cuda")
    assert EngineConfig(model_dir="m", pack_weights=False).kernel_policy.mode == "plain"
    assert EngineConfig(model_dir="m", max_num_seqs=8).kernel_policy == KernelPolicy("auto", None, lm_head_rows=8)


@needs_onednn
def test_a_row_count_slower_than_the_next_is_timed_again():
    """A reading hit by another process (m = 4 slower than m = 16) is retimed; the spike does not stick."""
    calls, spiked = [], set()

    def timer(path, rows, fn):
        calls.append((path, rows))
        if path == "plain" and rows == 4 and len([c for c in calls if c == ("plain", 4)]) <= 4:
            spiked.add(rows)
            return 1.0  # a second, far slower than any other reading
        return rows * 1e-6

    times = measure(torch.randn(1024, 512), None, (1, 4, 16), timer)
    assert spiked and times["plain"][4] == pytest.approx(4e-3)


@needs_onednn
def test_timings_that_stay_spiky_are_used_but_not_cached(tmp_path):
    policy = KernelPolicy(cache_path=str(tmp_path / "kernels.json"))

    def busy(path, rows, fn):  # one row always slower than four: another process on every reading
        return (10e-3 if rows == 1 else rows * 1e-3) * (1 if path == "packed" else 2)

    choices = choose_kernels(make_model(), policy, busy, machine="cpu B threads 1")
    timed = [c for c in choices.values() if c.times_ms]
    assert timed and all(c.path == "packed" and "not cached" in c.source for c in timed)
    assert not (tmp_path / "kernels.json").exists()


def test_every_timed_call_finds_the_weight_out_of_the_caches(monkeypatch):
    """Each call the tuner times follows an eviction (as in a model's step, where the rest of the model's
    weights pushed this one out), on the real clock by default."""
    events = []

    def timer(path, rows, fn):
        events.append(("time", path, rows))
        return 1e-6 * rows

    weight = torch.zeros(1024, 512)
    measure(weight, None, (1, 4), timer, ("plain",), evict=lambda: events.append(("evict",)))
    assert events and len(events) % 2 == 0
    assert all(e == ("evict",) for e in events[0::2]) and all(e[0] == "time" for e in events[1::2])

    made = []
    monkeypatch.setattr(linear_tuner, "cache_evictor", lambda: made.append(1) or (lambda: None))
    measure(weight, None, (1,), linear_tuner.wall_clock, ("plain",))
    assert made == [1]  # the real clock evicts
    measure(weight, None, (1,), timer, ("plain",))
    assert made == [1]  # a fake clock needs no eviction
    monkeypatch.undo()
    reads = linear_tuner.cache_evictor(1 << 20)
    assert float(reads()) == (1 << 20) // 4
