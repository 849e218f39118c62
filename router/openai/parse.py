"""OpenAI request bodies -> the router's own requests (``GenerateRequest``), one per prompt.

Translation only: types are checked here (a protobuf field cannot hold a string or a negative
``max_tokens``), ranges are left to the router's admission, which checks them for every front end
alike. Parameters this server cannot honour are refused by name rather than ignored; parameters
it does not know are ignored, as vLLM does (clients send vendor extras).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from splitserve.common.errors import ServingError
from splitserve.engine.sampling.params import MAX_LOGPROBS
from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.router.openai.chat_template import ChatTemplate, ChatTemplateError
from splitserve.router.openai.errors import OpenAIError, invalid, unsupported
from splitserve.v1 import splitserve_pb2 as pb

Kind = Literal["completion", "chat"]

# Sampling parameters (OpenAI's, and vLLM's extras) -> their type; the protobuf field has the same name.
SAMPLING = {
    "temperature": "number",
    "top_p": "number",
    "top_k": "int32",
    "min_p": "number",
    "seed": "uint64",
    "presence_penalty": "number",
    "frequency_penalty": "number",
    "repetition_penalty": "number",
    "min_tokens": "uint32",
    "ignore_eos": "bool",
    "skip_special_tokens": "bool",
    "include_stop_str_in_output": "bool",
}
_BOUNDS = {"int32": (-(2**31), 2**31), "uint32": (0, 2**32), "uint64": (0, 2**64)}

# Parameters refused unless they ask for nothing (the values listed, or null): why.
REFUSED = {
    "suffix": (("",), "suffixes (insertion) are not supported"),
    "logit_bias": (({},), "logit bias is not supported"),
    "tools": (([],), "tool calling is not supported"),
    "functions": (([],), "function calling is not supported"),
    "function_call": (("none", "auto"), "function calling is not supported"),
    "tool_choice": (("none", "auto"), "tool calling is not supported"),
    "response_format": (({"type": "text"},), "only plain text responses are supported"),
    "continue_final_message": ((False,), "continuing the final message is not supported"),
}


@dataclass(frozen=True)
class ServedModel:
    """What parsing needs to know of the model the router serves."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int
    chat_template: ChatTemplate | None
    no_template_reason: str  # why chat_template is None
    max_prompts: int  # prompts in one completions request (the router's queue bound)


@dataclass
class Job:
    """One OpenAI request, translated: a router request per prompt, and how to answer."""

    kind: Kind
    requests: list[pb.GenerateRequest]
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices per prompt: choice index = prompt index * n + sample
    # The router's field names -> this request's parameter names, to point errors at what was sent.
    params: dict[str, str] = field(default_factory=dict)
    # Log-probabilities asked for: the top entries per position (completions' logprobs, chat's
    # top_logprobs; 0: the chosen token's only), None for none.
    logprobs: int | None = None
    # Completions' echo: each prompt as text and token ids, returned before the completion (with their
    # log-probabilities when asked for); with max_tokens 0 (``echo_only``) nothing else is returned.
    echo: list[tuple[str, list[int]]] | None = None
    echo_only: bool = False

    def error(self, e: ServingError) -> OpenAIError:
        """The router's error, its field renamed to the OpenAI parameter it came from."""
        name, sep, rest = e.message.partition(": ")
        if e.code not in ("INVALID_ARGUMENT", "ALREADY_EXISTS") or not sep:
            return OpenAIError.from_error(e)
        param = self.params.get(name, name.removeprefix("sampling."))
        error = OpenAIError.from_error(e, f"{param}: {rest}", param)
        if "exceeds the context length" in rest:
            error.code = "context_length_exceeded"
        return error


def parse_completion(body: object, model: ServedModel, request_id: str) -> Job:
    body = _common(body, model)
    prompts = _prompts(body.get("prompt"))
    if len(prompts) > model.max_prompts:
        raise invalid("prompt", f"at most {model.max_prompts} prompts in one request, got {len(prompts)}")
    logprobs = _logprobs_count(body, "logprobs")
    echo = bool(_typed(body, "echo", bool))
    # max_tokens 0 only with echo (lm-eval's scoring sends it): one token is generated, none returned.
    echo_only = echo and body.get("max_tokens") == 0 and type(body.get("max_tokens")) is int
    sampling = _sampling({**body, "max_tokens": 1} if echo_only else body, "max_tokens")
    if logprobs is not None:
        sampling.logprobs = logprobs
        if echo:
            sampling.prompt_logprobs = logprobs
    n = _samples(body)
    requests, echoed = [], []
    for i, prompt in enumerate(prompts):
        message = pb.GenerateRequest(sampling=sampling, request_id=_nth(request_id, i, len(prompts)), n=n)
        if isinstance(prompt, str) and not echo:
            message.prompt = prompt
        elif isinstance(prompt, str):  # echo: the ids are needed to name each prompt token
            ids = _encode(model.tokenizer, prompt)
            message.token_ids.extend(ids)
            echoed.append((prompt, ids))
        else:
            message.token_ids.extend(prompt)
            echoed.append((model.tokenizer.decode(prompt, skip_special_tokens=False), list(prompt)))
        requests.append(message)
    params = {"prompt": "prompt", "token_ids": "prompt", "prompt, token_ids": "prompt", "request_id": "X-Request-Id"}
    if echo_only:  # the router's own error for max_tokens would name a value the client did not send
        params["sampling.max_tokens"] = "max_tokens"
    return Job(
        "completion",
        requests,
        *_streaming(body),
        n=n or 1,
        params=params,
        logprobs=logprobs,
        echo=echoed if echo else None,
        echo_only=echo_only,
    )


def parse_chat(body: object, model: ServedModel, request_id: str) -> Job:
    body = _common(body, model)
    if model.chat_template is None:
        raise OpenAIError(400, f"messages: {model.no_template_reason}", "messages", "chat_template_missing")
    kwargs = _typed(body, "chat_template_kwargs", dict) or {}
    add_generation_prompt = _typed(body, "add_generation_prompt", bool)
    try:
        text = model.chat_template.render(
            _messages(body.get("messages")), add_generation_prompt=add_generation_prompt is not False, **kwargs
        )
        token_ids = model.tokenizer.encode(text, add_special_tokens=False)  # the template wrote them
    except ChatTemplateError as e:
        raise invalid("messages", f"the chat template cannot render them: {e}") from None
    except ValueError as e:
        raise invalid("messages", str(e)) from None
    if not token_ids:
        raise invalid("messages", "the chat template rendered them to no tokens")
    if len(token_ids) >= model.max_model_len:
        raise invalid(
            "messages",
            f"the prompt is {len(token_ids)} tokens, the context length is {model.max_model_len}",
            "context_length_exceeded",
        )
    if body.get("echo") is not None and body.get("echo") is not False:
        raise unsupported("echo", "only /v1/completions echoes the prompt; chat completions do not")
    logprobs = _chat_logprobs(body)
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sampling = _sampling(body, limit)
    if logprobs is not None:
        sampling.logprobs = logprobs
    if not sampling.HasField("max_tokens"):  # as vLLM: the rest of the context
        sampling.max_tokens = model.max_model_len - len(token_ids)
    n = _samples(body)
    request = pb.GenerateRequest(token_ids=token_ids, sampling=sampling, request_id=request_id, n=n)
    params = {
        "token_ids": "messages",
        "prompt, token_ids": "messages",
        "sampling.max_tokens": limit,
        "request_id": "X-Request-Id",
        "sampling.logprobs": "top_logprobs",
    }
    return Job("chat", [request], *_streaming(body), n=n or 1, params=params, logprobs=logprobs)


def _logprobs_count(body: dict, name: str) -> int | None:
    """An optional count of top log-probabilities, 0 to MAX_LOGPROBS."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"must be an integer from 0 to {MAX_LOGPROBS}, got {value!r}", "invalid_type")
    if not 0 <= value <= MAX_LOGPROBS:
        raise invalid(name, f"must be from 0 to {MAX_LOGPROBS}, got {value}")
    return value


def _chat_logprobs(body: dict) -> int | None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (0-20; above 0 only with logprobs) -> the count."""
    wanted = _typed(body, "logprobs", bool)
    top = _logprobs_count(body, "top_logprobs")
    if top and not wanted:
        raise invalid("top_logprobs", "only allowed when logprobs is true")
    return (top or 0) if wanted else None


def _encode(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """A text prompt's ids, as the router would encode it."""
    if not prompt:
        raise invalid("prompt", "must not be empty")
    try:
        ids = tokenizer.encode(prompt)
    except ValueError as e:
        raise invalid("prompt", str(e)) from None
    if not ids:
        raise invalid("prompt", "encodes to no tokens")
    return ids


def _nth(request_id: str, i: int, count: int) -> str:
    return request_id if count == 1 else f"{request_id}-{i}"


def _common(body: object, model: ServedModel) -> dict:
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object", None, "invalid_type")
    name = body.get("model")
    if name is not None and name != model.name:
        raise OpenAIError(
            404, f"The model `{name}` does not exist (this server serves `{model.name}`).", "model", "model_not_found"
        )
    for param, (nothing, why) in REFUSED.items():
        value = body.get(param)
        if value is not None and not any(value == x and type(value) is type(x) for x in nothing):
            raise unsupported(param, why)
    return body


def _samples(body: dict) -> int | None:
    """``n`` (choices per prompt; its range is the router's: 1 to ``router.max_n``) and ``best_of``, which
    vLLM no longer takes: accepted only when it asks for nothing more than ``n``."""
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
        raise invalid("n", f"must be an integer, got {n!r}", "invalid_type")
    if n is not None and not 1 <= n < 2**32:  # the router bounds it further (router.max_n)
        raise invalid("n", f"must be >= 1, got {n}" if n < 1 else f"must be < {2**32}, got {n}")
    best_of = body.get("best_of")
    if best_of is not None:
        if isinstance(best_of, bool) or not isinstance(best_of, int):
            raise invalid("best_of", f"must be an integer, got {best_of!r}", "invalid_type")
        if best_of != (1 if n is None else n):
            raise unsupported(
                "best_of",
                "only best_of = n is supported (as vLLM, which dropped best_of): ask for n choices "
                "and rank them yourself",
            )
    return n


def _streaming(body: dict) -> tuple[bool, bool]:
    stream = bool(_typed(body, "stream", bool))
    options = _typed(body, "stream_options", dict)
    if options is not None and not stream:
        raise invalid("stream_options", "only allowed when stream is true")
    include_usage = (options or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise invalid("stream_options.include_usage", "must be a boolean", "invalid_type")
    return stream, bool(include_usage)


def _typed(body: dict, name: str, kind: type):
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise invalid(name, f"must be {'a boolean' if kind is bool else 'an object'}", "invalid_type")
    return value


def _sampling(body: dict, max_tokens_param: str) -> pb.SamplingParams:
    values = {}
    for name, kind in {**SAMPLING, max_tokens_param: "uint32"}.items():
        value = body.get(name)
        if value is None:
            continue
        if kind == "bool":
            if not isinstance(value, bool):
                raise invalid(name, f"must be a boolean, got {value!r}", "invalid_type")
        elif (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (kind != "number" and isinstance(value, float))
        ):
            raise invalid(
                name, f"must be {'a number' if kind == 'number' else 'an integer'}, got {value!r}", "invalid_type"
            )
        elif kind in _BOUNDS:
            low, high = _BOUNDS[kind]
            low = 1 if name == max_tokens_param else low
            if not low <= value < high:
                raise invalid(
                    name, f"must be >= {low}, got {value}" if value < low else f"must be < {high}, got {value}"
                )
        values["max_tokens" if name == max_tokens_param else name] = value
    message = pb.SamplingParams(**values)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise invalid("stop", "must be a string or a list of strings", "invalid_type")
    message.stop.extend(stops or ())
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not (isinstance(stop_ids, list) and all(_is_id(t) for t in stop_ids)):
        raise invalid("stop_token_ids", "must be a list of token ids", "invalid_type")
    message.stop_token_ids.extend(stop_ids or ())
    return message


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def _prompts(value: object) -> list[str | list[int]]:
    """A string, a list of token ids, or a list of either (a batch: one choice per prompt)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(_is_id(t) for t in value):
            return [value]
        if all(isinstance(p, str) for p in value):
            return value
        if all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in value):
            return value
    raise invalid(
        "prompt", "must be a string, a non-empty list of token ids, or a non-empty list of either", "invalid_type"
    )


def _messages(value: object) -> list[dict]:
    """Messages as templates expect them: null fields dropped (as transformers does), text parts joined."""
    if not isinstance(value, list) or not value:
        raise invalid("messages", "must be a non-empty list of messages", "invalid_type")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(where, "must be an object with a string role", "invalid_type")
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise invalid(
                    f"{where}.content",
                    'only text parts ({"type": "text", "text": ...}) are supported',
                    "unsupported_value",
                )
            message["content"] = "\n".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise invalid(f"{where}.content", "must be a string or a list of text parts", "invalid_type")
        messages.append(message)
    return messages
