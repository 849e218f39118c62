"""The embedded Ray of ``splitserve serve`` without ``--ray-address``: one local node on loopback only,
in a private temp folder, whose processes are recorded by pid.

Stopping it never depends on Ray answering. A signal sent to the whole process group (systemd's
default ``KillMode=control-group``, ``kill -- -PGID``) reaches the GCS, the raylet and the workers at
the same moment as ``serve``; Ray's own shutdown then waits out timeouts against processes that are
going away. So ``stop`` ends the recorded processes itself, by pid, with SIGKILL (what they hold lives in
memory and in the temp folder, which goes next), after the driver disconnected while Ray still answered
(``stop`` says why); ``abort`` does not wait even for that.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile

from splitserve.deploy import processes, ray_adapter

log = logging.getLogger("splitserve.deploy.deployment")

# At disconnect Ray's core worker flushes its task events to the GCS: for 5 s when the GCS is gone.
TASK_EVENTS_FLUSH_ENV = "RAY_task_events_shutdown_flush_timeout_ms"


def use_loopback_ray() -> None:
    """Make an embedded Ray bind and advertise 127.0.0.1 only (call before ``import ray``)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


# Ray starts idle worker processes ahead of tasks (one per CPU); splitserve runs actors only, each in a process
# of its own environment (runtime_env), which those never serve. Measured 2026-12-05 while a colocated worker
# served: two idle workers at about 0.01 core each, on the cores the model's threads use.
NO_PRESTARTED_WORKERS = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


class EmbeddedRay:
    def __init__(self) -> None:
        self.temp_dir: str | None = None  # Ray's _temp_dir; removed by stop and abort
        self.processes: set[processes.Process] = set()  # the node's processes, and everything below them

    def start(self) -> None:
        import ray

        # Loopback only, private temp folder, no auth token file. Ray reads the loopback switch when it
        # is imported (ray_constants); ``use_loopback_ray`` sets it before that where it can, and the
        # constant is forced here for a Ray imported earlier. Children inherit the environment.
        use_loopback_ray()
        os.environ.setdefault(TASK_EVENTS_FLUSH_ENV, "500")
        ray_adapter.disable_cluster_mode()
        self.temp_dir = tempfile.mkdtemp(prefix="ss")
        ray.init(
            address="local",
            _temp_dir=self.temp_dir,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
            num_cpus=os.cpu_count(),
            _system_config=NO_PRESTARTED_WORKERS,
        )
        self.record()
        log.info("embedded Ray in %s (removed when serve stops)", self.temp_dir)

    def record(self) -> set[processes.Process]:
        """Add the processes running now to the record: those ray.init started here (GCS, raylet,
        monitors) and everything below them (workers, agents). Call it while they run: a raylet that
        dies orphans its workers, which then sit below nothing of ours."""
        roots = {p for h in self._handles() if (p := processes.process(h.pid)) is not None}
        self.processes |= roots | set(processes.descendants(roots | self.processes))
        return self.processes

    def running(self) -> bool:
        """Whether Ray can still answer calls: its GCS and raylet run."""
        vital = self._handles("gcs_server", "raylet")
        return bool(vital) and all(h.poll() is None for h in vital)

    def stop(self, timeout_s: float) -> None:
        """Disconnect the driver, SIGKILL every recorded process (and wait up to ``timeout_s`` for them to
        go), remove the temp folder.

        While Ray still runs, the driver disconnects first (``ray.shutdown``, which then ends the node's
        own processes: SIGTERM, SIGKILL after 1 s): a driver's core worker that finds its raylet or GCS
        gone while connected ends the whole process at once, without a word, so killing them first could
        end ``serve``, or a script that starts one deployment after another, before its stop returned.
        Once Ray is going away (a signal to the whole group), everything is killed first as before."""
        import ray

        recorded = self.record()
        if self.running():
            ray.shutdown()
        left = processes.kill(recorded, timeout_s)
        if left:
            log.warning(
                "Ray processes still running %.0fs after SIGKILL: %s", timeout_s, ", ".join(str(p.pid) for p in left)
            )
        ray.shutdown()  # a no-op after the first; otherwise it finds its processes gone and closes the driver's side
        self.processes = set()
        self.remove_temp_dir()

    def abort(self) -> None:
        """SIGKILL every recorded process and remove the temp folder, waiting on nothing."""
        processes.send(self.record(), signal.SIGKILL)
        self.remove_temp_dir()

    def remove_temp_dir(self) -> None:
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None

    def _handles(self, *kinds: str) -> list:
        """Ray's handles (Popen) of the processes ray.init started here, of these kinds (default: all)."""
        return [
            p for kind, handles in ray_adapter.node_processes().items() if not kinds or kind in kinds for p in handles
        ]
