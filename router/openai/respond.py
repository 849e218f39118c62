"""The router's messages (``GenerateResponse``) -> OpenAI's response and stream-chunk objects.

Beyond OpenAI's fields, each finished choice carries ``stop_reason`` (as vLLM: the stop string or stop
token id that ended it, null for EOS and length) and ``timing``: where the request's time went (the
router's ``Timing``: queue, prefill, transfer, first token, decode, total, in ms; the workers; the
re-prefills). ``usage.prompt_tokens_details.cached_tokens`` counts prompt tokens served from a prefill
worker's prefix cache.
"""

from __future__ import annotations

import time

from splitserve.engine.wire import finish_label
from splitserve.router.openai.parse import Job
from splitserve.v1 import splitserve_pb2 as pb


def usage(finals: list[pb.GenerateResponse]) -> dict:
    """A prompt's tokens count once (its sample 0's final), every sample's output tokens count."""
    prompt = sum(f.usage.prompt_tokens for f in finals if f.choice == 0)
    completion = sum(f.usage.completion_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(f.usage.cached_tokens for f in finals if f.choice == 0)},
    }


def timing(message: pb.Timing) -> dict:
    values = {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields}
    return {name: round(v, 3) if isinstance(v, float) else v for name, v in values.items()}  # to the microsecond


class Responder:
    """Builds the objects of one request's answer; ``stream`` chunks or one ``response``."""

    def __init__(self, job: Job, model: str, request_id: str) -> None:
        self.job, self.model = job, model
        self.chat = job.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())

    def _object(self, choices: list[dict], **extra) -> dict:
        kind = ("chat.completion.chunk" if self.job.stream else "chat.completion") if self.chat else "text_completion"
        usage_field = {"usage": None} if self.job.stream and self.job.include_usage else {}
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **usage_field,
            **extra,
        }

    def _finished(self, index: int, final: pb.GenerateResponse) -> dict:
        return {
            "finish_reason": finish_label(final.finish_reason) or "stop",  # OpenAI always names one
            "stop_reason": self._stop_reason(index, final.stop_reason),
            "timing": timing(final.timing),
        }

    def _stop_reason(self, index: int, stop_reason: str) -> str | int | None:
        if not stop_reason or stop_reason in self.job.requests[index // self.job.n].sampling.stop:
            return stop_reason or None
        return int(stop_reason) if stop_reason.isdigit() else stop_reason

    # ---- streaming ------------------------------------------------------------------------------

    def role_chunk(self, index: int) -> dict:
        """Chat streams open each choice with the assistant's role, as OpenAI's do."""
        return self._object(
            [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )

    def chunk(self, index: int, message: pb.GenerateResponse) -> dict | None:
        """The chunk for one router message; None when it has no text and does not finish the choice
        (text held back while it may still become a stop string)."""
        done = message.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        if not message.text and not done:
            return None
        if self.chat:
            choice = {"index": index, "delta": {"content": message.text} if message.text else {}}
        else:
            choice = {"index": index, "text": message.text}
        choice |= {"logprobs": None, "finish_reason": None}
        if done:
            choice |= self._finished(index, message)
        return self._object([choice])

    def usage_chunk(self, finals: list[pb.GenerateResponse]) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the whole request's usage."""
        return self._object([], usage=usage(finals))

    # ---- one response ---------------------------------------------------------------------------

    def response(self, texts: list[str], finals: list[pb.GenerateResponse]) -> dict:
        choices = []
        for index, (text, final) in enumerate(zip(texts, finals)):
            body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            choices.append({"index": index, **body, "logprobs": None, **self._finished(index, final)})
        return self._object(choices, usage=usage(finals))
