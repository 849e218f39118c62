"""Protobuf <-> engine dataclasses, at the edge of every service. Torch-free (the router uses it)."""

from __future__ import annotations

from splitserve.engine.sampling.params import SamplingParams, SamplingParamsError, TokenLogprobs
from splitserve.engine.sampling.rng import random_seed
from splitserve.engine.scheduler.request import FinishReason
from splitserve.v1 import splitserve_pb2 as pb

_OPTIONAL_SCALARS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "ignore_eos",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "logprobs",
    "prompt_logprobs",
)

# The one finish-reason table: engine FinishReason <-> protobuf enum; the text label ("stop", "length")
# is the FinishReason's value, which OpenAI's finish_reason, the router's metrics and the client all show.
# ABORT and PREEMPTED are never sent as a finish reason, so they have no protobuf value.
FINISH_TO_PB = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}


def finish_label(finish_reason: int) -> str:
    """A message's protobuf finish reason as text: "stop", "length", or "" when it carries none."""
    reason = FINISH_FROM_PB.get(finish_reason)
    return reason.value if reason is not None else ""


def sampling_from_pb(message: pb.SamplingParams, draw_seed: bool = True) -> SamplingParams:
    """Unset fields take SamplingParams' defaults; a bad value raises SamplingParamsError with the
    field named as ``sampling.<field>``. With ``draw_seed`` an unset seed becomes a random one, so the
    request samples the same stream on whichever worker computes it."""
    values = {name: getattr(message, name) for name in _OPTIONAL_SCALARS if message.HasField(name)}
    if message.stop:
        values["stop"] = tuple(message.stop)
    if message.stop_token_ids:
        values["stop_token_ids"] = tuple(message.stop_token_ids)
    if draw_seed and "seed" not in values:
        values["seed"] = random_seed()
    try:
        return SamplingParams(**values)
    except SamplingParamsError as e:
        raise SamplingParamsError(f"sampling.{e.field}", str(e).split(": ", 1)[1]) from None


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    """Every field set explicitly (workers never apply defaults of their own)."""
    message = pb.SamplingParams(stop=list(params.stop), stop_token_ids=list(params.stop_token_ids))
    for name in _OPTIONAL_SCALARS:
        value = getattr(params, name)
        if value is not None:
            setattr(message, name, value)
    return message


def stop_reason_text(stop_reason: int | str | None) -> str:
    return "" if stop_reason is None else str(stop_reason)


def logprobs_to_pb(entry: TokenLogprobs) -> pb.TokenLogprobs:
    """One position's log-probabilities (``TokenLogprobs``) as protobuf."""
    return pb.TokenLogprobs(
        token_id=entry.token_id,
        logprob=entry.logprob,
        rank=entry.rank,
        top=[pb.TokenLogprob(token_id=t, logprob=v) for t, v in entry.top],
    )


def prompt_logprobs_to_pb(entries: list[TokenLogprobs | None] | None) -> list[pb.TokenLogprobs]:
    """A request's prompt log-probabilities, the first prompt token's (None) left out; [] unless every
    other prompt token has its entry (none asked for, or not computed on this leg)."""
    if not entries or any(e is None for e in entries[1:]):
        return []
    return [logprobs_to_pb(e) for e in entries[1:]]
