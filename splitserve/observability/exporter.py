"""One ``/metrics`` endpoint: Prometheus' text format over HTTP, served from a thread.

Every process (the router and each worker) has its own registry, never prometheus_client's global
one, so that several routers or workers in one process (tests) do not collide. The endpoint is
unauthenticated: it binds the address it is given (loopback by default) and must stay on a private
network (docs/security.md).
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger("splitserve.metrics")


class MetricsServer:
    """``start`` binds ``host:port`` (0: any free port) and serves ``registry``; ``stop`` closes the
    listening socket, so nothing lingers after the process's servers stop."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.address = ""
        self._httpd = None
        self._thread = None

    def start(self, host: str, port: int) -> str:
        """Serve; returns "host:port" (the port it bound)."""
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise OSError(f"could not bind the metrics endpoint to {host}:{port}: {e}") from None
        bound = self._httpd.server_port
        self.address = f"[{host}]:{bound}" if ":" in host and not host.startswith("[") else f"{host}:{bound}"
        log.info("metrics on http://%s/metrics", self.address)
        return self.address

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
        self._httpd = self._thread = None
