"""Concurrent client streams for the recovery, colocated and multi-node tests."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from splitserve.client.grpc_client import Client


def stream_all(
    address: str, prompts: list[list[int]], sampling: dict, started: threading.Event | None = None, min_tokens: int = 5
) -> list[Future]:
    """Stream the prompts concurrently; set ``started`` once every stream has ``min_tokens`` tokens.
    Each future gives (tokens, finish_reason, reprefills)."""
    counts = [0] * len(prompts)

    def one(i):
        tokens, finish, reprefills = [], "", 0
        with Client(address) as client:
            for message in client.stream(token_ids=prompts[i], **sampling):
                tokens.extend(message.token_ids)
                counts[i] = len(tokens)
                if started is not None and min(counts) >= min_tokens:
                    started.set()
                if message.finish_reason:
                    finish, reprefills = message.finish_reason, message.timing.reprefills
        return tokens, finish, reprefills

    pool = ThreadPoolExecutor(len(prompts))
    return [pool.submit(one, i) for i in range(len(prompts))]
