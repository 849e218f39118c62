"""``splitserve serve``: prefill and decode workers as Ray actors, and the router beside the driver.

Ray only places and runs the workers; requests never travel through Ray. With no Ray address an
embedded local Ray starts on loopback only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: every Ray port
binds and advertises 127.0.0.1), in a private temp folder, and stops with the deployment
(splitserve/embedded_ray.py). Every step of ``stop`` has a short deadline, so that it ends promptly
also when Ray's processes are going away at the same moment (a signal to the whole process group).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

from splitserve.deploy_config import DeploymentConfig
from splitserve.embedded_ray import TASK_EVENTS_FLUSH_ENV, EmbeddedRay, use_loopback_ray
from splitserve.router.server import Router
from splitserve.worker_common.config import RankSettings, WorkerConfig

__all__ = ["Deployment", "WorkerActor", "default_model_dir", "use_loopback_ray"]
log = logging.getLogger("splitserve.launch")

# Deadlines of the steps of Deployment.stop (seconds); together they stay well under 5 s.
ROUTER_GRACE_S = 0.5  # calls in flight may end by themselves; then they are cancelled (UNAVAILABLE)
WORKER_STOP_S = 0.5  # every worker's own stop(), all at once, while Ray still answers
RAY_KILL_S = 2.0  # the embedded Ray's processes, from SIGKILL until they are gone


def default_model_dir() -> Path:
    """The tiny demo checkpoint, written once into the user's cache folder."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "splitserve" / "models" / "tiny"
    if not (cache / "config.json").is_file():
        from splitserve.make_model import make_model

        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="tiny-", dir=cache.parent))
        make_model("tiny", staging / "model", dtype="float32", seed=0)
        if not (cache / "config.json").is_file():  # another process may have won the race
            shutil.rmtree(cache, ignore_errors=True)
            (staging / "model").rename(cache)
        shutil.rmtree(staging, ignore_errors=True)
    return cache


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


_WILDCARDS = ("0.0.0.0", "::", "[::]", "")


PENDING_AFTER_S = 10.0  # a starting worker not placed this long, its resources not free, is reported pending


def _placed(actor) -> bool:
    """Whether Ray has placed this actor on a node: its process started (a pid in the GCS actor table; on a
    cluster a pending actor has a raylet's address already, but no pid). False when it cannot tell (then
    the resources alone decide whether it is pending)."""
    if actor is None:
        return False
    try:
        from ray._private import state

        info = state.actors(actor._actor_id.hex())
    except Exception:  # a private table: if it moves, fall back to the resources
        return False
    return bool(info.get("Pid"))


def _unwildcard(address: str) -> str:
    """A wildcard bind ("0.0.0.0:P") as others dial it: this node's address as Ray knows it."""
    import ray

    host, port = address.rsplit(":", 1)
    return f"{ray.util.get_node_ip_address()}:{port}" if host in _WILDCARDS else address


class WorkerActor:
    """A prefill, decode or colocated worker inside a Ray actor process. It binds and advertises the node's
    address (or the configured one) and registers with the router itself. A tensor-parallel worker's actor
    is its rank 0: it starts the other ranks (``splitserve.rank_actors``) with ``rank_options``, their Ray
    options, one per rank from 1."""

    def __init__(self, config: WorkerConfig, rank_options: tuple[dict, ...] = ()) -> None:
        import ray

        from splitserve.observability.logs import configure_logging

        configure_logging(config.log_format, static={"worker_id": config.worker_id, "role": config.role})
        from splitserve.roles import worker_class

        cls = worker_class(config.role)
        context = ray.get_runtime_context()
        self.node = context.get_node_id()
        if context.was_current_actor_reconstructed:  # fault points that end the process fire once
            config = config.restarted()
        config = replace(config, node=self.node, host=config.host or ray.util.get_node_ip_address())
        self.followers = None
        if config.engine.tensor_parallel_size > 1:
            from splitserve.rank_actors import FollowerRanks

            self.followers = FollowerRanks(config, rank_options)
        self.worker = cls(config, self.followers.ranks if self.followers else None)
        if self.followers is not None:
            self.followers.connect()
        self.address = self.worker.start()

    def ready(self) -> dict:
        return {
            "address": self.address,
            "node": self.node,
            "worker_id": self.worker.config.worker_id,
            "pid": os.getpid(),
        }

    def rank_status(self) -> list[dict[str, int]]:
        """Every rank's pid and the KV transfer parts it holds (rank 0: its own endpoint's, and its KV
        blocks in use), rank 0 first: a tensor-parallel worker at rest holds none on any rank."""
        worker = self.worker
        rank0 = {
            "rank": 0,
            "pid": os.getpid(),
            "parts": worker.kv_transfers(),
            "blocks_in_use": worker.kv_figures()[1],
        }
        return [rank0, *(self.followers.status() if self.followers else [])]

    def stop(self) -> None:
        self.worker.stop()


# A placement group's bundle must hold some resource: a rank that reserves no CPU gets this sliver.
MIN_BUNDLE_CPU = 0.001


class Deployment:
    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.model_dir = str(config.model) if config.model else str(default_model_dir())
        self.router: Router | None = None
        self.address = ""  # the router's public port, as clients dial it
        self.internal_address = ""  # the router's internal port, as workers dial it to register
        self.openai_address = ""  # the OpenAI-compatible HTTP API ("host:port"), when openai_port is set
        self.actors: dict[str, object] = {}  # worker id -> Ray actor
        self.slots: dict[str, int] = {}  # worker id -> its replica slot: which of its role's cpu sets it pins to
        self.requests: dict[str, dict[str, float]] = {}  # worker id -> the resources it asks Ray for
        self._unplaced_since: dict[str, float] = {}  # worker id -> when it was first seen not placed
        self.placement_groups: dict[str, object] = {}  # worker id -> its ranks' placement group (TP > 1)
        self._counters = {"prefill": 0, "decode": 0, "colocated": 0}
        self._ray: EmbeddedRay | None = None  # the Ray this deployment started, if it started one
        self._joined_ray = False  # connected to a cluster (ray_address): disconnect on stop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.planner = None  # the live planner, when the config turns it on

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

    # ---- start ----------------------------------------------------------------------------------

    def start(self) -> str:
        """Bring everything up; returns the router's "host:port" once every worker has registered."""
        self.config.check_model(self.model_dir)  # tensor_parallel_size against the model's heads, before Ray
        self._init_ray()
        self.router = Router(self.config.router_config(self.model_dir), scaler=self.scale)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="router-loop", daemon=True)
        self._thread.start()
        self.address = self._advertised(self._run(self.router.start()))
        self.internal_address = self._advertised(self.router.internal_address)
        if self.router.metrics_address:
            self.router.metrics_address = _unwildcard(self.router.metrics_address)
        self.openai_address = self._advertised(self.router.openai_address) if self.router.openai_address else ""
        for role in self.config.roles:
            for _ in range(getattr(self.config, role).replicas):
                self._spawn(role)
        c = self.config
        self._wait_started(list(self.actors), c.ready_timeout_s)
        self._run(self._registered({role: getattr(c, role).replicas for role in c.roles}), c.ready_timeout_s + 5)
        if self._ray is not None:
            self._ray.record()  # with the workers, while their raylet runs
        if c.planner.enabled:
            self._run(self._start_planner())
        return self.address

    async def _start_planner(self) -> None:
        from splitserve.planning.live import counts_of, planner_for

        self.planner = planner_for(
            self.config.planner, self.config, self.router, self.scale, lambda: counts_of(self.actors)
        )
        self.planner.start()

    def _wait_started(self, worker_ids: list[str], timeout_s: float) -> None:
        """Wait until these workers' actors are constructed; a worker that failed to start (e.g. its
        ``cpus`` are not on its node) fails the start at once with its own error, naming it."""
        import ray

        refs = {self.actors[w].ready.remote(): w for w in worker_ids}
        pending, deadline = list(refs), time.monotonic() + timeout_s
        try:
            while pending:
                wait = min(1.0, max(0.0, deadline - time.monotonic()))
                done, pending = ray.wait(pending, num_returns=1, timeout=wait)
                if not done:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"{', '.join(refs[r] for r in pending)}: not started in {timeout_s}s")
                    self._report_pending([refs[r] for r in pending])
                    continue
                try:
                    ray.get(done[0])
                except ray.exceptions.RayError as e:
                    cause = next((line for line in reversed(str(e).splitlines()) if line.strip()), type(e).__name__)
                    raise RuntimeError(f"worker {refs[done[0]]} did not start: {cause}") from None
        finally:
            self._report_pending([])

    def _report_pending(self, worker_ids: list[str]) -> None:
        """Show the starting workers whose resources no node has free as pending (GetStatus, ``splitserve
        status``, the log): on a cluster with an autoscaler they wait for a node to be added."""
        import ray

        free = ray.available_resources()
        now = time.monotonic()
        pending = []
        for worker_id in worker_ids:
            if _placed(self.actors.get(worker_id)):
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
        if self.router is not None and pending != self.router.pending_workers:
            for line in sorted(set(pending) - set(self.router.pending_workers)):
                log.warning("worker %s is pending: no node has these resources free", line)
            self.router.pending_workers = pending

    @property
    def temp_dir(self) -> str | None:
        """The embedded Ray's temp folder (None when joined to a cluster, or stopped)."""
        return self._ray.temp_dir if self._ray is not None else None

    async def _registered(self, counts: dict[str, int]) -> None:
        """Wait until these many workers of each role are in the router's pool (colocated workers sit
        with the prefill workers there)."""
        await self.router.pool.wait_for(
            counts.get("prefill", 0) + counts.get("colocated", 0), counts.get("decode", 0), self.config.ready_timeout_s
        )

    def _advertised(self, address: str) -> str:
        """The router address workers dial: its bind address, or for a wildcard bind (0.0.0.0, ::)
        this node's address as Ray knows it. A loopback router on a cluster whose nodes are elsewhere
        could never be reached: that is refused here rather than left to time out."""
        import ray

        host = address.rsplit(":", 1)[0]
        if host in _WILDCARDS:
            return _unwildcard(address)
        if _is_loopback(host):
            remote = sorted(
                {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} - {"127.0.0.1", "localhost", "::1"}
            )
            if remote:
                raise RuntimeError(
                    f"host: the router binds {host}, which workers on nodes {', '.join(remote)} "
                    f"cannot reach; set host: 0.0.0.0 (or this node's address) in the config"
                )
        return address

    def _run(self, coroutine, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def _init_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return
        if self.config.ray_address:
            os.environ.setdefault(TASK_EVENTS_FLUSH_ENV, "500")
            self._joined_ray = True
            ray.init(address=self.config.ray_address, log_to_driver=False)
            return
        self._ray = EmbeddedRay()  # set first: stop() ends whatever a start cut short left running
        self._ray.start()

    def _spawn(self, role: str) -> str:
        """Start one worker actor; it registers with the router by itself. Returns its id."""
        import ray

        role_config = getattr(self.config, role)
        worker_id = f"{role}-{self._counters[role]}"
        self._counters[role] += 1
        taken = {slot for w, slot in self.slots.items() if w.rpartition("-")[0] == role}
        slot = next(i for i in range(len(taken) + 1) if i not in taken)  # the lowest free one
        env = {
            "OMP_WAIT_POLICY": "PASSIVE",
            "TOKENIZERS_PARALLELISM": "false",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1"),
        }
        threads = role_config.worker_threads(slot)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)  # Ray's default for actors is 1
        options, rank_options = self.actor_options(role, slot), ()
        if role_config.tensor_parallel_size > 1:
            options, rank_options = self._place_ranks(worker_id, role, slot, options, env)
        actor = (
            ray.remote(WorkerActor)
            .options(**options, runtime_env={"env_vars": env})
            .remote(self._worker_config(role, worker_id, slot), rank_options)
        )
        self.requests[worker_id] = {  # what it asks Ray for (all its ranks), to report it pending
            "CPU": options["num_cpus"] * role_config.tensor_parallel_size,
            "GPU": (options["num_gpus"] or 0) * role_config.tensor_parallel_size,
            **options["resources"],
        }
        self.actors[worker_id] = actor
        self.slots[worker_id] = slot
        return worker_id

    def _place_ranks(self, worker_id: str, role: str, slot: int, options: dict, env: dict) -> tuple[dict, tuple]:
        """A tensor-parallel worker: a placement group of one bundle per rank, all on one node (STRICT_PACK),
        each holding that rank's CPUs and GPUs (bundle 0 also the role's custom resources); the worker's actor
        (rank 0) goes in bundle 0, and the Ray options of ranks 1 .. t-1 it starts place them in the others."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        role_config = getattr(self.config, role)
        size = role_config.tensor_parallel_size
        per_rank = {"CPU": max(options["num_cpus"], MIN_BUNDLE_CPU)}
        if options["num_gpus"]:
            per_rank["GPU"] = options["num_gpus"]
        bundles = [{**per_rank, **options["resources"]}] + [dict(per_rank) for _ in range(1, size)]
        selector = options.pop("label_selector", None)
        group = placement_group(
            bundles,
            strategy="STRICT_PACK",
            name=f"splitserve-{worker_id}-{uuid.uuid4().hex[:8]}",
            bundle_label_selector=[dict(selector)] * size if selector else None,
        )
        self.placement_groups[worker_id] = group
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        rank_options = tuple(
            {
                "num_cpus": options["num_cpus"],
                "num_gpus": options["num_gpus"],
                "max_restarts": 0,  # a lost rank fails the worker; rank 0's restart starts new ranks
                "max_task_retries": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
                "runtime_env": {"env_vars": env},
            }
            for rank in range(1, size)
        )
        return options, rank_options

    def actor_options(self, role: str, slot: int = 0) -> dict:
        """Where and how Ray runs the worker of this role in this replica slot: CPUs (by default one per
        pinned cpu), GPUs, custom resources (by default 1 unit of ``splitserve_<role>`` where the cluster
        has it), node labels, restarts."""
        import ray

        role_config = getattr(self.config, role)
        resources = role_config.resources
        if resources is None:
            name = f"splitserve_{role}"
            resources = {name: 1} if ray.cluster_resources().get(name, 0) > 0 else {}
        options = dict(
            num_cpus=role_config.worker_num_cpus(slot),
            num_gpus=role_config.worker_num_gpus(self.config.device),
            resources=dict(resources),
            max_restarts=role_config.max_restarts,
            max_task_retries=0,
        )
        if role_config.label_selector:
            options["label_selector"] = dict(role_config.label_selector)
        return options

    def _worker_config(self, role: str, worker_id: str, slot: int = 0) -> WorkerConfig:
        c = self.config
        role_config = getattr(c, role)
        return WorkerConfig(
            role=role,
            worker_id=worker_id,
            engine=c.engine_config(self.model_dir, role, slot),
            host=c.worker_host if c.worker_host is not None else ("" if c.ray_address else "127.0.0.1"),
            port=0,
            router_address=self.internal_address,
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

    # ---- scale ----------------------------------------------------------------------------------

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
        pool = self.router.pool
        for role, target in targets.items():
            current = sorted((w for w in self.actors if w.startswith(role)), key=lambda w: int(w.rsplit("-", 1)[1]))
            added = [await loop.run_in_executor(None, self._spawn, role) for _ in range(target - len(current))]
            try:  # one that cannot start (e.g. its cpus) fails the scale at once, and the new ones go
                await loop.run_in_executor(None, self._wait_started, added, self.config.ready_timeout_s)
            except (RuntimeError, TimeoutError):
                for worker_id in added:
                    await loop.run_in_executor(None, self._stop_actor, worker_id)
                raise
            for worker_id in current[target:][::-1]:
                handle = next((w for w in pool.workers if w.status.worker_id == worker_id), None)
                if handle is not None:
                    await pool.drain(handle)
                    await self._drained(handle)
                await loop.run_in_executor(None, self._stop_actor, worker_id)
        counts = {role: sum(w.startswith(role) for w in self.actors) for role in self.config.roles}
        await self._registered(counts)
        return counts

    async def _drained(self, handle, timeout_s: float = 120.0) -> None:
        """Wait until a draining worker holds no request (its status says so)."""
        from splitserve.router.workers import settle
        from splitserve.rpc import workers_pb2 as wpb

        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            try:
                status = await settle(handle.stub.Status(wpb.StatusRequest(), timeout=5))
            except Exception:
                return  # gone already
            if status.running == 0 and status.waiting == 0 and status.kv_blocks_in_use == 0:
                return
            await asyncio.sleep(0.1)
        log.warning("worker %s did not drain in %.0fs; stopping it anyway", handle.worker_id, timeout_s)

    def _stop_actor(self, worker_id: str) -> None:
        import ray

        actor = self.actors.pop(worker_id, None)
        self.slots.pop(worker_id, None)
        self.requests.pop(worker_id, None)
        if actor is None:
            return
        try:
            ray.get(actor.stop.remote(), timeout=10)
        except Exception:
            pass
        ray.kill(actor, no_restart=True)
        self._remove_placement_group(worker_id)

    def _remove_placement_group(self, worker_id: str) -> None:
        from ray.util.placement_group import remove_placement_group

        group = self.placement_groups.pop(worker_id, None)
        if group is not None:
            try:
                remove_placement_group(group)
            except Exception as e:  # the cluster is going away
                log.warning("placement group of %s: %s", worker_id, e)

    def rank_status(self, worker_id: str) -> list[dict[str, int]]:
        """A worker's ranks (one without tensor parallelism), rank 0 first: ``WorkerActor.rank_status``."""
        import ray

        return ray.get(self.actors[worker_id].rank_status.remote(), timeout=30)

    def worker_pid(self, worker_id: str) -> int:
        import ray

        return ray.get(self.actors[worker_id].ready.remote(), timeout=30)["pid"]

    # ---- stop -----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the router, the workers and the embedded Ray (idempotent), each step with a deadline:

        1. the router: new calls refused, calls in flight cancelled after ``ROUTER_GRACE_S``
           (clients see UNAVAILABLE);
        2. the workers: their own ``stop``, all at once, for ``WORKER_STOP_S`` (skipped when the
           embedded Ray is gone already), then ``ray.kill``;
        3. the embedded Ray: its processes get SIGKILL (waited for up to ``RAY_KILL_S``), the driver
           disconnects, its temp folder goes. Joined to a cluster, the driver disconnects and the
           cluster stays."""
        import ray

        if self._ray is not None:
            self._ray.record()  # before anything dies and orphans its children
        self._stop_router()
        actors = list(self.actors.values())
        if actors and (self._ray is None or self._ray.running()):
            try:
                refs = [actor.stop.remote() for actor in actors]
                ray.wait(refs, num_returns=len(refs), timeout=WORKER_STOP_S)
            except Exception as e:
                log.warning("worker stop: %s", e)
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:
                log.warning("worker kill: %s", e)
        self.actors.clear()
        self.slots.clear()
        if self._ray is None:  # an embedded Ray goes as a whole; a Ray this deployment only uses stays
            for worker_id in list(self.placement_groups):
                self._remove_placement_group(worker_id)
        self.placement_groups.clear()
        if self._ray is not None:
            self._ray.stop(RAY_KILL_S)
            self._ray = None
        elif self._joined_ray:
            ray.shutdown()
            self._joined_ray = False

    def _stop_router(self) -> None:
        if self.planner is not None and self._loop is not None:
            try:
                self._run(self.planner.stop(), 5)
            except Exception as e:
                log.warning("planner stop: %s", e)
            self.planner = None
        if self.router is not None and self._loop is not None:
            try:
                self._run(self.router.stop(ROUTER_GRACE_S), ROUTER_GRACE_S + 5)
            except Exception as e:
                log.warning("router stop: %s", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self.router = None

    def abort(self) -> None:
        """Stop at once, waiting on nothing (for a second signal, or a stop past its deadline): SIGKILL
        the embedded Ray's processes (the workers among them) and remove its temp folder; joined to a
        cluster, ``ray.kill`` this deployment's actors (it does not wait for them)."""
        import ray

        if self._ray is not None:
            self._ray.abort()
        elif self._joined_ray:
            for actor in list(self.actors.values()):
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:
                    pass

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
