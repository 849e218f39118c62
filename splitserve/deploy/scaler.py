"""Scaling a running deployment: the router's ``Scale`` call and the live planner both reach worker
counts per role through ``Scaler.scale``; the live planner itself runs here too."""

from __future__ import annotations

import asyncio
import logging

from splitserve.deploy.config import DeploymentConfig
from splitserve.deploy.fleet import WorkerFleet
from splitserve.deploy.router_host import RouterHost

log = logging.getLogger("splitserve.deploy.deployment")

DRAIN_TIMEOUT_S = 120.0  # a draining worker still holding requests after this long is stopped anyway
DRAIN_POLL_S = 0.1  # how often a draining worker's status is read
STATUS_CALL_S = 5.0  # one status call to a draining worker
PLANNER_STOP_S = 5.0


class Scaler:
    def __init__(self, config: DeploymentConfig, fleet: WorkerFleet, host: RouterHost) -> None:
        self.config, self.fleet, self.host = config, fleet, host
        self.planner = None  # the live planner, when the config turns it on

    async def scale(self, targets: dict[str, int]) -> dict[str, int]:
        """Reach these worker counts per role (runs on the router's loop). New workers register by
        themselves; removed ones (the newest first) drain, then stop."""
        other = sorted(set(targets) - set(self.config.roles))
        if other:
            raise ValueError(f"{', '.join(other)}: not a role of this deployment (mode {self.config.mode})")
        for role, target in targets.items():
            most = getattr(self.config, role).max_pinned_replicas
            if most is not None and target > most:
                raise ValueError(f"{role}.cpus: {most} cpu sets bind at most {most} {role} workers, not {target}")
        loop = asyncio.get_running_loop()
        fleet, pool = self.fleet, self.host.router.pool
        for role, target in targets.items():
            current = fleet.of_role(role)
            added = [await loop.run_in_executor(None, fleet.spawn, role) for _ in range(target - len(current))]
            try:  # one that cannot start (e.g. its cpus) fails the scale at once, and the new ones go
                await loop.run_in_executor(None, fleet.wait_started, added, self.config.ready_timeout_s)
            except (RuntimeError, TimeoutError):
                for worker_id in added:
                    await loop.run_in_executor(None, fleet.stop_actor, worker_id)
                raise
            for worker_id in current[target:][::-1]:
                handle = next((w for w in pool.workers if w.status.worker_id == worker_id), None)
                if handle is not None:
                    await pool.drain(handle)
                    await self._drained(handle)
                await loop.run_in_executor(None, fleet.stop_actor, worker_id)
        counts = fleet.counts()
        await self.registered(counts)
        return counts

    async def registered(self, counts: dict[str, int]) -> None:
        """Wait until these many workers of each role are in the router's pool (colocated workers sit
        with the prefill workers there)."""
        await self.host.router.pool.wait_for(
            counts.get("prefill", 0) + counts.get("colocated", 0), counts.get("decode", 0), self.config.ready_timeout_s
        )

    async def _drained(self, handle, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Wait until a draining worker holds no request (its status says so)."""
        from splitserve.router.workers import settle
        from splitserve.rpc import workers_pb2 as wpb

        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            try:
                status = await settle(handle.stub.Status(wpb.StatusRequest(), timeout=STATUS_CALL_S))
            except Exception:
                return  # gone already
            if status.running == 0 and status.waiting == 0 and status.kv_blocks_in_use == 0:
                return
            await asyncio.sleep(DRAIN_POLL_S)
        log.warning("worker %s did not drain in %.0fs; stopping it anyway", handle.worker_id, timeout_s)

    async def start_planner(self) -> None:
        from splitserve.deploy.live_planner import counts_of, planner_for

        self.planner = planner_for(
            self.config.planner, self.config, self.host.router, self.scale, lambda: counts_of(self.fleet.actors)
        )
        self.planner.start()

    def stop_planner(self) -> None:
        if self.planner is not None and self.host.loop is not None:
            try:
                self.host.run(self.planner.stop(), PLANNER_STOP_S)
            except Exception as e:
                log.warning("planner stop: %s", e)
            self.planner = None
