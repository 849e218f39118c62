"""Profiles: the fit recovers known costs, the JSON round-trips and refuses bad fields by name, and a
profile measured on the tiny preset through the real engine and the real KV transfer is self-consistent."""

from __future__ import annotations

import json
import random

import pytest

from splitserve.planning.profile import (
    FEATURES,
    ModelShape,
    Profile,
    ProfileError,
    StepSample,
    StepShape,
    TransferSample,
    fit_steps,
    fit_transfer,
    nnls,
    relative_errors,
)

TRUE = {"const": 2e-3, "prefill_tokens": 5e-5, "prefill_attention": 1e-5, "decodes": 3e-4, "decode_context": 2e-4}


def step_time(shape: StepShape) -> float:
    return sum(TRUE[name] * x for name, x in zip(FEATURES, shape.features()))


def test_fit_recovers_the_costs_of_a_linear_device():
    rng = random.Random(0)
    shapes = [StepShape.of([(c, t)]) for t in (16, 64, 256, 1024) for c in (0, 512)]
    shapes += [StepShape.of([], [c] * b) for b in (1, 4, 16, 32) for c in (64, 512)]
    shapes += [StepShape.of([(0, 256)], [256] * 8)]
    samples = [StepSample(s, step_time(s) * (1 + rng.uniform(-0.01, 0.01))) for s in shapes]
    fitted = fit_steps(samples)
    for name in FEATURES:
        assert fitted[name] == pytest.approx(TRUE[name], rel=0.1), name


def test_fit_keeps_every_coefficient_non_negative():
    """A cost that shrinks with context (noise) must not come out negative."""
    samples = [StepSample(StepShape.of([], [c]), 1e-3 - c * 1e-8) for c in (64, 512, 2048)]
    assert all(v >= 0 for v in fit_steps(samples).values())
    assert nnls([[1.0, 0.0], [0.0, 1.0]], [2.0, -3.0]) == pytest.approx([2.0, 0.0])


def test_transfer_fit_is_latency_plus_bytes_over_bandwidth():
    samples = [TransferSample(n, 1e-3 + n / 2e9) for n in (1 << 16, 1 << 20, 1 << 24)]
    latency, bandwidth = fit_transfer(samples)
    assert latency == pytest.approx(1e-3, rel=1e-3) and bandwidth == pytest.approx(2e9, rel=1e-3)


def make_profile() -> Profile:
    model = ModelShape("m", "Qwen2ForCausalLM", 2, 128, 4, 2, 32, 384, 2048, 4096)
    steps = (StepSample(StepShape.of([(0, 64)]), 0.01),)
    return Profile(model, "float32", 4, "cpu", "cpu-x", 2, 1, dict(TRUE), 1e-3, 2e9, steps=steps)


def test_json_round_trip(tmp_path):
    profile = make_profile()
    profile.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again == profile
    assert again.kv_bytes(10) == 10 * 2 * 2 * 2 * 32 * 4
    assert again.block_bytes(16, 2) == 16 * 2 * 2 * 1 * 32 * 4, "a TP-2 rank holds one of the two KV heads"


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda d: d.update(version=9), "version"),
        (lambda d: d.pop("model"), "model"),
        (lambda d: d["step_coefficients"].pop("decodes"), "step_coefficients"),
        (lambda d: d["step_coefficients"].update(decodes=-1.0), r"step_coefficients\.decodes"),
        (lambda d: d.update(transfer_bytes_per_s=0), "transfer_bytes_per_s"),
        (lambda d: d.update(tensor_parallel_size=0), "tensor_parallel_size"),
    ],
)
def test_bad_profiles_are_refused_by_name(tmp_path, edit, field):
    data = make_profile().to_json()
    edit(data)
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=f"^{field}"):
        Profile.load(tmp_path / "p.json")


def test_a_measured_profile_of_the_tiny_preset(tiny_profile):
    profile = tiny_profile
    assert profile.model.num_layers == 2 and profile.model.num_kv_heads == 2 and profile.threads == 1
    assert len(profile.steps) == 4 + 4 + 1 and len(profile.transfers) == 2
    decode8 = [s for s in profile.steps if s.shape.decodes == 8 and s.shape.prefill_tokens == 0]
    assert sorted(round(s.shape.decode_context * 1e3 / 8) for s in decode8) == [34, 258], "contexts 32 and 256"

    prefill = next(
        s for s in profile.steps if s.shape.prefill_tokens == 128 and s.shape.prefill_attention > 128 * 256 / 1e3
    )
    assert prefill.shape.decodes == 0
    assert all(s.seconds > 0 for s in profile.steps)
    assert profile.transfers[1].bytes == 512 * 2 * 2 * 2 * 32 * 4
    assert profile.transfer_bytes_per_s > 0
    # The fit describes what it was fitted on: median error within 50% on a machine shared by the suite.
    errors = sorted(relative_errors(profile))
    assert errors[len(errors) // 2] < 0.5, errors


def test_a_tensor_parallel_profile_runs_rank_0s_plans_on_every_rank(tiny_model_dir):
    """TP 2: rank 0 measures, a spawned rank follows each step's plan; the profile says its TP size."""
    from splitserve.planning.measure import Grid, measure_profile

    grid = Grid((16, 64), (0,), (1, 4), (32,), ((16, 2, 32),), (16,), 1, 2)
    profile = measure_profile(str(tiny_model_dir), "float32", "cpu", 1, grid, transfers=False, tensor_parallel_size=2)
    assert profile.tensor_parallel_size == 2 and len(profile.steps) == 2 + 2 + 1
    assert all(s.seconds > 0 for s in profile.steps)
    assert profile.block_bytes(16, 2) * 2 == profile.block_bytes(16, 1), "a rank holds half the KV heads"
