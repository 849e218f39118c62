"""The router beside the driver: its asyncio loop on a thread of its own, and its addresses as the
workers and the clients dial them."""

from __future__ import annotations

import asyncio
import logging
import threading

from splitserve.deploy.ray_runtime import RayRuntime, unwildcard
from splitserve.router.server import Router

log = logging.getLogger("splitserve.deploy.deployment")

ROUTER_GRACE_S = 0.5  # at stop, calls in flight may end by themselves; then they are cancelled (UNAVAILABLE)
LOOP_JOIN_S = 5.0  # the loop's thread, once the loop is told to stop
STOP_SLACK_S = 5.0  # beyond a stop's own grace, for the call into the loop to come back


class RouterHost:
    def __init__(self) -> None:
        self.router: Router | None = None
        self.address = ""  # the router's public port, as clients dial it
        self.internal_address = ""  # the router's internal port, as workers dial it to register
        self.openai_address = ""  # the OpenAI-compatible HTTP API ("host:port"), when openai_port is set
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, router: Router, ray: RayRuntime) -> str:
        """Run ``router`` on a new loop thread; returns its public address as clients dial it."""
        self.router = router
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router-loop", daemon=True)
        self._thread.start()
        self.address = ray.advertised(self.run(router.start()))
        self.internal_address = ray.advertised(router.internal_address)
        if router.metrics_address:
            router.metrics_address = unwildcard(router.metrics_address)
        self.openai_address = ray.advertised(router.openai_address) if router.openai_address else ""
        return self.address

    def run(self, coroutine, timeout_s: float = 60.0):
        """Run a coroutine on the router's loop from another thread, and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stop(self) -> None:
        """New calls refused, calls in flight cancelled after ``ROUTER_GRACE_S``; then the loop ends."""
        if self.router is not None and self.loop is not None:
            try:
                self.run(self.router.stop(ROUTER_GRACE_S), ROUTER_GRACE_S + STOP_SLACK_S)
            except Exception as e:
                log.warning("router stop: %s", e)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(LOOP_JOIN_S)
            self.router = None
