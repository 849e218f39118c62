"""Log-probabilities: the function itself, the sampler's (raw logits, before penalties and temperature),
and the engine's prompt and generated ones against transformers' log_softmax on an fp32 checkpoint."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import LLM
from splitserve.engine.sampling.logprobs import MAX_LOGPROBS, token_logprobs
from splitserve.engine.sampling.params import SamplingParams, SamplingParamsError
from splitserve.engine.sampling.sampler import Sampler
from splitserve.engine.scheduler.request import Request

from .parity import make_prompts, torch_threads

TOL = 1e-4


def test_token_logprobs_chosen_rank_and_top():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 0.0, 5.0, 1.0]])
    ref = torch.log_softmax(logits, dim=-1)
    out = token_logprobs(logits, [2, 3], [2, 0])
    assert out[0].token_id == 2 and out[0].rank == 2
    assert out[0].logprob == pytest.approx(float(ref[0, 2]), abs=1e-6)
    assert [t for t, _ in out[0].top] == [0, 2]
    assert out[0].top[0][1] == pytest.approx(float(ref[0, 0]), abs=1e-6)
    assert out[1].rank == 2 and out[1].top == ()
    assert token_logprobs(logits, [0, 2], 1)[1].top == ((2, pytest.approx(float(ref[1, 2]), abs=1e-6)),)
    assert token_logprobs(logits[:0], [], 3) == []


def test_logprobs_bounds_name_the_field():
    SamplingParams(logprobs=0, prompt_logprobs=MAX_LOGPROBS)
    with pytest.raises(SamplingParamsError, match=r"^logprobs: must be <= 20, got 21"):
        SamplingParams(logprobs=21)
    with pytest.raises(SamplingParamsError, match=r"^prompt_logprobs: must be >= 0"):
        SamplingParams(prompt_logprobs=-1)


def test_sampler_logprobs_are_of_the_raw_logits():
    """Penalties and temperature change what is sampled, not the log-probabilities reported."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    ref = torch.log_softmax(logits[0], dim=-1)
    request = Request("r", [1, 1, 1], SamplingParams(temperature=0.0, repetition_penalty=10.0, logprobs=2))
    token = Sampler()(logits.clone(), [request])[0]
    assert token == 2  # the penalty moved the argmax off token 1
    (entry,) = request.logprobs
    assert entry.token_id == 2 and entry.rank == 2
    assert entry.logprob == pytest.approx(float(ref[2]), abs=1e-6)
    assert [t for t, _ in entry.top] == [1, 2]
    hot = Request("h", [0], SamplingParams(temperature=2.0, seed=3, logprobs=1))
    token = Sampler()(logits.clone(), [hot])[0]
    assert hot.logprobs[0].logprob == pytest.approx(float(ref[token]), abs=1e-6)
    plain = Request("p", [0], SamplingParams(temperature=0.0))
    Sampler()(logits.clone(), [plain])
    assert plain.logprobs == []


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of ``tokens``: row i scores token i + 1."""
    return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


@pytest.mark.parametrize(("chunk", "decode_path"), [(None, "dynamic"), (5, "dynamic"), (None, "static")])
def test_engine_logprobs_match_transformers(tiny_model_dir, hf_model, device, chunk, decode_path):
    """Prompt (chunked or not, with a prefix-cache hit available) and generated log-probabilities (decoded on
    either path), and the top entries, as transformers' log_softmax computes them; the greedy token is the
    top-1 entry."""
    k = 3
    with torch_threads(1):
        llm = LLM(
            tiny_model_dir,
            dtype="float32",
            device=device,
            num_blocks=64,
            block_size=4,
            prefill_chunk_size=chunk,
            decode_path=decode_path,
        )
        prompts = make_prompts(5, [13, 9, 1])
        llm.generate(prompts[0], SamplingParams(max_tokens=1))  # leaves the prompt's blocks in the prefix cache
        sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=k, prompt_logprobs=k)
        outs = llm.generate(prompts, sampling)
        assert llm.runner.steps[decode_path] > 0 or llm.runner.steps["graph"] > 0
        for prompt, out in zip(prompts, outs):
            tokens = prompt + out.token_ids
            ref = hf_logprobs(hf_model, tokens)
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            entries = out.prompt_logprobs[1:] + out.logprobs
            assert len(entries) == len(tokens) - 1
            for i, entry in enumerate(entries):
                row = ref[i]
                assert entry.token_id == tokens[i + 1]
                chosen = float(row[tokens[i + 1]])
                assert entry.logprob == pytest.approx(chosen, abs=TOL)
                assert 1 + int((row > chosen + TOL).sum()) <= entry.rank <= 1 + int((row > chosen - TOL).sum())
                top = row.topk(k)
                assert len(entry.top) == k
                for (token, value), ref_value in zip(entry.top, top.values.tolist()):
                    assert value == pytest.approx(float(row[token]), abs=TOL)
                    assert value == pytest.approx(ref_value, abs=TOL)
            for entry in out.logprobs:  # greedy: the chosen token is the most likely one
                assert entry.rank == 1 and entry.top[0][0] == entry.token_id


def test_logprobs_off_by_default(tiny_model_dir):
    with torch_threads(1):
        llm = LLM(tiny_model_dir, dtype="float32", num_blocks=32)
        (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))
    assert out.logprobs is None and out.prompt_logprobs is None
