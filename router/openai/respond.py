"""The router's messages (``GenerateResponse``) -> OpenAI's response and stream-chunk objects.

Beyond OpenAI's fields, each finished choice carries ``stop_reason`` (as vLLM: the stop string or stop
token id that ended it, null for EOS and length) and ``timing``: where the request's time went (the
router's ``Timing``: queue, prefill, transfer, first token, decode, total, in ms; the workers; the
re-prefills). ``usage.prompt_tokens_details.cached_tokens`` counts prompt tokens served from a prefill
worker's prefix cache.

Log-probabilities (``logprobs``) in each API's own format: completions' ``tokens``, ``token_logprobs``,
``top_logprobs`` (a token -> log-probability object of the chosen token and the k most likely, as vLLM's)
and ``text_offset``; chat's ``content`` list of ``token``, ``logprob``, ``bytes`` and ``top_logprobs`` (the k
most likely). A token is named by its own decoded text. With ``echo`` the prompt comes first, its first
token's entries null. A log-probability of minus infinity is sent as -9999.0, as vLLM does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from splitserve.engine.text.tokenizer import Tokenizer
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


LOGPROB_FLOOR = -9999.0  # JSON has no -inf


@dataclass
class _Choice:
    """What a choice has sent so far (streaming) or gathered (one response)."""

    text_offset: int = 0  # completions' text_offset of the next token
    pending: list[tuple[int, pb.TokenLogprobs | None]] = field(default_factory=list)  # not sent yet
    echoed: bool = False


class Responder:
    """Builds the objects of one request's answer; ``stream`` chunks or one ``response``."""

    def __init__(self, job: Job, model: str, request_id: str, tokenizer: Tokenizer | None = None) -> None:
        self.job, self.model, self.tokenizer = job, model, tokenizer
        self.chat = job.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(len(job.requests) * job.n)]  # index: prompt * n + sample
        self._names: dict[int, str] = {}

    # ---- log-probabilities ----------------------------------------------------------------------

    def _name(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            name = self._names[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return name

    def _take(self, index: int, message: pb.GenerateResponse) -> str:
        """Note the message's log-probabilities (and, first, the echoed prompt's) to send; returns the text
        to send before the message's own (the echoed prompt)."""
        choice, job = self.choices[index], self.job
        prefix = ""
        if job.echo is not None and not choice.echoed:
            choice.echoed = True
            prefix, prompt_ids = job.echo[index // job.n]
            if job.logprobs is not None:
                choice.pending.append((prompt_ids[0], None))
                choice.pending.extend(zip(prompt_ids[1:], message.prompt_logprobs))
        if job.logprobs is not None and not job.echo_only:
            choice.pending.extend(zip(message.token_ids, message.logprobs))
        return prefix

    def _logprobs(self, index: int) -> dict | None:
        """The pending log-probabilities of a choice in the API's format (None when none are asked for)."""
        if self.job.logprobs is None:
            return None
        choice = self.choices[index]
        entries, choice.pending = choice.pending, []
        if self.chat:
            return {"content": [self._chat_entry(e) for _, e in entries if e is not None]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in entries:
            name = self._name(token_id)
            out["tokens"].append(name)
            out["text_offset"].append(choice.text_offset)
            choice.text_offset += len(name)
            if entry is None:  # the first prompt token: nothing before it to score it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_value(entry.logprob))
            top = {name: _value(entry.logprob)}
            for t in entry.top:
                top.setdefault(self._name(t.token_id), _value(t.logprob))
            out["top_logprobs"].append(top)
        return out

    def _chat_entry(self, entry: pb.TokenLogprobs) -> dict:
        name = self._name(entry.token_id)
        return {
            "token": name,
            "logprob": _value(entry.logprob),
            "bytes": list(name.encode("utf-8")),
            "top_logprobs": [
                {"token": n, "logprob": _value(t.logprob), "bytes": list(n.encode("utf-8"))}
                for t in entry.top
                for n in (self._name(t.token_id),)
            ],
        }

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
        text = self._take(index, message) + ("" if self.job.echo_only else message.text)
        if not text and not done:
            return None  # its log-probabilities go with the next chunk of this choice
        if self.chat:
            choice = {"index": index, "delta": {"content": text} if text else {}}
        else:
            choice = {"index": index, "text": text}
        choice |= {"logprobs": self._logprobs(index), "finish_reason": None}
        if done:
            choice |= self._finished(index, message)
        return self._object([choice])

    def usage_chunk(self, finals: list[pb.GenerateResponse]) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the whole request's usage."""
        return self._object([], usage=usage(finals))

    # ---- one response ---------------------------------------------------------------------------

    def gather(self, index: int, message: pb.GenerateResponse) -> str:
        """One router message of a choice, for ``response``: keeps its log-probabilities, returns its text
        (after the echoed prompt, with the first)."""
        prefix = self._take(index, message)
        return prefix + ("" if self.job.echo_only else message.text)

    def response(self, texts: Sequence[str], finals: list[pb.GenerateResponse]) -> dict:
        """``texts``: each choice's messages through ``gather``, joined."""
        choices = []
        for index, (text, final) in enumerate(zip(texts, finals)):
            body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            choices.append({"index": index, **body, "logprobs": self._logprobs(index), **self._finished(index, final)})
        return self._object(choices, usage=usage(finals))


def _value(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)
