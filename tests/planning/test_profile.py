"""Profiles: the fit recovers known costs, the JSON round-trips (strict JSON both ways) and refuses bad
fields by name, a transfer fit the samples do not determine is refused rather than made up, and a profile
measured on the tiny preset through the real engine and the real KV transfer is self-consistent; measured
without the transfer it has none, and simulate and plan say so (tests/planning/test_no_transfer.py)."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest

from splitserve.deploy.profile import (
    FEATURES,
    MEASURED,
    MissingPart,
    ModelShape,
    Profile,
    ProfileError,
    StepSample,
    StepShape,
    TransferCost,
    TransferFitError,
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
    fit = fit_transfer(samples)
    assert fit.latency_s == pytest.approx(1e-3, rel=1e-3) and fit.bytes_per_s == pytest.approx(2e9, rel=1e-3)


@pytest.mark.parametrize(
    "times,why",
    [
        # what the tiny profile once held: the larger transfer was the faster, and the bandwidth came out infinite
        ({16384: 6.624e-3, 262144: 2.180e-3}, "do not grow with the bytes"),
        ({1 << 16: 2e-3, 1 << 20: 2e-3, 1 << 24: 2e-3}, "do not grow with the bytes"),
        ({1 << 16: 1e-6, 1 << 20: 0.5e-3, 1 << 24: 8.4e-3}, "fixed cost at 0"),  # below a line through 0
        ({1 << 20: 1e-3}, "at least two sizes"),
        ({1 << 16: 0.0, 1 << 20: 1e-3}, r"transfers\[0\]\.seconds"),
    ],
)
def test_transfer_fit_refuses_samples_that_do_not_determine_it(times, why):
    samples = [TransferSample(n, t) for n, t in times.items()]
    with pytest.raises(TransferFitError, match=why):
        fit_transfer(samples)


def test_a_transfer_the_samples_do_not_determine_is_left_out_and_labelled(tmp_path):
    """What ``splitserve profile`` writes when the fit is refused: the samples, no transfer, and why."""
    from splitserve.planning.measure import fit_transfer_part

    samples = (TransferSample(16384, 6.624e-3), TransferSample(262144, 2.180e-3))
    fit, label = fit_transfer_part(list(samples))
    assert fit is None
    assert label.startswith("not measured: the samples did not determine a fit (transfers: the times do not grow")
    profile = dataclasses.replace(make_profile(), transfer=None, transfers=samples, parts={"transfer": label})
    profile.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again == profile and again.parts["transfer"] == label and again.transfer is None
    with pytest.raises(MissingPart, match=r"^transfer: .* \(not measured: the samples did not determine"):
        again.transfer_s(1024)


def make_profile() -> Profile:
    model = ModelShape("m", "Qwen2ForCausalLM", 2, 128, 4, 2, 32, 384, 2048, 4096)
    steps = (StepSample(StepShape.of([(0, 64)]), 0.01),)
    return Profile(model, "float32", 4, "cpu", "cpu-x", 2, 1, dict(TRUE), TransferCost(1e-3, 2e9), steps=steps)


def test_json_round_trip(tmp_path):
    profile = make_profile()
    profile.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again == profile
    assert again.kv_bytes(10) == 10 * 2 * 2 * 2 * 32 * 4
    assert again.block_bytes(16, 2) == 16 * 2 * 2 * 1 * 32 * 4, "a TP-2 rank holds one of the two KV heads"
    assert again.parts == {"steps": "not measured", "transfer": "not measured", "serving": "not measured"}


@pytest.mark.parametrize(
    "where,value",
    [("transfer.bytes_per_s", "Infinity"), ("steps[0].seconds", "NaN"), ("notes.x", "-Infinity")],
)
def test_loading_is_strict_json(tmp_path, where, value):
    """Python's json reads Infinity and NaN by default; a profile holding one is refused, naming the field."""
    data = make_profile().to_json()
    data["notes"]["x"] = 0.5
    text = json.dumps(data)
    key = where.rsplit(".", 1)[-1]
    old = {"bytes_per_s": '"bytes_per_s": 2000000000.0', "seconds": '"seconds": 0.01', "x": '"x": 0.5'}[key]
    assert text.count(old) == 1
    (tmp_path / "p.json").write_text(text.replace(old, f'"{key}": {value}'))
    with pytest.raises(ProfileError, match=f"^{re.escape(where)}: {value} is not a number"):
        Profile.load(tmp_path / "p.json")


def test_saving_is_strict_json(tmp_path):
    profile = make_profile()
    profile.notes["bad"] = float("inf")
    with pytest.raises(ProfileError, match="Out of range float"):
        profile.save(tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda d: d.update(version=9), "version"),
        (lambda d: d.pop("model"), "model"),
        (lambda d: d["step_coefficients"].pop("decodes"), "step_coefficients"),
        (lambda d: d["step_coefficients"].update(decodes=-1.0), r"step_coefficients\.decodes"),
        (lambda d: d.update(version=1), "version: expected 2, got 1: a profile written before its parts"),
        (lambda d: d["transfer"].update(bytes_per_s=0), r"transfer\.bytes_per_s"),
        (lambda d: d["transfer"].update(latency_s=-1.0), r"transfer\.latency_s"),
        (lambda d: d.update(transfer=5), "transfer"),
        (lambda d: d.pop("parts"), "parts"),
        (lambda d: d["parts"].update(transfer="measured"), r"parts\.transfer: measured, but"),
        (lambda d: d["parts"].update(weights="measured"), r"parts\.weights: not a part"),
        (lambda d: d.update(transfer=None, parts={**d["parts"], "transfer": "measured"}), r"parts\.transfer"),
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
    assert len(profile.steps) == 4 + 4 + 1
    # 16 and 512 tokens, and the size that moves transfer_min_bytes (32 MiB: 32768 tokens of 1 KiB)
    assert [t.bytes for t in profile.transfers] == [n * 1024 for n in (16, 512, 32768)]
    decode8 = [s for s in profile.steps if s.shape.decodes == 8 and s.shape.prefill_tokens == 0]
    assert sorted(round(s.shape.decode_context * 1e3 / 8) for s in decode8) == [34, 258], "contexts 32 and 256"

    prefill = next(
        s for s in profile.steps if s.shape.prefill_tokens == 128 and s.shape.prefill_attention > 128 * 256 / 1e3
    )
    assert prefill.shape.decodes == 0
    assert all(s.seconds > 0 for s in profile.steps)
    assert profile.transfers[1].bytes == 512 * 2 * 2 * 2 * 32 * 4
    assert profile.parts == {"steps": MEASURED, "transfer": MEASURED, "serving": "not measured"}
    assert profile.transfer.latency_s > 0 and 0 < profile.transfer.bytes_per_s < 1e12
    assert profile.notes["transfer_path"].startswith("two processes")
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
