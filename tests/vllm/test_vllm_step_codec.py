"""A tensor-parallel vLLM worker's steps on the plan channel (``encode_step``/``decode_step``): vLLM's scheduler
output as msgpack, never pickled; what the ranks cannot carry is refused, naming the field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from splitserve.worker_common.vllm_engine import decode_step, encode_step


def step() -> SchedulerOutput:
    new = NewRequestData(
        req_id="a-1",
        prompt_token_ids=[1, 2, 3],
        mm_features=[],
        sampling_params=SamplingParams(max_tokens=4, temperature=0.7, seed=9, stop_token_ids=[5]),
        pooling_params=None,
        block_ids=([3, 4],),
        num_computed_tokens=0,
        lora_request=None,
    )
    cached = CachedRequestData(
        req_ids=["b-2"],
        resumed_req_ids={"b-2"},
        new_token_ids=[[7]],
        all_token_ids={"b-2": [1, 7]},
        new_block_ids=[([9],)],
        num_computed_tokens=[12],
        num_output_tokens=[3],
    )
    return SchedulerOutput(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={"a-1": 3, "b-2": 1},
        total_num_scheduled_tokens=4,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[0],
        finished_req_ids={"z-0"},
        free_encoder_mm_hashes=[],
    )


def test_a_step_round_trips_with_its_types():
    original = step()
    back = decode_step(encode_step(original, None), connector_metadata="rank metadata")
    assert back.kv_connector_metadata == "rank metadata"
    assert dataclasses.replace(back, kv_connector_metadata=None) == original
    new = back.scheduled_new_reqs[0]
    assert isinstance(new.block_ids, tuple) and isinstance(back.finished_req_ids, set)
    assert isinstance(new.sampling_params, SamplingParams) and new.sampling_params.seed == 9
    assert back.scheduled_cached_reqs.new_block_ids == [([9],)]


def test_what_the_ranks_cannot_carry_is_refused_by_name():
    original = step()
    with_lora = dataclasses.replace(original.scheduled_new_reqs[0], lora_request=object())
    with pytest.raises(ValueError, match="lora_request"):
        encode_step(dataclasses.replace(original, scheduled_new_reqs=[with_lora]), None)
    with pytest.raises(ValueError, match="grammar"):
        encode_step(step(), np.zeros((1, 4), dtype=np.int32))
    with pytest.raises(ValueError, match="payload"):
        decode_step(b"\x01")
