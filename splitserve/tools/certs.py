"""``splitserve make-certs``: a throwaway certificate authority and certificates for trying TLS and
mTLS (docs/security.md). Production deployments should use their own PKI; these are for a test
cluster, a laptop or the test suite.

Written to the output folder (keys readable by the owner only):

- ``ca.pem``, ``ca.key``: the CA (the trust anchor: ``tls_client_ca``, ``internal_tls_ca``, ``--tls-ca``)
- ``server.pem``, ``server.key``: for the router's public port, and for every process on the internal
  links (server and client usage): names ``localhost``, ``splitserve-internal``, ``127.0.0.1``,
  ``::1`` and every ``--host``
- ``client.pem``, ``client.key``: a client certificate, for a public port with ``tls_client_ca``
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

INTERNAL_NAME = "splitserve-internal"  # the name internal clients verify (security.internal_tls_server_name)
DEFAULT_NAMES = ("localhost", INTERNAL_NAME, "127.0.0.1", "::1")


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "splitserve"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries = []
    for name in dict.fromkeys(names):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _certificate(
    subject: x509.Name,
    key,
    issuer: x509.Name,
    issuer_key,
    days: int,
    ca: bool,
    usages: Sequence = (),
    names: Sequence[str] = (),
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
    if names:
        builder = builder.add_extension(_san(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(folder: Path, stem: str, cert: x509.Certificate, key) -> None:
    (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = folder / f"{stem}.key"
    key_path.touch(mode=0o600)
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def make_certs(out: str | Path, hosts: Sequence[str] = (), days: int = 30) -> Path:
    """Write a CA, a server certificate (valid for DEFAULT_NAMES and ``hosts``) and a client
    certificate into ``out``; returns the folder."""
    if days < 1:
        raise ValueError(f"days: must be >= 1, got {days}")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    existing = [p.name for p in folder.iterdir() if p.name.endswith((".pem", ".key"))]
    if existing:
        raise FileExistsError(f"{folder} already holds {', '.join(sorted(existing))}")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("splitserve test CA")
    ca = _certificate(ca_name, ca_key, ca_name, ca_key, days, ca=True)
    _write(folder, "ca", ca, ca_key)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _certificate(
        _name("splitserve"),
        server_key,
        ca_name,
        ca_key,
        days,
        ca=False,
        usages=(ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH),
        names=(*DEFAULT_NAMES, *hosts),
    )
    _write(folder, "server", server, server_key)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _certificate(
        _name("splitserve client"),
        client_key,
        ca_name,
        ca_key,
        days,
        ca=False,
        usages=(ExtendedKeyUsageOID.CLIENT_AUTH,),
    )
    _write(folder, "client", client, client_key)
    return folder
