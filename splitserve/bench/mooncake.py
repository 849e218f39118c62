"""Replaying a trace in the Mooncake format (FAST'25, kvcache-ai/Mooncake): one JSON object a line,

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

``timestamp`` is in ms from the start of the trace; each hash id stands for one block of
``MOONCAKE_BLOCK_TOKENS`` prompt tokens, so equal ids mean identical blocks: prefix sharing. Each
id becomes its own deterministic block of random tokens, the prompt is its blocks in order cut to
``input_length`` (or extended with tokens of its own when the ids cover less), and the request
arrives at its timestamp.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from splitserve.bench.arrivals import trace_offsets
from splitserve.bench.request import BenchRequest, TokenRange

MOONCAKE_BLOCK_TOKENS = 512
SAMPLE_TRACE = Path(__file__).parent / "data" / "mooncake_sample.jsonl"


def read_trace(path: str | Path, limit: int | None = None) -> list[dict]:
    """The first ``limit`` records of the trace, checked; errors name the line and the field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--dataset-path: no such file: {path}")
    records = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(records) >= limit:
                break
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON: {e}") from None
            records.append(_checked(record, where))
    if not records:
        raise ValueError(f"--dataset-path: {path} holds no records")
    return records


def _checked(record: object, where: str) -> dict:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object")
    for key, minimum in (("timestamp", 0), ("input_length", 1), ("output_length", 1)):
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
            raise ValueError(f"{where}: {key}: must be a number >= {minimum}, got {value!r}")
    hash_ids = record.get("hash_ids", [])
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
    ):
        raise ValueError(f"{where}: hash_ids: must be a list of non-negative integers")
    return {
        "timestamp": float(record["timestamp"]),
        "input_length": int(record["input_length"]),
        "output_length": int(record["output_length"]),
        "hash_ids": hash_ids,
    }


def block_tokens(hash_id: int, tokens: TokenRange, seed: int) -> list[int]:
    """The block that ``hash_id`` stands for: the same ids for the same (hash id, seed)."""
    return tokens.draw(np.random.default_rng([seed, hash_id]), MOONCAKE_BLOCK_TOKENS)


def load_mooncake(
    path: str | Path, num_prompts: int | None, tokens: TokenRange, seed: int = 0, time_scale: float = 1.0
) -> list[BenchRequest]:
    """The first ``num_prompts`` requests of the trace, arriving at their (scaled) timestamps."""
    records = read_trace(path, num_prompts)
    offsets = trace_offsets([r["timestamp"] for r in records], time_scale)
    blocks: dict[int, list[int]] = {}
    rng = np.random.default_rng([seed, 2**32])  # tokens past the hash ids': a stream of their own
    requests = []
    for record, offset in zip(records, offsets):
        prompt: list[int] = []
        for hash_id in record["hash_ids"]:
            if len(prompt) >= record["input_length"]:
                break
            if hash_id not in blocks:
                blocks[hash_id] = block_tokens(hash_id, tokens, seed)
            prompt += blocks[hash_id]
        prompt = prompt[: record["input_length"]]
        prompt += tokens.draw(rng, record["input_length"] - len(prompt))
        requests.append(BenchRequest(prompt, record["output_length"], arrival_s=offset))
    return requests
