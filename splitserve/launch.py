"""``splitserve serve``: prefill and decode workers as Ray actors, and the router beside the driver.

Ray only places and runs the workers; requests never travel through Ray. With no Ray address an
embedded local Ray starts on loopback only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: every Ray port
binds and advertises 127.0.0.1), in a private temp folder, and stops with the deployment.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import replace
from pathlib import Path

from engine.core import EngineConfig
from router.server import Router
from router.workers import WorkerAddress
from splitserve.deploy_config import DeploymentConfig
from worker_common.config import WorkerConfig

log = logging.getLogger("splitserve.launch")


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


def use_loopback_ray() -> None:
    """Make an embedded Ray bind and advertise 127.0.0.1 only (call before ``import ray``)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


class WorkerActor:
    """A prefill or decode worker inside a Ray actor process."""

    def __init__(self, config: WorkerConfig) -> None:
        import ray

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        if config.role == "prefill":
            from prefill_worker.worker import PrefillWorker as cls
        else:
            from decode_worker.worker import DecodeWorker as cls
        self.node = ray.get_runtime_context().get_node_id()
        self.worker = cls(replace(config, node=self.node))
        self.address = self.worker.start()

    def ready(self) -> dict:
        return {"address": self.address, "node": self.node, "worker_id": self.worker.config.worker_id}

    def stop(self) -> None:
        self.worker.stop()


class Deployment:
    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.model_dir = str(config.model) if config.model else str(default_model_dir())
        self.router: Router | None = None
        self.address = ""
        self.workers: list[dict] = []
        self._actors: list = []
        self._started_ray = False
        self._temp_dir: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- start ----------------------------------------------------------------------------------

    def start(self, timeout_s: float = 300.0) -> str:
        """Bring everything up; returns the router's "host:port" once it accepts requests."""
        import ray

        self._init_ray()
        remote = ray.remote(WorkerActor)
        env = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false",
               "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")}  # fmt: skip
        for role in ("prefill", "decode"):
            threads = getattr(self.config, role).threads
            role_env = {**env, "OMP_NUM_THREADS": str(threads)} if threads else env  # Ray's default is 1
            for i in range(getattr(self.config, role).replicas):
                actor = remote.options(num_cpus=0, max_restarts=0, runtime_env={"env_vars": role_env},
                                       name=None).remote(self._worker_config(role, i))  # fmt: skip
                self._actors.append(actor)
        self.workers = ray.get([a.ready.remote() for a in self._actors], timeout=timeout_s)
        roles = ["prefill"] * self.config.prefill.replicas + ["decode"] * self.config.decode.replicas
        addresses = [WorkerAddress(role, w["address"], w["node"]) for role, w in zip(roles, self.workers)]
        self.router = Router(self.config.router_config(self.model_dir), addresses)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="router-loop", daemon=True)
        self._thread.start()
        self.address = asyncio.run_coroutine_threadsafe(self.router.start(), self._loop).result(timeout_s)
        return self.address

    def _init_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return
        if self.config.ray_address:
            ray.init(address=self.config.ray_address, log_to_driver=False)
            return
        # Loopback only, private temp folder, no auth token file. Ray reads the loopback switch when it
        # is imported (ray_constants); ``use_loopback_ray`` sets it before that where it can, and the
        # constant is forced here for a Ray imported earlier. Children inherit the environment.
        use_loopback_ray()
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
        self._temp_dir = tempfile.mkdtemp(prefix="ss")
        ray.init(address="local", _temp_dir=self._temp_dir, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", num_cpus=os.cpu_count())  # fmt: skip
        self._started_ray = True

    def _worker_config(self, role: str, index: int) -> WorkerConfig:
        c, e = self.config, self.config.engine
        role_config = getattr(c, role)
        engine = EngineConfig(
            model_dir=self.model_dir, dtype=c.dtype, device=c.device, block_size=e.block_size,
            num_blocks=role_config.num_blocks or e.num_blocks, kv_cache_bytes=e.kv_cache_bytes, max_num_seqs=e.max_num_seqs,
            max_num_batched_tokens=e.max_num_batched_tokens, prefill_chunk_size=e.prefill_chunk_size,
            num_threads=role_config.threads,
            enable_prefix_caching=role == "prefill",  # decode requests arrive with their KV: nothing to reuse
        )  # fmt: skip
        transfer = replace(c.transfer, faults=c.faults.transfer)
        return WorkerConfig(role=role, worker_id=f"{role}-{index}", engine=engine, host=c.host, port=0,
                            model_name=c.model_name, transfer=transfer, max_inflight=role_config.max_inflight,
                            faults=c.worker_faults())  # fmt: skip

    # ---- stop -----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the router, the workers and the embedded Ray (idempotent)."""
        import ray

        if self.router is not None and self._loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self.router.stop(), self._loop).result(10)
            except Exception as e:
                log.warning("router stop: %s", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self.router = None
        for actor in self._actors:
            try:
                ray.get(actor.stop.remote(), timeout=10)
            except Exception:
                pass
            ray.kill(actor)
        self._actors = []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
        if self._temp_dir:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
