"""The flags every client command shares (``generate``, ``status``, ``scale``, ``bench``): how it reaches a
router whose public port has TLS or API keys. Apart from ``splitserve.cli`` so that ``splitserve.bench``
reads them without importing the command line that imports it."""

from __future__ import annotations

import argparse
import os


def add_client_security_arguments(p: argparse.ArgumentParser) -> None:
    """How a client reaches a router whose public port has TLS or API keys (docs/security.md)."""
    g = p.add_argument_group("security")
    g.add_argument("--api-key", default=None, help="bearer token for the API (default: $SPLITSERVE_API_KEY)")
    g.add_argument("--tls", action="store_true", help="connect over TLS, trusting the system's CAs")
    g.add_argument("--tls-ca", metavar="PEM", help="connect over TLS, trusting this CA")
    g.add_argument("--tls-cert", metavar="PEM", help="a client certificate, for a server that requires one")
    g.add_argument("--tls-key", metavar="PEM", help="the client certificate's key")


def client_security(args: argparse.Namespace) -> dict:
    """The keyword arguments of ``Client`` and ``ClientSecurity`` that the flags ask for."""
    from splitserve.rpc.security import API_KEY_ENV

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    return {
        "api_key": api_key,
        "tls": args.tls,
        "tls_ca": args.tls_ca,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
    }
