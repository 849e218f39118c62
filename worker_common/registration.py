"""Keeps a worker registered with its router for as long as the worker lives.

The registration is one long ``Registry.Register`` call: the router routes to the worker only while
the call is open, so a dead worker leaves the pool by itself (its connection resets, or keepalive
notices a lost node within seconds). If the call breaks while the worker lives (the router
restarted), it registers again, with backoff. Commands from the router (drain) arrive on the call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc import workers_pb2_grpc as wpb_grpc
from splitserve.rpc.options import CLIENT_OPTIONS
from splitserve.rpc.security import InternalSecurity

log = logging.getLogger("splitserve.worker")

# Re-registering after the call broke (the router restarting): the first retry soon, then doubling up to a
# cap, so that a router back within seconds sees its workers at once and a router gone for long is not
# dialled in a tight loop.
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0
STOP_JOIN_S = 5.0  # how long stop() waits for the registration thread once its call is cancelled


class Registration:
    def __init__(
        self,
        router_address: str,
        info: Callable[[], wpb.WorkerInfo],
        on_drain: Callable[[], None],
        security: InternalSecurity | None = None,
    ) -> None:
        self.router_address, self._info, self._on_drain = router_address, info, on_drain
        self.security = security or InternalSecurity()
        self.registered = threading.Event()
        self._stopped = threading.Event()
        self._call = None
        self._thread = threading.Thread(target=self._run, name="registration", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._call is not None:
            self._call.cancel()
        self._thread.join(STOP_JOIN_S)

    def _run(self) -> None:
        backoff = RETRY_FIRST_S
        with self.security.channel(self.router_address, CLIENT_OPTIONS) as channel:
            stub = wpb_grpc.RegistryStub(channel)
            while not self._stopped.is_set():
                self._call = stub.Register(self._info())
                try:
                    for command in self._call:
                        if command.kind == wpb.RegistryCommand.ACCEPTED:
                            self.registered.set()
                            backoff = RETRY_FIRST_S
                        elif command.kind == wpb.RegistryCommand.DRAIN:
                            log.info("the router asked this worker to drain")
                            self._on_drain()
                except grpc.RpcError as e:
                    if not self._stopped.is_set():
                        log.warning("registration with %s ended: %s", self.router_address, e.code().name)
                self.registered.clear()
                self._stopped.wait(backoff)
                backoff = min(2 * backoff, RETRY_MAX_S)
