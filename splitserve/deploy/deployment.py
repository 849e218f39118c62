"""``splitserve serve``: prefill and decode workers as Ray actors, and the router beside the driver.

``Deployment`` puts together the parts of this package: the Ray it runs on (``RayRuntime``), the router
on a loop thread (``RouterHost``), where each worker goes (``Placement``), the worker actors
(``WorkerFleet``) and scaling with the live planner (``Scaler``).

Ray only places and runs the workers; requests never travel through Ray. With no Ray address an
embedded local Ray starts on loopback only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: every Ray port
binds and advertises 127.0.0.1), in a private temp folder, and stops with the deployment
(splitserve/deploy/embedded_ray.py). Every step of ``stop`` has a short deadline, so that it ends promptly
also when Ray's processes are going away at the same moment (a signal to the whole process group).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from splitserve.deploy.config import DeploymentConfig
from splitserve.deploy.fleet import WorkerFleet
from splitserve.deploy.placement import Placement
from splitserve.deploy.ray_runtime import RayRuntime
from splitserve.deploy.router_host import RouterHost
from splitserve.deploy.scaler import Scaler
from splitserve.router.server import Router

__all__ = ["Deployment", "default_model_dir"]
log = logging.getLogger("splitserve.deploy.deployment")

# Deadlines of the steps of Deployment.stop (seconds); together they stay well under 5 s.
WORKER_STOP_S = 0.5  # every worker's own stop(), all at once, while Ray still answers
RAY_KILL_S = 2.0  # the embedded Ray's processes, from SIGKILL until they are gone


def default_model_dir() -> Path:
    """The tiny demo checkpoint, written once into the user's cache folder."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "splitserve" / "models" / "tiny"
    if not (cache / "config.json").is_file():
        from splitserve.tools.make_model import make_model

        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="tiny-", dir=cache.parent))
        make_model("tiny", staging / "model", dtype="float32", seed=0)
        if not (cache / "config.json").is_file():  # another process may have won the race
            shutil.rmtree(cache, ignore_errors=True)
            (staging / "model").rename(cache)
        shutil.rmtree(staging, ignore_errors=True)
    return cache


class Deployment:
    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.model_dir = str(config.model) if config.model else str(default_model_dir())
        self.ray = RayRuntime(config.ray_address)
        self.router_host = RouterHost()
        self.placement = Placement(config)
        self.fleet = WorkerFleet(config, self.model_dir, self.placement, self.router_host)
        self.scaler = Scaler(config, self.fleet, self.router_host)

    # What callers read: the router and its addresses, the workers, the live planner.
    router = property(lambda self: self.router_host.router)
    address = property(lambda self: self.router_host.address, doc="the router's public port, as clients dial it")
    internal_address = property(lambda self: self.router_host.internal_address, doc="as workers dial it")
    openai_address = property(lambda self: self.router_host.openai_address, doc="the OpenAI API, when served")
    actors = property(lambda self: self.fleet.actors, doc="worker id -> Ray actor")
    placement_groups = property(lambda self: self.placement.groups, doc="worker id -> its ranks' group (TP > 1)")
    planner = property(lambda self: self.scaler.planner, doc="the live planner, when the config turns it on")
    temp_dir = property(lambda self: self.ray.temp_dir, doc="the embedded Ray's temp folder (None: joined, stopped)")

    @property
    def workers(self) -> list[dict]:
        """The workers in the router's pool: role, id, address, node_id, healthy."""
        return [
            {
                "role": w.spec.role,
                "worker_id": w.worker_id,
                "address": w.spec.address,
                "node_id": w.spec.node,
                "healthy": w.healthy,
            }
            for w in (self.router.pool.workers if self.router else [])
        ]

    def start(self) -> str:
        """Bring everything up; returns the router's "host:port" once every worker has registered."""
        c = self.config
        c.check_model(self.model_dir)  # tensor_parallel_size against the model's heads, before Ray
        self.ray.init()
        self.router_host.start(Router(c.router_config(self.model_dir), scaler=self.scale), self.ray)
        for role in c.roles:
            for _ in range(getattr(c, role).replicas):
                self.fleet.spawn(role)
        self.fleet.wait_started(list(self.fleet.actors), c.ready_timeout_s)
        counts = {role: getattr(c, role).replicas for role in c.roles}
        self.router_host.run(self.scaler.registered(counts), c.ready_timeout_s + 5)
        self.ray.record()  # with the workers, while their raylet runs
        if c.planner.enabled:
            self.router_host.run(self.scaler.start_planner())
        return self.address

    async def scale(self, targets: dict[str, int]) -> dict[str, int]:
        """Reach these worker counts per role (runs on the router's loop): ``Scaler.scale``."""
        return await self.scaler.scale(targets)

    def actor_options(self, role: str, slot: int = 0) -> dict:
        """Where and how Ray runs the worker of this role in this replica slot: ``Placement.actor_options``."""
        return self.placement.actor_options(role, slot)

    def rank_status(self, worker_id: str) -> list[dict[str, int]]:
        """A worker's ranks (one without tensor parallelism), rank 0 first: ``WorkerActor.rank_status``."""
        return self.fleet.rank_status(worker_id)

    def worker_pid(self, worker_id: str) -> int:
        return self.fleet.worker_pid(worker_id)

    def stop(self) -> None:
        """Stop the router, the workers and the embedded Ray (idempotent), each step with a deadline:

        1. the router: new calls refused, calls in flight cancelled after ``ROUTER_GRACE_S``
           (clients see UNAVAILABLE);
        2. the workers: their own ``stop``, all at once, for ``WORKER_STOP_S`` (skipped when the
           embedded Ray is gone already), then ``ray.kill``;
        3. the embedded Ray: its processes get SIGKILL (waited for up to ``RAY_KILL_S``), the driver
           disconnects, its temp folder goes. Joined to a cluster, the driver disconnects and the
           cluster stays."""
        self.ray.record()  # before anything dies and orphans its children
        self.scaler.stop_planner()
        self.router_host.stop()
        self.fleet.stop_all(WORKER_STOP_S if self.ray.answers() else None)
        if self.ray.embedded is None:  # an embedded Ray goes as a whole; a Ray this deployment only uses stays
            self.placement.remove_all()
        self.placement.groups.clear()
        self.ray.shutdown(RAY_KILL_S)

    def abort(self) -> None:
        """Stop at once, waiting on nothing (for a second signal, or a stop past its deadline): SIGKILL
        the embedded Ray's processes (the workers among them) and remove its temp folder; joined to a
        cluster, ``ray.kill`` this deployment's actors (it does not wait for them)."""
        if self.ray.embedded is not None:
            self.ray.abort()
        elif self.ray.joined:
            self.fleet.kill_all(quiet=True)

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
