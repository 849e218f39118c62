"""Samples of one prompt (a request's ``n`` > 1) on a worker: their engine ids and the fork.

Sample 0 is the request itself. Once its prompt is computed (its KV landed on a decode worker, or its
prefill ran on a colocated one), samples 1 to n - 1 are forked from it: each shares its full prompt blocks
by reference count, computes the rest of the prompt itself and samples its own tokens with seed + i
(``sample_seed``), so each equals a single request with that seed. They stream on the request's call,
each event naming its sample; the call ends when every sample has ended.
"""

from __future__ import annotations

import dataclasses

from splitserve.engine.sampling.rng import sample_seed
from splitserve.worker_common.engine_api import Engine, Forks, Request

# Between a request id and its sample index: the router refuses ids with unprintable characters, so a
# sample's engine id never equals another request's id.
SAMPLE_SEPARATOR = "\x1f"


def sample_request_id(request_id: str, sample: int) -> str:
    return request_id if sample == 0 else f"{request_id}{SAMPLE_SEPARATOR}{sample}"


def check_samples(engine: Engine, n: int) -> str | None:
    """Why this worker cannot run ``n`` samples of a request (None: it can)."""
    if n > 1 and not isinstance(engine, Forks):
        return "n: this worker's engine cannot fork samples; send n = 1"
    return None


def fork_samples(engine: Engine, parent: Request, n: int) -> list[Request]:
    """Samples 1 to n - 1 of ``parent``, forked into the batch (``Forks.fork``); returns them in order. A
    parent that has finished already (its first token ended it) has freed its blocks: the samples are then
    added as requests of their own, whose prefill the prefix cache serves from its full blocks, if kept."""
    children = []
    for sample in range(1, n):
        seed = sample_seed(parent.seed, sample)
        child = Request(
            sample_request_id(parent.request_id, sample),
            list(parent.prompt_token_ids),
            dataclasses.replace(parent.sampling, seed=seed, prompt_logprobs=None),
            seed=seed,
        )
        if parent.is_finished:
            engine.add(child)
        else:
            engine.fork(parent.request_id, child)
        children.append(child)
    return children
