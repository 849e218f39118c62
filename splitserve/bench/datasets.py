"""The benchmark's requests: prompts as token ids, output lengths, and (for a trace) arrival times.

Prompts are random token ids, drawn from ``TokenRange``: the length statistics are what load the
server, and token ids need no tokenizer on the client. Every dataset is deterministic under ``seed``.

- ``random``: vLLM's random dataset: lengths uniform in ``[len * (1 - r), len * (1 + r)]``, with an
  optional prefix shared by every prompt;
- ``chat``, ``code``, ``summarize``: lognormal lengths with caps (``PRESETS``; docs/benchmarks.md
  says where the numbers come from);
- ``shared-prefix``: groups of prompts that share a long system prompt (SGLang's
  generated-shared-prefix dataset);
- ``mooncake``: a replayed trace (``splitserve.bench.mooncake``).

Every request is then fitted to the context: prompt + output ≤ ``max_model_len``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from splitserve.bench import DATASETS
from splitserve.bench.mooncake import load_mooncake
from splitserve.bench.request import BenchRequest, TokenRange
from splitserve.common.validate import check_range


@dataclass(frozen=True)
class LengthDist:
    """Lognormal lengths: ``median`` and ``sigma`` of the log, clipped to ``[low, high]``."""

    median: float
    sigma: float
    low: int
    high: int

    def scaled_to(self, median: int | None) -> LengthDist:
        """The same shape around a new median; the caps scale with it (a small model's presets)."""
        if median is None:
            return self
        f = median / self.median
        return LengthDist(median, self.sigma, max(1, round(self.low * f)), max(1, round(self.high * f)))

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        values = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(values), self.low, self.high).astype(int).tolist()


# (input lengths, output lengths) of the workload presets.
PRESETS: dict[str, tuple[LengthDist, LengthDist]] = {
    # ShareGPT-like conversations: a wide spread of prompts around a few hundred tokens, ~200-token replies.
    "chat": (LengthDist(256, 0.9, 4, 4096), LengthDist(200, 0.6, 4, 1024)),
    # Code completion: long context (the file around the cursor), short completions.
    "code": (LengthDist(1400, 0.3, 512, 3072), LengthDist(50, 0.35, 8, 256)),
    # Long-document summarization: 3k to 8k-token documents, 200 to 300-token summaries.
    "summarize": (LengthDist(5000, 0.25, 3000, 8000), LengthDist(250, 0.1, 200, 300)),
}


@dataclass(frozen=True)
class DatasetOptions:
    name: str = "random"
    num_prompts: int = 1000
    input_len: int | None = None  # random: the mean; presets: the median; shared-prefix: the unique suffix
    output_len: int | None = None
    range_ratio: float = 0.0
    random_prefix_len: int = 0
    shared_prefix_groups: int = 8
    shared_prefix_len: int = 1024
    dataset_path: str | None = None
    time_scale: float = 1.0
    max_model_len: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"--dataset: unknown dataset {self.name!r}; valid: {', '.join(DATASETS)}")
        for name in ("num_prompts", "input_len", "output_len", "shared_prefix_groups"):
            check_range(self, name, min=1, label=_flag(name))
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"--range-ratio: must be in [0, 1), got {self.range_ratio}")
        for name in ("random_prefix_len", "shared_prefix_len"):
            check_range(self, name, min=0, label=_flag(name))
        check_range(self, "max_model_len", min=2, label="--max-model-len")
        if self.name == "mooncake" and not self.dataset_path:
            raise ValueError("--dataset-path: required with --dataset mooncake")


def make_requests(options: DatasetOptions, tokens: TokenRange) -> list[BenchRequest]:
    """The requests of ``options.name``, fitted to ``options.max_model_len``."""
    rng = np.random.default_rng(options.seed)
    if options.name == "mooncake":
        requests = load_mooncake(options.dataset_path, options.num_prompts, tokens, options.seed, options.time_scale)
    elif options.name == "random":
        requests = _random(options, tokens, rng)
    elif options.name == "shared-prefix":
        requests = _shared_prefix(options, tokens, rng)
    else:
        requests = _preset(options, tokens, rng)
    return [fit_to_context(r, options.max_model_len) for r in requests]


def fit_to_context(request: BenchRequest, max_model_len: int) -> BenchRequest:
    """Prompt + output within ``max_model_len``: the output is cut to half the context at most, then
    the prompt loses its tail (so shared prefixes stay shared)."""
    if request.prompt_len + request.output_len <= max_model_len:
        return request
    output_len = min(request.output_len, max_model_len // 2)
    return replace(request, prompt=request.prompt[: max_model_len - output_len], output_len=output_len)


def uniform_lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> list[int]:
    """Integers uniform in ``[floor(mean * (1 - r)), ceil(mean * (1 + r))]``, at least 1 (vLLM's)."""
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


def _random(options: DatasetOptions, tokens: TokenRange, rng: np.random.Generator) -> list[BenchRequest]:
    n = options.num_prompts
    input_lens = uniform_lengths(rng, options.input_len or 1024, options.range_ratio, n)
    output_lens = uniform_lengths(rng, options.output_len or 128, options.range_ratio, n)
    prefix = tokens.draw(rng, options.random_prefix_len)
    return [BenchRequest(prefix + tokens.draw(rng, i), o) for i, o in zip(input_lens, output_lens)]


def _preset(options: DatasetOptions, tokens: TokenRange, rng: np.random.Generator) -> list[BenchRequest]:
    inputs, outputs = PRESETS[options.name]
    n = options.num_prompts
    input_lens = inputs.scaled_to(options.input_len).sample(rng, n)
    output_lens = outputs.scaled_to(options.output_len).sample(rng, n)
    return [BenchRequest(tokens.draw(rng, i), o) for i, o in zip(input_lens, output_lens)]


def _shared_prefix(options: DatasetOptions, tokens: TokenRange, rng: np.random.Generator) -> list[BenchRequest]:
    """``shared_prefix_groups`` system prompts of ``shared_prefix_len`` tokens; each request is one of
    them plus a unique question of ``input_len`` tokens. Groups take turns, then the order is shuffled
    (as SGLang's generator does), so requests of one group do not all arrive together."""
    n = options.num_prompts
    prefixes = [tokens.draw(rng, options.shared_prefix_len) for _ in range(options.shared_prefix_groups)]
    suffix_lens = uniform_lengths(rng, options.input_len or 128, options.range_ratio, n)
    output_lens = uniform_lengths(rng, options.output_len or 256, options.range_ratio, n)
    groups = rng.permutation(np.arange(n) % options.shared_prefix_groups).tolist()
    return [BenchRequest(prefixes[g] + tokens.draw(rng, s), o) for g, s, o in zip(groups, suffix_lens, output_lens)]


def _flag(name: str) -> str:
    """The command-line flag of a dataset option (``input_len`` -> ``--input-len``)."""
    return "--" + name.replace("_", "-")
