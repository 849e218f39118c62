"""The offline engine end to end on the tiny preset: text, stops, seeds, aborts, dtypes, bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.model.config import ModelConfig, ModelConfigError
from splitserve.engine.model.loader import CheckpointError
from tests.engine.parity import prompt_logits

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir, device) -> LLM:
    return LLM(tiny_model_dir, dtype="float32", device=device, num_blocks=128)


def assert_clean(llm: LLM) -> None:
    llm.check_integrity()
    assert llm.kv_status()["in_use"] == 0
    assert not llm.has_unfinished_requests()


def test_text_prompts_and_output_text(llm):
    outs = llm.generate(["Hello there", "The engine"], GREEDY)
    for out in outs:
        assert len(out.token_ids) == 24 and out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert out.text
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("Hello there")
    assert_clean(llm)


def test_stop_string_cuts_text_and_finishes(llm):
    full = llm.generate("Once upon a time", GREEDY)[0]
    # Pick a stop string that first appears in the middle of the greedy text.
    start = len(full.text) // 2
    stop = full.text[start : start + 3]
    first = full.text.find(stop)
    assert stop.strip() and first > 0
    out = llm.generate(
        "Once upon a time", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:first]
    assert len(out.token_ids) < 24
    assert_clean(llm)


def test_stop_token_ids_and_max_tokens_one(llm):
    full = llm.generate([[5, 6, 7]], GREEDY)[0]
    stop_id = full.token_ids[5]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    one = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert one.token_ids == full.token_ids[:1] and one.finish_reason == "length"
    assert_clean(llm)


def test_eos_stops_unless_ignored(llm):
    eos = llm.tokenizer.eos_token_ids[0]
    # Force EOS to be the greedy choice via a stop: find the greedy first token, then treat it as EOS.
    first = llm.generate([[9, 10]], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    llm.scheduler.eos_token_ids = frozenset({first, eos})
    try:
        out = llm.generate([[9, 10]], SamplingParams(max_tokens=8, temperature=0.0))[0]
        assert out.finish_reason == "stop" and out.token_ids == [first]
        out = llm.generate([[9, 10]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
        assert len(out.token_ids) == 8
    finally:
        llm.scheduler.eos_token_ids = frozenset(llm.tokenizer.eos_token_ids)
    assert_clean(llm)


def test_seeded_sampling_is_reproducible_and_independent_of_batch(llm):
    sp = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([[1, 2, 3, 4]], sp)[0].token_ids
    others = [SamplingParams(max_tokens=30, temperature=0.7, seed=s, ignore_eos=True) for s in range(5)]
    batch = llm.generate([[11, 12], [1, 2, 3, 4], [40] * 20, [3], [7, 8, 9], [100, 200]], [others[0], sp, *others[1:]])
    assert batch[1].token_ids == alone
    different = llm.generate(
        [[1, 2, 3, 4]], SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    )[0].token_ids
    assert different != alone
    assert_clean(llm)


def test_abort_mid_generation_frees_blocks(llm):
    ids = [llm.add_request([i + 1] * (10 + i), SamplingParams(max_tokens=50, temperature=0.0)) for i in range(4)]
    for _ in range(3):
        llm.step()
    assert llm.kv_status()["in_use"] > 0
    for rid in ids:
        llm.abort(rid)
    assert_clean(llm)


def test_continuous_batching_admits_new_requests_while_decoding(llm):
    a = llm.add_request([1, 2, 3], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    llm.step()
    llm.step()
    b = llm.add_request([4, 5, 6], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finished = {}
    steps = 0
    while llm.has_unfinished_requests():
        steps += 1
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = (steps, out)
    assert finished[b][0] < finished[a][0]  # b joined later and left earlier
    assert len(finished[a][1].token_ids) == 10
    assert_clean(llm)


def test_bad_input_is_refused_by_name(llm):
    with pytest.raises(ValueError, match="token_ids"):
        llm.add_request([1, 2, llm.model_config.vocab_size])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.add_request([])
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.add_request([1], SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(ValueError, match="request_id"):
        llm.add_request([1], request_id="dup")
        llm.add_request([1], request_id="dup")
    llm.abort("dup")
    assert_clean(llm)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_fp32(tiny_model_dir, llm, dtype, device):
    half = LLM(tiny_model_dir, dtype=dtype, device=device, num_blocks=64)
    assert half.kv_cache.tensor.dtype == getattr(torch, dtype)
    prompt = list(range(1, 40))
    ref = prompt_logits(llm, prompt).cpu()
    got = prompt_logits(half, prompt).cpu()
    assert got.dtype == torch.float32
    rel = (got - ref).norm() / ref.norm()
    assert rel < 0.05, f"{dtype} logits differ from fp32 by {rel:.3f}"
    out = half.generate([prompt], GREEDY)[0]
    assert len(out.token_ids) == 24
    assert_clean(half)


def test_sharded_checkpoint_and_config_forms_load_the_same(tmp_path, tiny_model_dir, llm, device):
    from splitserve.tools.make_model import make_model

    sharded = make_model(
        "tiny", tmp_path / "sharded", dtype="float32", seed=0, max_shard_bytes=400_000, config_format="current"
    )
    assert (sharded / "model.safetensors.index.json").is_file()
    assert "rope_parameters" in json.loads((sharded / "config.json").read_text())
    assert ModelConfig.from_model_dir(sharded) == ModelConfig.from_model_dir(tiny_model_dir)
    other = LLM(sharded, dtype="float32", device=device, num_blocks=64)
    assert other.weights_checksum == llm.weights_checksum  # same tensors, whatever the shard layout
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert torch.equal(prompt_logits(other, prompt).cpu(), prompt_logits(llm, prompt).cpu())
    reseeded = make_model("tiny", tmp_path / "seed1", dtype="float32", seed=1)
    assert LLM(reseeded, dtype="float32", num_blocks=8).weights_checksum != llm.weights_checksum
    assert LLM(tiny_model_dir, dtype="float32", num_blocks=8).weights_checksum == llm.weights_checksum


def test_missing_files_and_unknown_architecture(tmp_path, tiny_model_dir):
    for name, exc, pattern in [
        ("config.json", FileNotFoundError, "config.json"),
        ("tokenizer.json", FileNotFoundError, "tokenizer.json"),
        ("model.safetensors", FileNotFoundError, "model.safetensors"),
    ]:
        broken = tmp_path / f"no-{name}"
        shutil.copytree(tiny_model_dir, broken)
        (broken / name).unlink()
        with pytest.raises(exc, match=pattern):
            LLM(broken, num_blocks=8)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ModelConfigError, match="GPT2LMHeadModel"):
        ModelConfig.from_dict({**cfg, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ModelConfigError, match="rope_type"):
        ModelConfig.from_dict({**cfg, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ModelConfigError, match="hidden_size"):
        ModelConfig.from_dict({k: v for k, v in cfg.items() if k != "hidden_size"})
    wrong = tmp_path / "wrong-shape"
    shutil.copytree(tiny_model_dir, wrong)
    (wrong / "config.json").write_text(json.dumps({**cfg, "intermediate_size": cfg["intermediate_size"] * 2}))
    with pytest.raises(CheckpointError, match="mlp"):
        LLM(wrong, num_blocks=8)
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_model_dir, dtype="int8", num_blocks=8)
