"""A small Python client for splitserve's gRPC API.

    from splitserve.client.grpc_client import Client
    with Client("127.0.0.1:50051") as client:
        for chunk in client.stream("Once upon a time", max_tokens=32, temperature=0.7, seed=1):
            print(chunk.text, end="", flush=True)
        result = client.generate(token_ids=[1, 2, 3], max_tokens=8)   # the whole completion
        print(result.token_ids, result.finish_reason, result.ttft_ms)
        print(client.status())

Over TLS with an API key (docs/security.md): ``Client(addr, tls_ca="ca.pem", api_key="...")``;
with no ``api_key`` the variable SPLITSERVE_API_KEY is used when set.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from google.protobuf.json_format import MessageToDict

from splitserve.engine.wire import finish_label
from splitserve.rpc.security import API_KEY_ENV, ClientSecurity
from splitserve.v1 import splitserve_pb2 as pb
from splitserve.v1 import splitserve_pb2_grpc as pb_grpc


@dataclass
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    stop_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float = 0.0  # measured by this client: call start to the first token
    itl_ms: list[float] = field(default_factory=list)  # gaps between messages carrying tokens
    timing: dict = field(default_factory=dict)  # the router's breakdown
    # With sampling logprobs / prompt_logprobs: the router's entries (pb.TokenLogprobs), one per output token /
    # per prompt token after the first.
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)

    def to_json(self) -> dict:
        skip = ("itl_ms", "logprobs", "prompt_logprobs")
        values = {k: v for k, v in self.__dict__.items() if k not in skip} | {"itl_ms": self.itl_ms}
        if self.logprobs or self.prompt_logprobs:
            values |= {k: [MessageToDict(e) for e in getattr(self, k)] for k in ("logprobs", "prompt_logprobs")}
        return values


def make_request(
    prompt: str | None = None, token_ids: Sequence[int] | None = None, request_id: str | None = None, **sampling
) -> pb.GenerateRequest:
    """``sampling`` takes SamplingParams' field names; None values stay unset (the server's default)."""
    values = {k: v for k, v in sampling.items() if v is not None}
    for key in ("stop", "stop_token_ids"):
        if key in values and isinstance(values[key], (str, int)):
            values[key] = [values[key]]
    message = pb.GenerateRequest(sampling=pb.SamplingParams(**values))
    if prompt is not None:
        message.prompt = prompt
    if token_ids is not None:
        message.token_ids.extend(token_ids)
    if request_id is not None:
        message.request_id = request_id
    return message


class Client:
    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        timeout_s: float | None = 600.0,
        *,
        api_key: str | None = None,
        tls: bool = False,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        """``tls``: TLS trusting the system's roots; ``tls_ca``: TLS trusting this CA (PEM file);
        ``tls_cert``/``tls_key``: a client certificate, for a server that requires one."""
        self.address, self.timeout_s = address, timeout_s
        self.channel = ClientSecurity(
            api_key or os.environ.get(API_KEY_ENV) or None, tls, tls_ca, tls_cert, tls_key
        ).channel(address)
        self.stub = pb_grpc.SplitServeStub(self.channel)

    def stream(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
        **sampling,
    ) -> Iterator[pb.GenerateResponse]:
        """The raw streamed responses; cancelling the iterator (``close()``) cancels the request."""
        call = self.stub.Generate(
            make_request(prompt, token_ids, request_id, **sampling), timeout=timeout_s or self.timeout_s
        )
        try:
            yield from call
        finally:
            call.cancel()

    def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
        **sampling,
    ) -> Completion:
        result = Completion()
        start = last = time.monotonic()
        for message in self.stream(prompt, token_ids=token_ids, request_id=request_id, timeout_s=timeout_s, **sampling):
            now = time.monotonic()
            if message.token_ids:
                if not result.token_ids:
                    result.ttft_ms = (now - start) * 1e3
                else:
                    result.itl_ms.append((now - last) * 1e3)
                last = now
            result.request_id = message.request_id
            result.token_ids.extend(message.token_ids)
            result.logprobs.extend(message.logprobs)
            result.prompt_logprobs.extend(message.prompt_logprobs)
            result.text += message.text
            if message.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                result.finish_reason = finish_label(message.finish_reason)
                result.stop_reason = message.stop_reason
                u = message.usage
                result.prompt_tokens, result.completion_tokens, result.cached_tokens = (
                    u.prompt_tokens,
                    u.completion_tokens,
                    u.cached_tokens,
                )
                t = message.timing
                result.timing = {f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields}
        return result

    def status(self, timeout_s: float = 10.0) -> pb.GetStatusResponse:
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=timeout_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
