"""A decode worker lost between a request's last token and its Finished message: the router's output
already ends the request, so it finishes there instead of migrating, which would re-prefill prompt +
output and generate one token past the end (seen once in the soak: 50 tokens for max_tokens 49)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.router.config import RouterConfig
from splitserve.router.generate import RequestRun, WorkerLost
from splitserve.router.metrics import RouterMetrics
from splitserve.v1 import splitserve_pb2 as pb
from tests.engine.tokenizer_fixtures import make_byte_level_tokenizer_dir

EOS = 7


class OneLegRun(RequestRun):
    """A request whose legs are scripted: each leg relays its tokens, then its decode worker is lost."""

    def __init__(self, legs: list[list[int]], sampling: SamplingParams, tokenizer: Tokenizer) -> None:
        lost = []
        dispatcher = SimpleNamespace(pool=SimpleNamespace(lost=lost.append), relayed=lambda n: None)
        config = RouterConfig(model_dir="unused", max_migrations=3)
        super().__init__("r", [1, 2, 3], sampling, tokenizer, dispatcher, config, RouterMetrics())
        self.legs, self.lost = list(legs), lost

    async def _leg(self):
        if not self.legs:
            raise AssertionError("a leg was started after the output had ended the request")
        yield self._relay(self.legs.pop(0))
        raise WorkerLost("decode", SimpleNamespace(worker_id="decode-0"), "decode worker decode-0 lost")


def run(legs, sampling, tokenizer) -> tuple[list[pb.GenerateResponse], OneLegRun]:
    request = OneLegRun(legs, sampling, tokenizer)

    async def collect():
        return [m async for m in request.run()]

    return asyncio.run(collect()), request


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    base = Tokenizer.from_model_dir(make_byte_level_tokenizer_dir(tmp_path_factory.mktemp("tok")))
    base.eos_token_ids = (EOS,)
    return base


@pytest.mark.parametrize(
    ("legs", "sampling", "reason", "tokens"),
    [
        ([[10, 11, 12]], SamplingParams(max_tokens=3, ignore_eos=True), pb.FINISH_REASON_LENGTH, 3),
        ([[10, 11], [12]], SamplingParams(max_tokens=3, ignore_eos=True), pb.FINISH_REASON_LENGTH, 3),
        ([[10, EOS]], SamplingParams(max_tokens=9), pb.FINISH_REASON_STOP, 2),
        ([[10, 20]], SamplingParams(max_tokens=9, stop_token_ids=(20,)), pb.FINISH_REASON_STOP, 2),
    ],
    ids=["max-tokens", "max-tokens-after-a-migration", "eos", "stop-token"],
)
def test_a_worker_lost_after_the_last_token_finishes_the_request(tokenizer, legs, sampling, reason, tokens):
    messages, request = run(legs, sampling, tokenizer)
    assert sum(len(m.token_ids) for m in messages) == tokens == len(request.output)
    assert messages[-1].finish_reason == reason
    assert request.migrations == len(legs) - 1
    assert [w.worker_id for w in request.lost] == ["decode-0"] * len(legs)


def test_an_eos_that_min_tokens_suppresses_or_ignore_eos_does_not_end_it(tokenizer):
    for sampling in (SamplingParams(max_tokens=4, min_tokens=3), SamplingParams(max_tokens=4, ignore_eos=True)):
        messages, request = run([[10, EOS], [11, 12]], sampling, tokenizer)
        assert request.migrations == 1 and request.output == [10, EOS, 11, 12]
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
