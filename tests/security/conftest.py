"""Certificates for the security tests, made the way `splitserve make-certs` makes them."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def certs(tmp_path_factory):
    """A throwaway CA with a server certificate (server and client usage) and a client certificate."""
    from splitserve.tools.certs import make_certs

    return make_certs(tmp_path_factory.mktemp("certs") / "ca1")


@pytest.fixture(scope="session")
def other_certs(tmp_path_factory):
    """Certificates of another CA, which nobody trusts."""
    from splitserve.tools.certs import make_certs

    return make_certs(tmp_path_factory.mktemp("certs") / "ca2")
