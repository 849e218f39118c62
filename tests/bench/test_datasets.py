"""Datasets: lengths within their stated ranges, deterministic under the seed, shared prefixes really
shared, Mooncake blocks identical for equal hash ids and arrivals at the trace's timestamps."""

from __future__ import annotations

import json

import numpy as np
import pytest

from splitserve.bench.datasets import PRESETS, BenchRequest, DatasetOptions, TokenRange, fit_to_context, make_requests
from splitserve.bench.mooncake import MOONCAKE_BLOCK_TOKENS, SAMPLE_TRACE, load_mooncake, read_trace

TOKENS = TokenRange.for_vocab(2048)


def make_dataset(name: str, **options) -> list[BenchRequest]:
    return make_requests(DatasetOptions(name=name, **{"num_prompts": 200, "max_model_len": 100_000, **options}), TOKENS)


def test_token_range_avoids_the_lowest_and_the_special_ids():
    assert (TOKENS.low, TOKENS.high) == (204, 1984)  # the tiny preset's specials are 2045..2047
    assert TokenRange.for_vocab(151_936).high < 151_643  # Qwen2.5's first special id
    assert TokenRange.for_vocab(128_256).high < 128_000  # Llama 3's
    with pytest.raises(ValueError, match="--vocab-size"):
        TokenRange.for_vocab(100)


def test_random_lengths_are_uniform_in_the_range_and_tokens_in_the_vocabulary():
    requests = make_dataset("random", input_len=100, output_len=20, range_ratio=0.5, random_prefix_len=7)
    input_lens = [r.prompt_len - 7 for r in requests]
    output_lens = [r.output_len for r in requests]
    assert min(input_lens) >= 50 and max(input_lens) <= 150 and max(input_lens) - min(input_lens) > 80
    assert min(output_lens) >= 10 and max(output_lens) <= 30
    assert all(r.prompt[:7] == requests[0].prompt[:7] for r in requests)  # the shared random prefix
    assert all(TOKENS.low <= t < TOKENS.high for r in requests for t in r.prompt)
    exact = make_dataset("random", input_len=64, output_len=8)
    assert {r.prompt_len for r in exact} == {64} and {r.output_len for r in exact} == {8}
    assert all(r.arrival_s is None for r in exact)


@pytest.mark.parametrize("name", ["random", "chat", "code", "summarize", "shared-prefix"])
def test_deterministic_under_the_seed(name):
    assert make_dataset(name, num_prompts=20, seed=5) == make_dataset(name, num_prompts=20, seed=5)
    assert make_dataset(name, num_prompts=20, seed=5) != make_dataset(name, num_prompts=20, seed=6)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_stay_within_their_caps_around_their_median(name):
    inputs, outputs = PRESETS[name]
    requests = make_dataset(name, num_prompts=400)
    input_lens = np.array([r.prompt_len for r in requests])
    output_lens = np.array([r.output_len for r in requests])
    assert inputs.low <= input_lens.min() and input_lens.max() <= inputs.high
    assert outputs.low <= output_lens.min() and output_lens.max() <= outputs.high
    assert np.median(input_lens) == pytest.approx(inputs.median, rel=0.15)
    assert np.median(output_lens) == pytest.approx(outputs.median, rel=0.15)


def test_presets_scale_to_a_small_model_and_fit_its_context():
    requests = make_dataset("chat", input_len=64, output_len=16, max_model_len=256)
    inputs, outputs = PRESETS["chat"]
    assert max(r.prompt_len for r in requests) <= round(inputs.high * 64 / inputs.median)
    assert np.median([r.output_len for r in requests]) == pytest.approx(16, rel=0.2)
    assert all(r.prompt_len + r.output_len <= 256 for r in requests)
    clipped = make_dataset("summarize", num_prompts=10, max_model_len=2048)
    assert all(r.prompt_len + r.output_len <= 2048 and r.output_len >= 200 for r in clipped)


def test_fit_to_context_cuts_the_output_to_half_then_the_prompt_tail():
    request = BenchRequest(list(range(100)), 80)
    assert fit_to_context(request, 200) is request
    fitted = fit_to_context(request, 120)
    assert fitted.output_len == 60 and fitted.prompt == list(range(60))
    assert fit_to_context(BenchRequest(list(range(100)), 10), 50).prompt == list(range(40))


def test_shared_prefix_groups_share_their_system_prompt():
    requests = make_dataset(
        "shared-prefix", num_prompts=40, shared_prefix_groups=4, shared_prefix_len=64, input_len=16, output_len=8
    )
    prefixes = {tuple(r.prompt[:64]) for r in requests}
    assert len(prefixes) == 4
    for prefix in prefixes:  # groups take turns: 10 requests each, with unique suffixes
        members = [r for r in requests if tuple(r.prompt[:64]) == prefix]
        assert len(members) == 10 and len({tuple(r.prompt[64:]) for r in members}) == 10
    assert all(r.prompt_len == 80 and r.output_len == 8 for r in requests)
    assert [tuple(r.prompt[:64]) for r in requests[:4]] != [tuple(r.prompt[:64]) for r in requests[4:8]]  # shuffled


def write_trace(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_mooncake_equal_hash_ids_give_identical_blocks(tmp_path):
    b = MOONCAKE_BLOCK_TOKENS
    trace = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 1000, "input_length": 2 * b + 100, "output_length": 10, "hash_ids": [0, 1, 2]},
            {"timestamp": 1500, "input_length": b + 7, "output_length": 20, "hash_ids": [0, 1]},
            {"timestamp": 3000, "input_length": 2 * b, "output_length": 5, "hash_ids": [3, 1]},
            {"timestamp": 3000, "input_length": b + 30, "output_length": 5, "hash_ids": [0]},
        ],
    )
    first, second, third, fourth = load_mooncake(trace, None, TOKENS, seed=1, time_scale=0.5)
    assert [r.prompt_len for r in (first, second, third, fourth)] == [2 * b + 100, b + 7, 2 * b, b + 30]
    assert first.prompt[: b + 7] == second.prompt  # blocks 0 and 1, the last one cut to input_length
    assert first.prompt[b : 2 * b] == third.prompt[b:]  # block 1 is the same wherever it stands
    assert first.prompt[:b] != third.prompt[:b]  # blocks 0 and 3 differ
    assert (
        fourth.prompt[:b] == first.prompt[:b] and fourth.prompt[b:] != first.prompt[b : b + 30]
    )  # own tokens past the ids
    assert [r.arrival_s for r in (first, second, third, fourth)] == pytest.approx([0.0, 0.25, 1.0, 1.0])
    assert [r.output_len for r in (first, second, third, fourth)] == [10, 20, 5, 5]
    again = load_mooncake(trace, 2, TOKENS, seed=1)
    assert [r.prompt for r in again] == [first.prompt, second.prompt]  # deterministic; --num-prompts takes the head
    assert load_mooncake(trace, 1, TOKENS, seed=2)[0].prompt != first.prompt


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "not JSON"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1}', "input_length"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "timestamp"),
        ('{"timestamp": 0, "input_length": 5, "output_length": "x"}', "output_length"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, -2]}', "hash_ids"),
    ],
)
def test_mooncake_errors_name_the_line_and_the_field(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:3: {message}"):
        read_trace(path)
    with pytest.raises(FileNotFoundError, match="--dataset-path"):
        read_trace(tmp_path / "missing.jsonl")


def test_the_sample_trace_loads_and_shares_prefixes():
    requests = make_requests(
        DatasetOptions(name="mooncake", dataset_path=str(SAMPLE_TRACE), max_model_len=4096), TOKENS
    )
    records = read_trace(SAMPLE_TRACE)
    assert len(requests) == len(records) >= 20
    assert requests[0].arrival_s == 0.0 and all(b.arrival_s >= a.arrival_s for a, b in zip(requests, requests[1:]))
    shared = sum(r.prompt[:MOONCAKE_BLOCK_TOKENS] == requests[0].prompt[:MOONCAKE_BLOCK_TOKENS] for r in requests)
    assert shared > len(requests) // 2
    with pytest.raises(ValueError, match="--dataset-path"):
        DatasetOptions(name="mooncake")


def test_options_are_checked_by_name():
    for kwargs, option in (
        ({"name": "sharegpt"}, "--dataset"),
        ({"num_prompts": 0}, "--num-prompts"),
        ({"input_len": 0}, "--input-len"),
        ({"range_ratio": 1.0}, "--range-ratio"),
        ({"shared_prefix_groups": 0}, "--shared-prefix-groups"),
        ({"max_model_len": 1}, "--max-model-len"),
    ):
        with pytest.raises(ValueError, match=option):
            DatasetOptions(**kwargs)
