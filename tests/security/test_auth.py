"""Tokens, TLS and mTLS on tiny in-process gRPC servers (sync and grpc.aio), with certificates from
`splitserve make-certs`: who may call what, and what a refused caller sees."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from concurrent import futures
from dataclasses import replace

import grpc
import pytest
from cryptography import x509

from splitserve.rpc.auth import AccessPolicy, Credential, open_channel, server_interceptors
from splitserve.rpc.security import ClientSecurity, InternalSecurity, PublicSecurity, SecurityError

GENERATE = "/splitserve.v1.SplitServe/Generate"
SCALE = "/splitserve.internal.v1.Admin/Scale"
HEALTH = "/grpc.health.v1.Health/Check"
ECHO = ("/test.Echo/Unary", "/test.Echo/Stream", "/test.Echo/Both")  # unary-unary, unary-stream, stream-stream


def auth(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


# ---- the policy ----------------------------------------------------------------------------------


def test_public_policy_decides_by_method():
    policy = PublicSecurity(api_keys=("key-1", "key-2")).policy(cluster_token="cluster")
    assert policy.check(HEALTH, ()) is None  # probes send no metadata
    assert "needs an API key" in policy.check(GENERATE, ()) and "authorization: Bearer" in policy.check(GENERATE, ())
    assert "not valid" in policy.check(GENERATE, auth("key-3"))
    assert policy.check(GENERATE, auth("key-2")) is None
    assert policy.check("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", auth("key-1")) is None
    assert "must be 'Bearer <token>'" in policy.check(GENERATE, (("authorization", "Basic a2V5LTE="),))
    assert "cluster token" in policy.check(SCALE, auth("key-1"))  # an API user may not scale
    assert policy.check(SCALE, auth("cluster")) is None
    no_cluster = PublicSecurity(api_keys=("key-1",)).policy(cluster_token=None)
    assert no_cluster.check(SCALE, auth("key-1")) is None and no_cluster.check(SCALE, ()) is not None
    assert not PublicSecurity().policy(None).enabled and server_interceptors(PublicSecurity().policy(None), True) == []


def test_tokens_compare_in_full():
    credential = Credential("the cluster token", ("secret",))
    assert credential.accepts("secret")
    assert not any(credential.accepts(t) for t in ("secre", "secret2", "Secret", ""))
    policy = AccessPolicy([("", credential)])
    assert policy.check("/x/y", (("authorization", b"Bearer secret"),)) is None  # binary-looking values too


def test_credential_files(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# the API keys\nkey-1\n\n  key-2  \n")
    assert PublicSecurity(api_keys=("key-0",), api_key_file=str(keys)).keys() == ("key-0", "key-1", "key-2")
    with pytest.raises(SecurityError, match="security.api_key_file: cannot read"):
        PublicSecurity(api_key_file=str(tmp_path / "missing")).keys()
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(SecurityError, match="holds no token"):
        InternalSecurity(token_file=str(tmp_path / "empty")).cluster_token()
    with pytest.raises(ValueError, match="give all three"):
        InternalSecurity(tls_cert="a.pem")
    with pytest.raises(ValueError, match="at most one"):
        InternalSecurity(token="a", token_file="b")
    with pytest.raises(ValueError, match="tls_client_ca"):
        PublicSecurity(tls_client_ca="ca.pem")


# ---- tiny servers --------------------------------------------------------------------------------


def _echo_handlers(aio: bool) -> grpc.GenericRpcHandler:
    if aio:

        async def unary(request, context):
            return request

        async def stream(request, context):
            for _ in range(2):
                yield request

        async def both(requests, context):
            async for request in requests:
                yield request

    else:

        def unary(request, context):
            return request

        def stream(request, context):
            yield from (request, request)

        def both(requests, context):
            yield from requests

    return grpc.method_handlers_generic_handler(
        "test.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
            "Both": grpc.stream_stream_rpc_method_handler(both),
        },
    )


class EchoServer:
    """An echo service on 127.0.0.1 behind the given policy and credentials: a sync server, or a
    grpc.aio one on its own loop thread."""

    def __init__(self, policy: AccessPolicy, credentials: grpc.ServerCredentials | None, aio: bool) -> None:
        self.aio = aio
        if aio:
            self.loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self.thread.start()
            self.port = self._run(self._start_aio(policy, credentials))
        else:
            self.server = grpc.server(
                futures.ThreadPoolExecutor(4), interceptors=server_interceptors(policy, aio=False)
            )
            self.server.add_generic_rpc_handlers((_echo_handlers(False),))
            self.port = self._bind(credentials)
            self.server.start()
        self.address = f"127.0.0.1:{self.port}"

    def _bind(self, credentials) -> int:
        address = "127.0.0.1:0"
        return (
            self.server.add_insecure_port(address)
            if credentials is None
            else self.server.add_secure_port(address, credentials)
        )

    async def _start_aio(self, policy, credentials) -> int:
        self.server = grpc.aio.server(interceptors=server_interceptors(policy, aio=True))
        self.server.add_generic_rpc_handlers((_echo_handlers(True),))
        port = self._bind(credentials)
        await self.server.start()
        return port

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(10)

    def stop(self) -> None:
        if self.aio:
            self._run(self.server.stop(0))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            assert not self.thread.is_alive(), "the event loop thread did not end within 5 s"
        else:
            assert self.server.stop(0).wait(5), "the gRPC server did not stop within 5 s"


def call_each_kind(channel) -> list:
    """Every echo method once; a status code (or the echoed bytes) per method."""
    results = []
    for method in ECHO:
        try:
            if method.endswith("Unary"):
                results.append(channel.unary_unary(method)(b"hi", timeout=5))
            elif method.endswith("Stream"):
                results.append(list(channel.unary_stream(method)(b"hi", timeout=5)))
            else:
                results.append(list(channel.stream_stream(method)(iter([b"a", b"b"]), timeout=5)))
        except grpc.RpcError as e:
            results.append(e.code())
    return results


ECHOED = [b"hi", [b"hi", b"hi"], [b"a", b"b"]]


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "aio"])
def test_a_server_refuses_calls_without_the_token(aio):
    server = EchoServer(InternalSecurity(token="t0k3n").policy(), None, aio)
    try:
        for token, expected in [
            (None, [grpc.StatusCode.UNAUTHENTICATED] * 3),
            ("wrong", [grpc.StatusCode.UNAUTHENTICATED] * 3),
            ("t0k3n", ECHOED),
        ]:
            with open_channel(server.address, token=token) as channel:
                assert call_each_kind(channel) == expected, token
        with open_channel(server.address) as channel, pytest.raises(grpc.RpcError) as e:
            channel.unary_unary(ECHO[0])(b"hi", timeout=5)
        assert "needs the cluster token" in e.value.details()
    finally:
        server.stop()


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "aio"])
def test_aio_clients_send_the_token_on_every_kind_of_call(aio):
    server = EchoServer(InternalSecurity(token="t0k3n").policy(), None, aio)

    async def calls(token):
        async with open_channel(server.address, token=token, aio=True) as channel:
            try:
                unary = await channel.unary_unary(ECHO[0])(b"hi", timeout=5)
                stream = [m async for m in channel.unary_stream(ECHO[1])(b"hi", timeout=5)]
                both = [m async for m in channel.stream_stream(ECHO[2])(iter([b"a", b"b"]), timeout=5)]
                return [unary, stream, both]
            except grpc.RpcError as e:
                return e.code()

    try:
        assert asyncio.run(calls("t0k3n")) == ECHOED
        assert asyncio.run(calls("other")) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop()


# ---- TLS and mTLS --------------------------------------------------------------------------------


def internal(certs, **kw) -> InternalSecurity:
    return InternalSecurity(str(certs / "server.pem"), str(certs / "server.key"), str(certs / "ca.pem"), **kw)


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "aio"])
def test_internal_servers_require_a_client_certificate_of_the_cluster_ca(aio, certs, other_certs):
    security = internal(certs, token="t0k3n")
    server = EchoServer(security.policy(), security.server_credentials(), aio)
    unavailable = [grpc.StatusCode.UNAVAILABLE] * 3
    try:
        with security.channel(server.address) as channel:  # mTLS, checked against splitserve-internal
            assert call_each_kind(channel) == ECHOED
        with replace(security, server_name="").channel(server.address) as channel:  # checked against 127.0.0.1
            assert call_each_kind(channel) == ECHOED
        with replace(security, token=None).channel(server.address) as channel:
            assert call_each_kind(channel) == [grpc.StatusCode.UNAUTHENTICATED] * 3
        no_client_cert = ClientSecurity(api_key="t0k3n", tls_ca=str(certs / "ca.pem"))
        with no_client_cert.channel(server.address) as channel:  # the handshake fails
            assert call_each_kind(channel) == unavailable
        foreign = internal(other_certs, token="t0k3n")  # a certificate from a CA the server does not trust
        with open_channel(
            server.address,
            [("grpc.ssl_target_name_override", "splitserve-internal")],
            foreign.channel_credentials(),
            "t0k3n",
        ) as channel:
            assert call_each_kind(channel) == unavailable
        with open_channel(server.address, token="t0k3n") as channel:  # plaintext
            assert call_each_kind(channel) == unavailable
    finally:
        server.stop()


def test_public_tls_with_and_without_client_certificates(certs):
    ca, server_pair = str(certs / "ca.pem"), (str(certs / "server.pem"), str(certs / "server.key"))
    tls = PublicSecurity(*server_pair)
    server = EchoServer(tls.policy(None), tls.server_credentials(), aio=True)
    try:
        with ClientSecurity(tls_ca=ca).channel(server.address) as channel:
            assert call_each_kind(channel) == ECHOED
        with ClientSecurity().channel(server.address) as channel:  # plaintext to a TLS port
            assert call_each_kind(channel) == [grpc.StatusCode.UNAVAILABLE] * 3
        with ClientSecurity(tls=True).channel(server.address) as channel:  # the system's CAs do not know ours
            assert call_each_kind(channel) == [grpc.StatusCode.UNAVAILABLE] * 3
    finally:
        server.stop()
    mutual = PublicSecurity(*server_pair, tls_client_ca=ca, api_keys=("key-1",))
    server = EchoServer(mutual.policy(None), mutual.server_credentials(), aio=True)
    try:
        with ClientSecurity(api_key="key-1", tls_ca=ca).channel(server.address) as channel:
            assert call_each_kind(channel) == [grpc.StatusCode.UNAVAILABLE] * 3
        client = ClientSecurity(
            api_key="key-1", tls_ca=ca, tls_cert=str(certs / "client.pem"), tls_key=str(certs / "client.key")
        )
        with client.channel(server.address) as channel:
            assert call_each_kind(channel) == ECHOED
        with replace(client, api_key=None).channel(server.address) as channel:  # a certificate is not a key
            assert call_each_kind(channel) == [grpc.StatusCode.UNAUTHENTICATED] * 3
    finally:
        server.stop()


def test_serve_flags_and_variables_fill_the_security_section(monkeypatch, tmp_path):
    from splitserve.cli import _security_overrides, build_parser
    from splitserve.deploy.config import DeploymentConfig

    config = DeploymentConfig.from_dict({"security": {"api_keys": ["from-file"], "cluster_token": "in-config"}})
    monkeypatch.setenv("SPLITSERVE_API_KEY", "from-env")
    monkeypatch.setenv("SPLITSERVE_CLUSTER_TOKEN", "from-env")
    args = build_parser().parse_args(["serve", "--api-key", "from-flag", "--tls-cert", "s.pem", "--tls-key", "s.key"])
    s = _security_overrides(args, config).security
    assert s.api_keys == ("from-file", "from-flag", "from-env") and s.cluster_token == "in-config"
    assert (s.tls_cert, s.tls_key) == ("s.pem", "s.key")
    s = _security_overrides(build_parser().parse_args(["serve"]), DeploymentConfig()).security
    assert s.cluster_token == "from-env" and s.api_keys == ("from-env",)
    args = build_parser().parse_args(["serve", "--cluster-token-file", str(tmp_path / "t")])
    s = _security_overrides(args, config).security
    assert s.cluster_token is None and s.cluster_token_file == str(tmp_path / "t")
    with pytest.raises(ValueError, match="tls_cert, tls_key"):
        _security_overrides(build_parser().parse_args(["serve", "--tls-cert", "s.pem"]), DeploymentConfig())


def test_make_certs_command(tmp_path):
    def run(*a):
        return subprocess.run(
            [sys.executable, "-m", "splitserve.cli", "make-certs", *a], capture_output=True, text=True, timeout=60
        )

    out = run("--out", str(tmp_path / "c"), "--host", "10.1.2.3", "--host", "head.example")
    assert out.returncode == 0, out.stderr
    names = {p.name for p in (tmp_path / "c").iterdir()}
    assert names == {f"{s}.{e}" for s in ("ca", "server", "client") for e in ("pem", "key")}
    assert all((tmp_path / "c" / f"{s}.key").stat().st_mode & 0o077 == 0 for s in ("ca", "server", "client"))
    cert = x509.load_pem_x509_certificate((tmp_path / "c" / "server.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "splitserve-internal", "head.example"} <= set(san.get_values_for_type(x509.DNSName))
    assert {"127.0.0.1", "10.1.2.3"} <= {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    again = run("--out", str(tmp_path / "c"))
    assert again.returncode == 2 and "already holds" in again.stderr


def test_a_call_on_a_closed_token_channel_fails_with_a_status():
    """With interceptors a call reaches the channel a little later, from a task; one whose channel
    closed by then (its worker left the router's pool) must end as a gRPC error, which the router's
    status poller handles, not as a UsageError."""
    server = EchoServer(InternalSecurity(token="t0k3n").policy(), None, aio=True)

    async def call_after_close():
        channel = open_channel(server.address, token="t0k3n", aio=True)
        await channel.close()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await channel.unary_unary(ECHO[0])(b"hi", timeout=5)
        return e.value.code()

    try:
        assert asyncio.run(call_after_close()) == grpc.StatusCode.CANCELLED
    finally:
        server.stop()
