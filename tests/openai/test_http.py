"""The OpenAI API's HTTP edge without workers: a real router (not started: no worker, no gRPC port)
and its OpenAI server on a loop thread. API keys, TLS, malformed and refused requests, the error
shape, and the router's status codes mapped to HTTP. Generation is tested against a served model
in test_openai_api.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import threading
import urllib.error
import urllib.request
from dataclasses import replace

import openai
import pytest

from splitserve.common.errors import ServingError
from splitserve.router.config import RouterConfig
from splitserve.router.openai.parse import Job
from splitserve.router.openai.server import OpenAIServer
from splitserve.router.server import Router
from splitserve.rpc.security import PublicSecurity
from splitserve.tools.certs import make_certs
from splitserve.v1 import splitserve_pb2 as pb

MESSAGES = [{"role": "user", "content": "Hi"}]


class Served:
    """An OpenAI server in front of an unstarted router, on its own event loop thread."""

    def __init__(self, config: RouterConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.router = Router(config)
        self.server = OpenAIServer(self.router)
        self.address = self.call(self.server.start("127.0.0.1", 0))

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(10)

    def stop(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        assert not self.thread.is_alive(), "the event loop thread did not end within 5 s"


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    served = Served(RouterConfig(model_dir=str(tiny_model_dir), max_message_bytes=4096))
    yield served
    served.stop()


def client_of(served: Served, scheme: str = "http", **options) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{scheme}://{served.address}/v1",
        api_key=options.pop("api_key", "unused"),
        max_retries=0,
        timeout=10,
        **options,
    )


def post(served: Served, path: str, body: bytes, method: str = "POST") -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://{served.address}{path}", data=body, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_malformed_requests_get_openai_errors(plain):
    status, body = post(plain, "/v1/completions", b'{"prompt": "Hi",')
    assert (
        status == 400 and body["error"]["code"] == "invalid_json" and body["error"]["type"] == "invalid_request_error"
    )
    assert set(body["error"]) == {"message", "type", "param", "code"}
    status, body = post(plain, "/v1/chat/completions", b'["not", "an", "object"]')
    assert status == 400 and body["error"]["code"] == "invalid_type"
    status, body = post(plain, "/v1/embeddings", b"{}")
    assert status == 404 and body["error"]["message"] == "POST /v1/embeddings: Not Found"
    status, body = post(plain, "/v1/completions", None, method="GET")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    # Twice the router's message limit (4 KiB here) is read, then refused by name; past that, unread.
    status, body = post(plain, "/v1/completions", json.dumps({"prompt": "x " * 3000}).encode())
    assert status == 400 and body["error"]["param"] == "prompt" and "over the limit" in body["error"]["message"]
    status, body = post(plain, "/v1/completions", json.dumps({"prompt": "x" * 9000}).encode())
    assert status == 413 and body["error"]["code"] == "request_entity_too_large"


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("best_of", 2),
        ("suffix", "end"),
        ("logit_bias", {"7": 1.0}),
    ],
)
def test_completion_parameters_that_cannot_be_honoured_are_refused_by_name(plain, param, value):
    with pytest.raises(openai.BadRequestError) as e:
        client_of(plain).completions.create(model=plain.router.model_name, prompt="Hi", extra_body={param: value})
    assert (e.value.param, e.value.code) == (param, "unsupported_parameter")


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("echo", True),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("response_format", {"type": "json_object"}),
        ("tool_choice", "required"),
    ],
)
def test_chat_parameters_that_cannot_be_honoured_are_refused_by_name(plain, param, value):
    with pytest.raises(openai.BadRequestError) as e:
        client_of(plain).chat.completions.create(
            model=plain.router.model_name, messages=MESSAGES, extra_body={param: value}
        )
    assert (e.value.param, e.value.code) == (param, "unsupported_parameter")


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"prompt": "Hi", "temperature": "hot"}, "temperature", "invalid_type"),
        ({"prompt": "Hi", "max_tokens": 2.5}, "max_tokens", "invalid_type"),
        ({"prompt": "Hi", "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"prompt": "Hi", "max_tokens": 0, "echo": False}, "max_tokens", "invalid_value"),
        ({"prompt": "Hi", "logprobs": 21}, "logprobs", "invalid_value"),
        ({"prompt": "Hi", "logprobs": -1}, "logprobs", "invalid_value"),
        ({"prompt": "Hi", "logprobs": True}, "logprobs", "invalid_type"),
        ({"prompt": "Hi", "logprobs": 1.5}, "logprobs", "invalid_type"),
        ({"prompt": "Hi", "echo": "yes"}, "echo", "invalid_type"),
        ({"prompt": "", "echo": True}, "prompt", "invalid_value"),
        ({"prompt": "Hi", "max_tokens": 2**40}, "max_tokens", "invalid_value"),
        ({"prompt": "Hi", "seed": -1}, "seed", "invalid_value"),
        ({"prompt": "Hi", "top_k": -2}, "top_k", "invalid_value"),
        ({"prompt": "Hi", "stop": [1, 2]}, "stop", "invalid_type"),
        ({"prompt": "Hi", "stop": ["s"] * 17}, "stop", "invalid_value"),
        ({"prompt": "Hi", "ignore_eos": "yes"}, "ignore_eos", "invalid_type"),
        ({"prompt": "Hi", "n": "2"}, "n", "invalid_type"),
        ({"prompt": "Hi", "n": 2.0}, "n", "invalid_type"),
        ({"prompt": "Hi", "n": 0}, "n", "invalid_value"),
        ({"prompt": "Hi", "n": 17}, "n", "invalid_value"),  # over the router's max_n
        ({"prompt": "Hi", "n": 2, "best_of": "3"}, "best_of", "invalid_type"),
        ({"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"prompt": ""}, "prompt", "invalid_value"),
        ({"prompt": [1, -2]}, "prompt", "invalid_type"),
        ({"prompt": [99999]}, "prompt", "invalid_value"),
        ({"prompt": ["a", [1]]}, "prompt", "invalid_type"),
        ({}, "prompt", "invalid_type"),
    ],
)
def test_bad_completion_requests_name_the_parameter(plain, body, param, code):
    status, answer = post(plain, "/v1/completions", json.dumps(body).encode())
    assert status == 400 and (answer["error"]["param"], answer["error"]["code"]) == (param, code)
    assert answer["error"]["message"].startswith(f"{param}: ")


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"logprobs": 1}, "logprobs", "invalid_type"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
        ({"logprobs": True, "top_logprobs": "2"}, "top_logprobs", "invalid_type"),
        ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ],
)
def test_bad_chat_logprobs_name_the_parameter(plain, extra, param, code):
    status, answer = post(plain, "/v1/chat/completions", json.dumps({"messages": MESSAGES, **extra}).encode())
    assert status == 400 and (answer["error"]["param"], answer["error"]["code"]) == (param, code)
    assert answer["error"]["message"].startswith(f"{param}: ")


def test_logprobs_and_echo_are_translated_for_the_router(plain):
    from splitserve.router.openai.parse import parse_chat, parse_completion

    model = plain.server.model
    job = parse_completion({"prompt": [5, 6, 7], "logprobs": 2, "echo": True, "max_tokens": 0}, model, "r")
    (request,) = job.requests
    assert (request.sampling.logprobs, request.sampling.prompt_logprobs, request.sampling.max_tokens) == (2, 2, 1)
    assert (job.logprobs, job.echo_only, job.echo[0][1]) == (2, True, [5, 6, 7])
    job = parse_completion({"prompt": "Hi", "logprobs": 0}, model, "r")
    assert job.requests[0].sampling.logprobs == 0 and not job.requests[0].sampling.HasField("prompt_logprobs")
    assert job.echo is None and job.requests[0].prompt == "Hi"
    job = parse_chat({"messages": MESSAGES, "logprobs": True}, model, "r")
    assert job.logprobs == 0 and job.requests[0].sampling.logprobs == 0
    job = parse_chat({"messages": MESSAGES, "logprobs": False, "top_logprobs": 0}, model, "r")
    assert job.logprobs is None and not job.requests[0].sampling.HasField("logprobs")


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("Hi", "messages"),
        ([{"content": "no role"}], "messages[0]"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content"),
        ([{"role": "user", "content": 7}], "messages[0].content"),
        ([{"role": "user"}], "messages"),  # the template reads content: its own error, naming messages
    ],
)
def test_bad_chat_messages_name_the_parameter(plain, messages, param):
    status, answer = post(plain, "/v1/chat/completions", json.dumps({"messages": messages}).encode())
    assert status == 400 and answer["error"]["param"] == param


def test_text_parts_are_joined_into_one_message(plain):
    from splitserve.router.openai.parse import parse_chat

    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    joined = [{"role": "user", "content": "Hello\nthere"}]
    ids = [parse_chat({"messages": m}, plain.server.model, "r").requests[0].token_ids for m in (parts, joined)]
    assert ids[0] == ids[1] and len(ids[0]) > 5


def test_no_chat_template_refuses_chat_naming_it(untemplated_model_dir):
    served = Served(RouterConfig(model_dir=str(untemplated_model_dir)))
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client_of(served).chat.completions.create(model="no-template", messages=MESSAGES)
        assert (e.value.param, e.value.code) == ("messages", "chat_template_missing")
        assert "chat_template" in e.value.body["message"]
    finally:
        served.stop()


def fail_after(monkeypatch, router, messages: list[pb.GenerateResponse], error: ServingError) -> None:
    """Stand-ins for Router.admitted and Router.observed: every request yields these messages, then fails."""

    async def observed(run, time_remaining=None):
        for message in messages:
            yield message
        raise error

    @contextlib.contextmanager
    def admitted(request):
        yield object()

    monkeypatch.setattr(router, "admitted", admitted)
    monkeypatch.setattr(router, "observed", observed)


@pytest.mark.parametrize("stream", [False, True])
def test_a_failure_before_any_output_keeps_its_http_status(plain, monkeypatch, stream):
    queue_full = ServingError("RESOURCE_EXHAUSTED", "the router's queue is full (1024 requests)")
    fail_after(monkeypatch, plain.router, [], queue_full)
    with pytest.raises(openai.RateLimitError) as e:
        client_of(plain).completions.create(model=plain.router.model_name, prompt="Hi", stream=stream)
    assert e.value.body["message"] == queue_full.message and e.value.code == "rate_limit_exceeded"


def test_a_failure_mid_stream_is_sent_as_an_error_event(plain, monkeypatch):
    lost = ServingError("UNAVAILABLE", "decode worker decode-0 failed; gave up after 3 migrations")
    fail_after(monkeypatch, plain.router, [pb.GenerateResponse(token_ids=[7], text="Hel")], lost)
    stream = client_of(plain).completions.create(model=plain.router.model_name, prompt="Hi", stream=True)
    assert next(stream).choices[0].text == "Hel"
    with pytest.raises(openai.APIError) as e:
        next(stream)
    assert e.value.message == lost.message and e.value.code == "service_unavailable"


@pytest.mark.parametrize(
    ("status_name", "http", "error_type"),
    [
        ("RESOURCE_EXHAUSTED", 429, "rate_limit_error"),
        ("UNAVAILABLE", 503, "server_error"),
        ("ALREADY_EXISTS", 409, "invalid_request_error"),
        ("INTERNAL", 500, "server_error"),
        ("INVALID_ARGUMENT", 400, "invalid_request_error"),
    ],
)
def test_router_status_codes_map_to_http(status_name, http, error_type):
    job = Job("chat", [], params={"sampling.max_tokens": "max_completion_tokens"})
    error = job.error(ServingError(status_name, "sampling.max_tokens: something about it"))
    assert (error.status, error.type) == (http, error_type)
    if status_name in ("INVALID_ARGUMENT", "ALREADY_EXISTS"):
        assert (error.param, error.message) == ("max_completion_tokens", "max_completion_tokens: something about it")


def test_api_keys_are_required_when_configured(tiny_model_dir):
    security = PublicSecurity(api_keys=("k1", "k2"))
    served = Served(RouterConfig(model_dir=str(tiny_model_dir), public_security=security))
    try:
        status, body = post(served, "/v1/models", None, method="GET")  # no Authorization header
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert "Authorization: Bearer" in body["error"]["message"]
        with pytest.raises(openai.AuthenticationError) as e:
            client_of(served, api_key="wrong").models.list()
        assert e.value.code == "invalid_api_key" and "not valid" in e.value.body["message"]
        assert [m.id for m in client_of(served, api_key="k2").models.list().data] == [served.router.model_name]
        with pytest.raises(openai.AuthenticationError):
            client_of(served, api_key="wrong").completions.create(model="x", prompt="Hi")  # before anything else
        with urllib.request.urlopen(f"http://{served.address}/health", timeout=10) as response:  # open, as on gRPC
            assert response.status == 200
    finally:
        served.stop()


def test_tls_serves_https_with_the_public_certificate(tiny_model_dir, tmp_path):
    certs = make_certs(tmp_path / "certs")
    security = PublicSecurity(tls_cert=str(certs / "server.pem"), tls_key=str(certs / "server.key"), api_keys=("k",))
    served = Served(RouterConfig(model_dir=str(tiny_model_dir), public_security=security))
    try:
        trusted = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(certs / "ca.pem")))
        client = client_of(served, "https", api_key="k", http_client=trusted)
        assert client.models.list().data[0].owned_by == "splitserve"
        with pytest.raises(openai.APIConnectionError):  # plaintext to a TLS port
            client_of(served, api_key="k").models.list()
        with pytest.raises(openai.APIConnectionError):  # a CA the client does not trust
            client_of(served, "https", api_key="k").models.list()
    finally:
        served.stop()


def test_tls_client_certificates_when_a_client_ca_is_set(tiny_model_dir, tmp_path):
    certs = make_certs(tmp_path / "certs")
    security = PublicSecurity(
        tls_cert=str(certs / "server.pem"), tls_key=str(certs / "server.key"), tls_client_ca=str(certs / "ca.pem")
    )
    served = Served(RouterConfig(model_dir=str(tiny_model_dir), public_security=security))
    try:
        context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        with pytest.raises(openai.APIConnectionError):
            client_of(served, "https", http_client=openai.DefaultHttpxClient(verify=context)).models.list()
        context.load_cert_chain(certs / "client.pem", certs / "client.key")
        assert client_of(served, "https", http_client=openai.DefaultHttpxClient(verify=context)).models.list().data
    finally:
        served.stop()


def test_a_missing_certificate_is_named(tiny_model_dir, tmp_path):
    from splitserve.rpc.security import SecurityError

    security = PublicSecurity(tls_cert=str(tmp_path / "nope.pem"), tls_key=str(tmp_path / "nope.key"))
    router = Router(replace(RouterConfig(model_dir=str(tiny_model_dir)), public_security=security))
    with pytest.raises(SecurityError, match="security.tls_cert"):
        asyncio.run(OpenAIServer(router).start("127.0.0.1", 0))
