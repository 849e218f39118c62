"""Turn a step's logits into one token per sampling request.

Order of operations (as transformers' logits processors): penalties, min_tokens suppression,
temperature, top-k, top-p, min-p. Greedy rows take the argmax. Sampled rows draw by inverse CDF
with a single uniform number from ``keyed_uniform(seed, position)``, so a request's draw depends on
its own logits and (seed, position) only, never on its batch neighbours.

Rows whose request asks for ``logprobs`` get the sampled token's log-probability and top entries
appended to ``request.logprobs``, from the raw logits, before any of the above
(``splitserve.engine.sampling.logprobs``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.sampling.logprobs import log_probs, token_logprobs
from splitserve.engine.sampling.rng import keyed_uniform
from splitserve.engine.scheduler.request import Request


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """logits [len(requests), vocab] (any float dtype) -> the next token of each request."""
        logits = logits.float()  # also the fast path: argmax over bf16 is several times slower here
        wanted = [row for row, r in enumerate(requests) if r.sampling.logprobs is not None]
        # Raw log-probabilities, taken before the penalties below change the logits in place.
        raw = log_probs(logits[wanted]) if wanted else None
        for row, request in enumerate(requests):
            if request.sampling.has_penalties:
                self._apply_penalties(logits[row], request)
            if request.num_output_tokens < request.sampling.min_tokens:
                self._suppress_stops(logits[row], request)
        tokens = logits.argmax(dim=-1).tolist()
        for row, request in enumerate(requests):
            if not request.sampling.greedy:
                tokens[row] = self._sample_row(logits[row], request)
        if raw is not None:
            chosen = [tokens[row] for row in wanted]
            counts = [requests[row].sampling.logprobs for row in wanted]
            for row, entry in zip(wanted, token_logprobs(raw, chosen, counts)):
                requests[row].logprobs.append(entry)
        return tokens

    @staticmethod
    def _apply_penalties(row: torch.Tensor, request: Request) -> None:
        sp = request.sampling
        device = row.device
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(request.token_ids)), device=device)
            scores = row[seen]
            row[seen] = torch.where(scores > 0, scores / sp.repetition_penalty, scores * sp.repetition_penalty)
        if (sp.presence_penalty or sp.frequency_penalty) and request.num_output_tokens:
            ids, counts = torch.tensor(request.output_token_ids, device=device).unique(return_counts=True)
            row[ids] -= sp.frequency_penalty * counts.to(row.dtype) + sp.presence_penalty

    def _suppress_stops(self, row: torch.Tensor, request: Request) -> None:
        sp = request.sampling
        ids = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(self.eos_token_ids))
        if ids:
            row[torch.tensor(ids, device=row.device)] = float("-inf")

    @staticmethod
    def _sample_row(row: torch.Tensor, request: Request) -> int:
        sp = request.sampling
        probs = torch.softmax(row / sp.temperature, dim=-1)
        index: torch.Tensor | None = None
        top_k = sp.top_k if 0 < sp.top_k < probs.numel() else 0
        if top_k or sp.top_p < 1.0:
            probs, index = probs.topk(top_k) if top_k else probs.sort(descending=True)
            if sp.top_p < 1.0:
                cumulative = probs.cumsum(0) / probs.sum()
                keep = int((cumulative - probs / probs.sum() < sp.top_p).sum().clamp(min=1))
                probs, index = probs[:keep], index[:keep]
        if sp.min_p > 0.0:
            probs = torch.where(probs >= sp.min_p * probs.max(), probs, torch.zeros_like(probs))
        cdf = probs.double().cumsum(0)
        target = keyed_uniform(request.seed, request.num_tokens) * cdf[-1]
        j = min(int(torch.searchsorted(cdf, target.reshape(1), right=True)), probs.numel() - 1)
        return int(index[j]) if index is not None else j
