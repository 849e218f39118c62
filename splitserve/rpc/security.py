"""Credentials of splitserve's gRPC links: TLS and mTLS, and which bearer token each port takes.
Torch-free; the router, the workers, kv_transfer and the clients all use it.

Two kinds of link (docs/security.md):

- **public**: clients to the router's public port. Optional TLS (``tls_cert``/``tls_key``), optional
  client certificates (``tls_client_ca``), optional API keys sent as ``authorization: Bearer <key>``.
- **internal**: router to workers, workers to the router's internal port, prefill to decode worker
  (KV-transfer control). Optional mTLS (every server requires a client certificate signed by
  ``internal_tls_ca``), optional cluster token sent as ``authorization: Bearer <token>``.

A missing or wrong token ends the call with ``UNAUTHENTICATED`` before any handler runs
(``splitserve.rpc.auth``); a missing client certificate fails the TLS handshake (the client sees
``UNAVAILABLE``).
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from splitserve.rpc import workers_pb2
from splitserve.rpc.auth import AccessPolicy, Credential, open_channel


class SecurityError(ValueError):
    """A credential file is missing or unreadable; the message names the setting."""


def read_file(path: str, setting: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise SecurityError(f"{setting}: cannot read {path}: {e.strerror or e}") from None


def read_token_file(path: str, setting: str) -> tuple[str, ...]:
    """Tokens from a file: one a line; blank lines and lines starting with # are skipped."""
    lines = read_file(path, setting).decode("utf-8", errors="strict").splitlines()
    tokens = tuple(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))
    if not tokens:
        raise SecurityError(f"{setting}: {path} holds no token")
    return tokens


# ---- the internal links ---------------------------------------------------------------------------


@dataclass(frozen=True)
class InternalSecurity:
    """What every process on the internal links needs. File paths are read where they are used: on
    every node (like the model folder), so keys never travel. The token travels by value (in the
    worker's actor arguments) unless it comes from ``token_file``, which each node reads itself."""

    tls_cert: str | None = None  # this process's certificate (server and client), PEM
    tls_key: str | None = None
    tls_ca: str | None = None  # the CA that signs every internal certificate
    server_name: str = "splitserve-internal"  # name internal certificates carry; "": the dialled host
    token: str | None = None
    token_file: str | None = None

    def __post_init__(self) -> None:
        given = [bool(x) for x in (self.tls_cert, self.tls_key, self.tls_ca)]
        if any(given) and not all(given):
            raise ValueError("internal_tls_cert, internal_tls_key, internal_tls_ca: give all three or none")
        if self.token and self.token_file:
            raise ValueError("cluster_token, cluster_token_file: give at most one")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def cluster_token(self) -> str | None:
        if self.token_file:
            return read_token_file(self.token_file, "security.cluster_token_file")[0]
        return self.token or None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_server_credentials(
            [
                (
                    read_file(self.tls_key, "security.internal_tls_key"),
                    read_file(self.tls_cert, "security.internal_tls_cert"),
                )
            ],
            root_certificates=read_file(self.tls_ca, "security.internal_tls_ca"),
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=read_file(self.tls_ca, "security.internal_tls_ca"),
            private_key=read_file(self.tls_key, "security.internal_tls_key"),
            certificate_chain=read_file(self.tls_cert, "security.internal_tls_cert"),
        )

    def channel(self, target: str, options: Sequence = (), aio: bool = False):
        """A channel to an internal server: mTLS and the cluster token when configured."""
        options = list(options)
        if self.tls and self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return open_channel(target, options, self.channel_credentials(), self.cluster_token(), aio=aio)

    def policy(self) -> AccessPolicy:
        """Every internal method needs the cluster token, when there is one."""
        token = self.cluster_token()
        return AccessPolicy([("", Credential("the cluster token", (token,) if token else ()))])

    def add_port(self, server, address: str) -> int:
        """Bind ``server`` (sync or aio) to ``address``, with mTLS when configured; returns the port."""
        return add_port(server, address, self.server_credentials())


# ---- the public port ------------------------------------------------------------------------------

HEALTH_PREFIX = "/grpc.health.v1.Health/"
ADMIN_PREFIX = f"/{workers_pb2.DESCRIPTOR.services_by_name['Admin'].full_name}/"


@dataclass(frozen=True)
class PublicSecurity:
    """The router's public port: TLS, client certificates, API keys."""

    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # set: clients must present a certificate signed by it
    api_keys: tuple[str, ...] = ()
    api_key_file: str | None = None  # more keys, one a line, read when the router starts

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert, tls_key: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca: needs tls_cert and tls_key (client certificates are checked over TLS)")

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls_cert:
            return None
        ca = read_file(self.tls_client_ca, "security.tls_client_ca") if self.tls_client_ca else None
        return grpc.ssl_server_credentials(
            [(read_file(self.tls_key, "security.tls_key"), read_file(self.tls_cert, "security.tls_cert"))],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The same TLS for an HTTP server on the router (the OpenAI API): this certificate and key,
        and client certificates signed by ``tls_client_ca`` when that is set. None without TLS."""
        if not self.tls_cert:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        for setting, path in (("tls_cert", self.tls_cert), ("tls_key", self.tls_key)):
            read_file(path, f"security.{setting}")  # a missing file is named by its setting
        try:
            context.load_cert_chain(Path(self.tls_cert).expanduser(), Path(self.tls_key).expanduser())
            if self.tls_client_ca:
                context.load_verify_locations(cadata=read_file(self.tls_client_ca, "security.tls_client_ca").decode())
                context.verify_mode = ssl.CERT_REQUIRED
        except (ssl.SSLError, ValueError) as e:
            raise SecurityError(f"security.tls_cert, tls_key, tls_client_ca: {e}") from None
        return context

    def keys(self) -> tuple[str, ...]:
        return self.api_keys + (
            read_token_file(self.api_key_file, "security.api_key_file") if self.api_key_file else ()
        )

    def policy(self, cluster_token: str | None) -> AccessPolicy:
        """Health is open (load balancers and probes send no metadata); Admin (scaling) takes the
        cluster token when there is one, else an API key; everything else an API key."""
        api = Credential("an API key", self.keys())
        admin = Credential("the cluster token", (cluster_token,)) if cluster_token else api
        return AccessPolicy([(HEALTH_PREFIX, None), (ADMIN_PREFIX, admin), ("", api)])

    def add_port(self, server, address: str) -> int:
        return add_port(server, address, self.server_credentials())


def add_port(server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Bind a sync or aio server to ``address`` (TLS when ``credentials`` are given); returns the port."""
    return server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)


API_KEY_ENV = "SPLITSERVE_API_KEY"
CLUSTER_TOKEN_ENV = "SPLITSERVE_CLUSTER_TOKEN"


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches the router's public port."""

    api_key: str | None = None  # sent as "authorization: Bearer <key>"
    tls: bool = False  # TLS, trusting tls_ca (or the system's roots without it)
    tls_ca: str | None = None
    tls_cert: str | None = None  # a client certificate, for a server with tls_client_ca
    tls_key: str | None = None

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not (self.tls or self.tls_ca or self.tls_cert):
            return None
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SecurityError("--tls-cert, --tls-key: give both or neither")
        return grpc.ssl_channel_credentials(
            root_certificates=read_file(self.tls_ca, "tls_ca") if self.tls_ca else None,
            private_key=read_file(self.tls_key, "tls_key") if self.tls_key else None,
            certificate_chain=read_file(self.tls_cert, "tls_cert") if self.tls_cert else None,
        )

    def channel(self, target: str, options: Sequence = (), aio: bool = False):
        return open_channel(target, options, self.credentials(), self.api_key, aio=aio)
