"""Log-probabilities of tokens, from the logits the model produced: the one place they are computed.

What they are of (vLLM's default, ``logprobs_mode="raw_logprobs"``): ``log_softmax`` in float32 of the
model's raw logits, before penalties, ``min_tokens`` suppression, temperature and the top-k/top-p/min-p
filters. So a token's log-probability does not depend on how it was sampled, a greedy token (without
penalties or ``min_tokens``) is always the top-1 entry, and a prompt token's log-probability is the
same whatever the request's sampling parameters.

``token_logprobs`` serves the sampled tokens (the sampler calls it on each step's rows) and the prompt's
(the model runner calls it on a prefill chunk's rows, each row scoring the prompt token that follows it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.sampling.params import MAX_LOGPROBS, TokenLogprobs

__all__ = ["MAX_LOGPROBS", "TokenLogprobs", "log_probs", "token_logprobs"]


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] logits (any float dtype) -> float32 log-probabilities over the vocabulary."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], k: int | Sequence[int]) -> list[TokenLogprobs]:
    """The log-probability, rank and top-``k`` entries of ``token_ids[i]`` under row i of ``logits``
    ([len(token_ids), vocab], raw model output). ``k``: one count for every row, or one per row (0: none).
    Rows of already computed log-probabilities (``log_probs``) give the same result."""
    rows = len(token_ids)
    ks = [k] * rows if isinstance(k, int) else list(k)
    if rows == 0:
        return []
    if len(ks) != rows or logits.shape[0] != rows:
        raise ValueError(f"logits: {logits.shape[0]} rows, {rows} token ids, {len(ks)} counts")
    lp = log_probs(logits)
    ids = torch.tensor(list(token_ids), device=lp.device, dtype=torch.long).unsqueeze(1)
    chosen = lp.gather(1, ids)  # [rows, 1]
    # Rank: 1 + tokens strictly more likely (as vLLM counts it).
    ranks = (lp > chosen).sum(dim=1) + 1
    width = min(max(ks), lp.shape[1])
    top_values = top_ids = None
    if width > 0:
        values, indices = lp.topk(width, dim=1)
        top_values, top_ids = values.tolist(), indices.tolist()
    out = []
    for i, (token, value, rank) in enumerate(zip(token_ids, chosen.squeeze(1).tolist(), ranks.tolist())):
        n = min(ks[i], width)
        top = tuple(zip(top_ids[i][:n], top_values[i][:n])) if n else ()
        out.append(TokenLogprobs(int(token), float(value), int(rank), top))
    return out
