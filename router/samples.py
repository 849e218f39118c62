"""A request with ``n`` > 1 samples of its prompt: one ``RequestRun`` per sample, one prefill for all.

    sample 0 ─ first leg: prefill, KV transfer ─▶ the decode (or colocated) worker forks samples 1..n-1
               (one call; its events name their sample)    │
                                                          ├─▶ each sample's messages, interleaved as they come
                                                          └─▶ a sample handed back there (or whose worker was
                                                              lost) goes on alone: legs of its own

Sample i samples with seed + i (``sample_seed``, mod 2**64), so each equals a single request with that seed;
the router drew the seed when the request had none. Every message names its sample in ``choice``; each
sample ends with its own last message (its usage: the prompt and its own output). Ending the group's
stream (the client's cancel, an error) cancels every sample's worker calls, which frees their blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.sampling.rng import sample_seed
from splitserve.router.generate import RequestRun
from splitserve.router.metrics import Outcome, RequestSummary
from splitserve.v1 import splitserve_pb2 as pb

# Between the request id and a sample's index in the id a sample uses on its own legs: the router refuses
# client ids with unprintable characters, so it is never another request's (nor a worker's fork id, \x1f).
SAMPLE_ID_SEPARATOR = "\x1e"


def sample_sampling(sampling: SamplingParams, sample: int) -> SamplingParams:
    return dataclasses.replace(sampling, seed=sample_seed(sampling.seed, sample))


class SampleGroup:
    """The samples of one request, run as one: ``run()`` and ``summary()`` as ``RequestRun``'s."""

    def __init__(self, runs: list[RequestRun]) -> None:
        self.runs = runs
        self.leader = runs[0]
        self.request_id = self.leader.request_id
        self.leader.forks = runs[1:]
        for i, run in enumerate(runs):
            run.choice, run.public_id = i, self.request_id

    async def run(self) -> AsyncIterator[pb.GenerateResponse]:
        """Every sample's messages as they come. The first error ends it; ending it (closed, cancelled,
        an error) cancels every sample still running, which cancels their worker calls."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()
        tasks: list[asyncio.Task] = []
        closing = False

        async def pump(stream: AsyncIterator[pb.GenerateResponse]) -> None:
            try:
                async for message in stream:
                    await queue.put((message, None))
                await queue.put((done, None))
            except Exception as e:  # noqa: BLE001 -- handed to the reader, which raises it
                await queue.put((done, e))

        def detach(fork: RequestRun) -> None:
            if not closing:
                tasks.append(asyncio.create_task(pump(_alone(fork))))

        self.leader.on_detach = detach
        tasks.append(asyncio.create_task(pump(self.leader.run())))
        try:
            ended = 0
            while ended < len(tasks):
                message, error = await queue.get()
                if error is not None:
                    raise error
                if message is done:
                    ended += 1
                else:
                    yield message
        finally:
            closing = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def summary(self, outcome: Outcome, status: str, message: str = "") -> RequestSummary:
        """The request's: sample 0's, with every sample's output tokens counted."""
        summary = self.leader.summary(outcome, status, message)
        return dataclasses.replace(summary, completion_tokens=sum(len(run.output) for run in self.runs))


async def _alone(run: RequestRun) -> AsyncIterator[pb.GenerateResponse]:
    """A sample that left its first leg unfinished, on legs of its own (its output so far re-prefilled)."""
    if run.output and run._ended_by_output():  # its worker was lost after its last token
        yield run._final()
        return
    async for message in run.run():
        yield message
