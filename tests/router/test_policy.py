"""Routing policies and validation of the router's pieces, without workers (pure Python, torch-free)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from splitserve.engine.kv_cache.block_hash import block_hashes
from splitserve.router.config import RouterConfig
from splitserve.router.policy import DecodeView, PrefillView, choose_decode, choose_prefill, prefill_on_decode

PROMPT = list(range(64))  # 4 full blocks of 16
HASHES = block_hashes(PROMPT, 16)


def test_prefix_aware_prefers_the_worker_holding_the_prefix():
    cold = PrefillView("cold", credit=4)
    warm = PrefillView("warm", credit=4, cached_hashes=set(HASHES[:3]))
    assert warm.cached_prefix_blocks(HASHES) == 3
    assert choose_prefill([cold, warm], "prefix_aware", HASHES, 16, overlap_weight=16).worker_id == "warm"


def test_prefix_aware_weighs_queued_tokens_against_cache_hits():
    busy_warm = PrefillView("warm", credit=4, queued_tokens=100, cached_hashes=set(HASHES))  # cost 16*0+100
    idle_cold = PrefillView("cold", credit=4)  # cost 16*4 = 64
    assert choose_prefill([busy_warm, idle_cold], "prefix_aware", HASHES, 16, 16).worker_id == "cold"
    assert choose_prefill([busy_warm, idle_cold], "prefix_aware", HASHES, 16, 40).worker_id == "warm"


def test_a_gap_in_the_cached_chain_ends_the_hit():
    w = PrefillView("w", credit=1, cached_hashes={HASHES[0], HASHES[2], HASHES[3]})
    assert w.cached_prefix_blocks(HASHES) == 1


def test_credit_and_health_gate_every_policy():
    full = PrefillView("full", credit=0)
    down = PrefillView("down", credit=3, healthy=False)
    ok = PrefillView("ok", credit=1, queued_tokens=1000)
    for policy in ("prefix_aware", "least_loaded", "round_robin"):
        assert choose_prefill([full, down, ok], policy, HASHES, 16, 16).worker_id == "ok"
        assert choose_prefill([full, down], policy, HASHES, 16, 16) is None


def test_least_loaded_and_round_robin():
    a, b = PrefillView("a", credit=2, queued_tokens=50, inflight=1), PrefillView("b", credit=2, queued_tokens=10)
    assert choose_prefill([a, b], "least_loaded", HASHES, 16, 16).worker_id == "b"
    picks = [choose_prefill([a, b], "round_robin", HASHES, 16, 16, turn=t).worker_id for t in range(4)]
    assert picks == ["a", "b", "a", "b"]


def test_decode_choice_needs_room_then_prefers_fewer_requests():
    small = DecodeView("small", free_blocks=3, requests=0)
    busy = DecodeView("busy", free_blocks=100, requests=9)
    idle = DecodeView("idle", free_blocks=50, requests=1)
    assert choose_decode([small, busy, idle], blocks_needed=5).worker_id == "idle"
    assert choose_decode([small, busy, idle], blocks_needed=5, exclude=["idle"]).worker_id == "busy"
    assert choose_decode([small], blocks_needed=5) is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"routing_policy": "random"}, "routing_policy"),
        ({"max_queue": 0}, "max_queue"),
        ({"lease_timeout_s": 0}, "lease_timeout_s"),
        ({"overlap_weight": -1}, "overlap_weight"),
    ],
)
def test_router_config_names_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RouterConfig(model_dir="m", **kwargs)


def test_router_never_imports_torch():
    code = (
        "import sys, splitserve.router.server, splitserve.router.generate, splitserve.router.dispatcher, "
        "splitserve.router.openai.server; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_queue_is_bounded_and_first_in_first_out():
    import asyncio
    from types import SimpleNamespace

    from splitserve.common.errors import ServingError
    from splitserve.router.dispatcher import Dispatcher, Ticket

    async def scenario():
        worker = SimpleNamespace(view=PrefillView("p", credit=0))
        pool = SimpleNamespace(prefill=[worker], decode=[], changed=asyncio.Event())
        dispatcher = Dispatcher(pool, RouterConfig(model_dir="m", max_queue=2), block_size=16)
        first, second = Ticket("a", 10, []), Ticket("b", 10, [])
        waiting = [asyncio.create_task(dispatcher.dispatch(t)) for t in (first, second)]
        await asyncio.sleep(0)
        with pytest.raises(ServingError) as e:
            await dispatcher.dispatch(Ticket("c", 10, []))
        assert e.value.code == "RESOURCE_EXHAUSTED"
        worker.view.credit = 1  # room for one: the head of the queue goes first
        dispatcher._place()
        assert await waiting[0] is worker and not waiting[1].done()
        dispatcher.release(worker, first)  # its prefill ended: the credit returns, the next goes
        assert await waiting[1] is worker
        waiting[1].cancel()

    asyncio.run(scenario())


# ---- conditional disaggregation -------------------------------------------------------------------


def local(cached=(), queued=0, *, num_tokens=64, tokens_left=8, waiting=0, decode_workers=1, **thresholds):
    settings = RouterConfig(model_dir="m", **thresholds)
    worker = PrefillView("p", credit=4, queued_tokens=queued, cached_hashes=set(cached))
    return prefill_on_decode(
        settings,
        [worker],
        HASHES,
        16,
        num_tokens=num_tokens,
        tokens_left=tokens_left,
        waiting_tokens=waiting,
        decode_workers=decode_workers,
    )


def test_a_short_uncached_prompt_is_prefilled_on_its_decode_worker():
    assert not local(local_prefill_max_tokens=63), "64 uncached tokens, threshold 63"
    assert local(local_prefill_max_tokens=64)
    assert local(cached=HASHES[:2], local_prefill_max_tokens=32), "two cached blocks leave 32 tokens"
    assert not local(cached=HASHES[1:], local_prefill_max_tokens=32), "a chain that misses its first block"


def test_a_long_prefill_queue_sends_even_long_prompts_to_the_decode_worker():
    assert not local(queued=60, waiting=39, remote_prefill_max_queue_tokens=100)
    assert local(queued=60, waiting=40, remote_prefill_max_queue_tokens=100)


def test_local_prefill_is_off_without_thresholds_decode_workers_or_a_decode_leg():
    assert not local(), "both thresholds 0"
    assert not local(decode_workers=0, local_prefill_max_tokens=1000)
    assert not local(tokens_left=1, local_prefill_max_tokens=1000), "the first token ends it: no decode leg"
    assert local(tokens_left=2, local_prefill_max_tokens=1000)


def test_an_unhealthy_prefill_workers_cache_and_queue_do_not_count():
    sick = PrefillView("sick", credit=4, queued_tokens=500, cached_hashes=set(HASHES), healthy=False)
    args = dict(num_tokens=64, tokens_left=8, waiting_tokens=0, decode_workers=1)
    settings = RouterConfig(model_dir="m", local_prefill_max_tokens=16, remote_prefill_max_queue_tokens=400)
    assert not prefill_on_decode(settings, [sick, PrefillView("ok", credit=4)], HASHES, 16, **args)
