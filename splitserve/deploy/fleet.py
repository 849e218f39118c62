"""The worker actors of a deployment: starting one (its config, its Ray options, its ranks' placement),
waiting until they run (reporting those no node has room for as pending), and stopping them."""

from __future__ import annotations

import logging
import os
import time

from splitserve.deploy import ray_adapter
from splitserve.deploy.actors import WorkerActor
from splitserve.deploy.config import DeploymentConfig
from splitserve.deploy.placement import Placement
from splitserve.deploy.router_host import RouterHost
from splitserve.worker_common.config import RankSettings, WorkerConfig

log = logging.getLogger("splitserve.deploy.deployment")

PENDING_AFTER_S = 10.0  # a starting worker not placed this long, its resources not free, is reported pending
START_POLL_S = 1.0  # while waiting for workers to start, how often the pending report is refreshed
ACTOR_STOP_S = 10.0  # one worker's own stop() when it is removed (scaling down, a failed start)
ACTOR_CALL_S = 30.0  # a status call to a worker's actor (ready, rank status)


class WorkerFleet:
    def __init__(self, config: DeploymentConfig, model_dir: str, placement: Placement, host: RouterHost) -> None:
        self.config, self.model_dir, self.placement, self.host = config, model_dir, placement, host
        self.actors: dict[str, object] = {}  # worker id -> Ray actor
        self.slots: dict[str, int] = {}  # worker id -> its replica slot: which of its role's cpu sets it pins to
        self.requests: dict[str, dict[str, float]] = {}  # worker id -> the resources it asks Ray for
        self._unplaced_since: dict[str, float] = {}  # worker id -> when it was first seen not placed
        self._counters = {"prefill": 0, "decode": 0, "colocated": 0}

    def of_role(self, role: str) -> list[str]:
        """This role's worker ids, oldest first."""
        return sorted((w for w in self.actors if w.startswith(role)), key=lambda w: int(w.rsplit("-", 1)[1]))

    def counts(self) -> dict[str, int]:
        return {role: sum(w.startswith(role) for w in self.actors) for role in self.config.roles}

    def spawn(self, role: str) -> str:
        """Start one worker actor; it registers with the router by itself. Returns its id."""
        import ray

        role_config = getattr(self.config, role)
        worker_id = f"{role}-{self._counters[role]}"
        self._counters[role] += 1
        taken = {slot for w, slot in self.slots.items() if w.rpartition("-")[0] == role}
        slot = next(i for i in range(len(taken) + 1) if i not in taken)  # the lowest free one
        env = {
            "TOKENIZERS_PARALLELISM": "false",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1"),
            **role_config.worker_env(slot, self.config.owns_cores(role, slot)),
        }
        options, rank_options = self.placement.actor_options(role, slot), ()
        if role_config.tensor_parallel_size > 1:
            options, rank_options = self.placement.place_ranks(worker_id, role, slot, options, env)
        actor = (
            ray.remote(WorkerActor)
            .options(**options, runtime_env={"env_vars": env})
            .remote(self.worker_config(role, worker_id, slot), rank_options)
        )
        self.requests[worker_id] = {  # what it asks Ray for (all its ranks), to report it pending
            "CPU": options["num_cpus"] * role_config.tensor_parallel_size,
            "GPU": (options["num_gpus"] or 0) * role_config.tensor_parallel_size,
            **options["resources"],
        }
        self.actors[worker_id] = actor
        self.slots[worker_id] = slot
        return worker_id

    def worker_config(self, role: str, worker_id: str, slot: int = 0) -> WorkerConfig:
        c = self.config
        role_config = getattr(c, role)
        return WorkerConfig(
            role=role,
            worker_id=worker_id,
            engine=c.engine_config(self.model_dir, role, slot),
            host=c.worker_host if c.worker_host is not None else ("" if c.ray_address else "127.0.0.1"),
            port=0,
            router_address=self.host.internal_address,
            model_name=c.model_name,
            transfer=c.transfer,
            max_inflight=role_config.max_inflight,
            faults=c.faults.for_worker(worker_id),
            security=c.security.internal(),
            log_format=c.log_format,
            metrics_port=None if c.metrics_port is None else 0,
            cpus=role_config.cpu_set(slot),
            follower_ranks=tuple(
                RankSettings(faults=c.faults.for_worker(worker_id, rank), cpus=role_config.cpu_set(slot, rank))
                for rank in range(1, role_config.tensor_parallel_size)
            ),
        )

    def wait_started(self, worker_ids: list[str], timeout_s: float) -> None:
        """Wait until these workers' actors are constructed; a worker that failed to start (e.g. its
        ``cpus`` are not on its node) fails the start at once with its own error, naming it."""
        import ray

        refs = {self.actors[w].ready.remote(): w for w in worker_ids}
        pending, deadline = list(refs), time.monotonic() + timeout_s
        try:
            while pending:
                wait = min(START_POLL_S, max(0.0, deadline - time.monotonic()))
                done, pending = ray.wait(pending, num_returns=1, timeout=wait)
                if not done:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"{', '.join(refs[r] for r in pending)}: not started in {timeout_s}s")
                    self.report_pending([refs[r] for r in pending])
                    continue
                try:
                    ray.get(done[0])
                except ray.exceptions.RayError as e:
                    cause = next((line for line in reversed(str(e).splitlines()) if line.strip()), type(e).__name__)
                    raise RuntimeError(f"worker {refs[done[0]]} did not start: {cause}") from None
        finally:
            self.report_pending([])

    def report_pending(self, worker_ids: list[str]) -> None:
        """Show the starting workers whose resources no node has free as pending (GetStatus, ``splitserve
        status``, the log): on a cluster with an autoscaler they wait for a node to be added."""
        import ray

        free = ray.available_resources()
        now = time.monotonic()
        pending = []
        for worker_id in worker_ids:
            actor = self.actors.get(worker_id)
            if actor is not None and ray_adapter.actor_pid(actor):  # placed: its process started
                self._unplaced_since.pop(worker_id, None)
                continue  # on its node, loading: its resources are its own, no longer free
            needs = {k: v for k, v in self.requests.get(worker_id, {}).items() if v}
            short = {k: v for k, v in needs.items() if free.get(k, 0.0) < v}
            # A worker granted its resources is not placed until its process starts (seconds on a busy
            # node), and meanwhile its own resources read as taken: only one still waiting after
            # PENDING_AFTER_S is pending.
            since = self._unplaced_since.setdefault(worker_id, now)
            if short and now - since >= PENDING_AFTER_S:
                pending.append(f"{worker_id}: " + ", ".join(f"{k} {v:g}" for k, v in sorted(short.items())))
        if not worker_ids:
            self._unplaced_since.clear()
        router = self.host.router
        if router is not None and pending != router.pending_workers:
            for line in sorted(set(pending) - set(router.pending_workers)):
                log.warning("worker %s is pending: no node has these resources free", line)
            router.pending_workers = pending

    def stop_actor(self, worker_id: str) -> None:
        """Stop one worker (its own stop, then ``ray.kill``) and free its placement group."""
        import ray

        actor = self.actors.pop(worker_id, None)
        self.slots.pop(worker_id, None)
        self.requests.pop(worker_id, None)
        if actor is None:
            return
        try:
            ray.get(actor.stop.remote(), timeout=ACTOR_STOP_S)
        except Exception:
            pass
        ray.kill(actor, no_restart=True)
        self.placement.remove(worker_id)

    def stop_all(self, politely_s: float | None) -> None:
        """Every worker's own ``stop``, all at once, for ``politely_s`` (None: skipped, Ray cannot answer),
        then ``ray.kill``."""
        import ray

        actors = list(self.actors.values())
        if actors and politely_s is not None:
            try:
                refs = [actor.stop.remote() for actor in actors]
                ray.wait(refs, num_returns=len(refs), timeout=politely_s)
            except Exception as e:
                log.warning("worker stop: %s", e)
        self.kill_all()

    def kill_all(self, quiet: bool = False) -> None:
        import ray

        for actor in list(self.actors.values()):
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:
                if not quiet:
                    log.warning("worker kill: %s", e)
        self.actors.clear()
        self.slots.clear()

    def rank_status(self, worker_id: str) -> list[dict[str, int]]:
        """A worker's ranks (one without tensor parallelism), rank 0 first: ``WorkerActor.rank_status``."""
        import ray

        return ray.get(self.actors[worker_id].rank_status.remote(), timeout=ACTOR_CALL_S)

    def worker_pid(self, worker_id: str) -> int:
        import ray

        return ray.get(self.actors[worker_id].ready.remote(), timeout=ACTOR_CALL_S)["pid"]
