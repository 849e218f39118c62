"""Conditional disaggregation is one rule: the router's dispatcher and the simulator both decide by
``splitserve.router.policy.prefill_on_decode``, with the same inputs for the same request.

The rule is replaced by a spy that answers what the test forces: yes with both thresholds off, no with a
threshold every prompt is under. A caller with a rule of its own would answer the other way."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import splitserve.planning.simulator as simulator
import splitserve.router.dispatcher as dispatcher
from splitserve.engine.kv_cache.block_hash import block_hashes
from splitserve.router import policy
from splitserve.router.config import RouterConfig
from splitserve.router.policy import PrefillView
from tests.planning.test_simulator import disaggregated, prompt

PROMPT, MAX_TOKENS = prompt(40), 4


@pytest.fixture
def spy(monkeypatch):
    """The rule, replaced where both callers look it up; ``answer`` is what it says, ``calls`` its inputs."""
    assert dispatcher.prefill_on_decode is policy.prefill_on_decode, "the dispatcher has a rule of its own"
    assert simulator.prefill_on_decode is policy.prefill_on_decode, "the simulator has a rule of its own"
    state = SimpleNamespace(answer=False, calls=[])

    def rule(settings, workers, hashes, block_size, **inputs):
        state.calls.append({"hashes": list(hashes), "block_size": block_size, "workers": len(workers), **inputs})
        return state.answer

    for module in (dispatcher, simulator):
        monkeypatch.setattr(module, "prefill_on_decode", rule)
    return state


def router_decides(**thresholds) -> bool:
    pool = SimpleNamespace(prefill=[SimpleNamespace(view=PrefillView("p", credit=4))], decode=[SimpleNamespace()])
    d = dispatcher.Dispatcher(pool, RouterConfig(model_dir="m", **thresholds), block_size=16)
    ticket = dispatcher.Ticket("r", len(PROMPT), block_hashes(PROMPT, 16), future=None)
    return d.prefill_locally(ticket, tokens_left=MAX_TOKENS)


def simulator_decides(**thresholds) -> bool:
    _, sim = simulator.simulate(disaggregated(**thresholds), [(PROMPT, MAX_TOKENS)], [0.0])
    (job,) = sim.done
    assert not job.error and len(job.output) == MAX_TOKENS
    return job.local


@pytest.mark.parametrize(
    ("answer", "thresholds"),
    [(True, {}), (False, {"local_prefill_max_tokens": 10_000})],
    ids=["yes-with-the-rule-off", "no-under-the-threshold"],
)
def test_the_router_and_the_simulator_follow_the_one_rule(spy, answer, thresholds):
    spy.answer = answer
    assert router_decides(**thresholds) is answer
    assert simulator_decides(**thresholds) is answer
    router_call, sim_call = spy.calls[0], spy.calls[1]
    assert router_call == sim_call, "the same request must reach the rule with the same inputs"
    assert router_call["num_tokens"] == 40 and router_call["tokens_left"] == MAX_TOKENS
    assert router_call["waiting_tokens"] == 0 and router_call["decode_workers"] == 1


def test_without_the_spy_both_give_the_rules_answer():
    for thresholds, expected in (({"local_prefill_max_tokens": 40}, True), ({"local_prefill_max_tokens": 39}, False)):
        assert router_decides(**thresholds) is expected
        assert simulator_decides(**thresholds) is expected
