from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from splitserve.engine.sampling.params import SamplingParams, SamplingParamsError
from splitserve.engine.sampling.rng import keyed_uniform
from splitserve.engine.sampling.sampler import Sampler
from splitserve.engine.scheduler.request import Request


def make_request(seed: int = 0, prompt=(1, 2, 3), output=(), **sampling) -> Request:
    r = Request("r", list(prompt), SamplingParams(seed=seed, **sampling))
    r.token_ids.extend(output)
    return r


def logits_from_probs(probs: list[float], vocab: int = 8) -> torch.Tensor:
    p = torch.full((vocab,), 1e-12)
    p[: len(probs)] = torch.tensor(probs)
    return p.log()


def draw(logits: torch.Tensor, n: int = 2000, **sampling) -> Counter:
    sampler = Sampler()
    return Counter(sampler(logits.clone()[None], [make_request(seed=s, **sampling)])[0] for s in range(n))


def test_greedy_takes_argmax_per_row():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 4.9]])
    reqs = [make_request(temperature=0.0), make_request(temperature=0.0)]
    assert Sampler()(logits, reqs) == [1, 0]


def test_keyed_uniform_is_a_pure_function_in_range():
    values = [keyed_uniform(s, p) for s in range(50) for p in range(50)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert keyed_uniform(7, 11) == keyed_uniform(7, 11)
    assert len(set(values)) == len(values)
    mean = sum(values) / len(values)
    assert abs(mean - 0.5) < 0.02


def test_seeded_draw_does_not_depend_on_batch_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    reqs = [make_request(seed=100 + i, temperature=0.9, top_p=0.95) for i in range(6)]
    batched = Sampler()(logits.clone(), reqs)
    alone = [Sampler()(logits[i : i + 1].clone(), [reqs[i]])[0] for i in range(6)]
    reversed_batch = Sampler()(logits.flip(0).clone(), reqs[::-1])[::-1]
    assert batched == alone == reversed_batch


def test_sampling_follows_the_distribution():
    probs = [0.5, 0.3, 0.15, 0.05]
    counts = draw(logits_from_probs(probs), n=4000)
    for token, p in enumerate(probs):
        assert abs(counts[token] / 4000 - p) < 4 * math.sqrt(p * (1 - p) / 4000) + 0.005


def test_temperature_sharpens():
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    hot, cold = draw(logits, temperature=2.0), draw(logits, temperature=0.25)
    assert cold[0] > 1650 and hot[0] < cold[0] and hot[3] > cold[3]


def test_top_k_top_p_min_p_filters():
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    assert set(draw(logits, top_k=1)) == {0}
    assert set(draw(logits, top_k=2)) == {0, 1}
    assert set(draw(logits, top_p=0.7)) == {0, 1}
    assert set(draw(logits, top_p=0.81)) == {0, 1, 2}
    assert set(draw(logits, min_p=0.5)) == {0, 1}
    assert set(draw(logits, min_p=0.25)) == {0, 1, 2}
    assert set(draw(logits, top_k=3, top_p=0.9)) == {0, 1, 2}


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    req = make_request(prompt=(0, 1), output=(2, 2), temperature=0.0, repetition_penalty=2.0)
    Sampler._apply_penalties(logits[0], req)
    assert logits[0].tolist() == [1.0, -4.0, 0.5, 1.0]
    logits = torch.tensor([[2.0, 2.0, 2.0, 2.0]])
    req = make_request(prompt=(0,), output=(2, 2, 3), temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    Sampler._apply_penalties(logits[0], req)
    assert logits[0].tolist() == [2.0, 2.0, 1.0, 1.25]  # prompt token 0 untouched


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]])
    req = make_request(temperature=0.0, min_tokens=2, stop_token_ids=(2,))
    assert Sampler(eos_token_ids=(1,))(logits.clone(), [req]) == [3]
    req.token_ids.extend([3, 3])  # min_tokens reached
    assert Sampler(eos_token_ids=(1,))(logits.clone(), [req]) == [1]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": ["x" * 300]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"max_tokens": 1.5}, "max_tokens"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field
    assert field in str(e.value)


def test_sampling_params_from_dict_refuses_unknown_keys():
    assert SamplingParams.from_dict({"max_tokens": 3, "stop": ["a"]}).stop == ("a",)
    with pytest.raises(SamplingParamsError, match="tempreature"):
        SamplingParams.from_dict({"tempreature": 0.5})
