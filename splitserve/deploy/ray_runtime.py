"""Starting or joining Ray for a deployment, and the addresses others dial on it.

Without ``ray_address`` an embedded local Ray starts on loopback only (``embedded_ray``); with one, the
driver joins that cluster and leaves it running at stop.
"""

from __future__ import annotations

import ipaddress
import os

from splitserve.deploy.embedded_ray import TASK_EVENTS_FLUSH_ENV, EmbeddedRay

# Binds that listen on every interface: others dial this node's address instead.
WILDCARDS = ("0.0.0.0", "::", "[::]", "")
# Ray's task events flush at disconnect, in ms (its default waits 5 s for a GCS that may be gone).
TASK_EVENTS_FLUSH_MS = "500"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def unwildcard(address: str) -> str:
    """A wildcard bind ("0.0.0.0:P") as others dial it: this node's address as Ray knows it."""
    import ray

    host, port = address.rsplit(":", 1)
    return f"{ray.util.get_node_ip_address()}:{port}" if host in WILDCARDS else address


class RayRuntime:
    """The Ray a deployment runs on: one it started (``embedded``) or a cluster it joined."""

    def __init__(self, ray_address: str | None) -> None:
        self.ray_address = ray_address
        self.embedded: EmbeddedRay | None = None  # the Ray this deployment started, if it started one
        self.joined = False  # connected to a cluster (ray_address): disconnect on stop

    def init(self) -> None:
        import ray

        if ray.is_initialized():
            return
        if self.ray_address:
            os.environ.setdefault(TASK_EVENTS_FLUSH_ENV, TASK_EVENTS_FLUSH_MS)
            self.joined = True
            ray.init(address=self.ray_address, log_to_driver=False)
            return
        self.embedded = EmbeddedRay()  # set first: stop() ends whatever a start cut short left running
        self.embedded.start()

    @property
    def temp_dir(self) -> str | None:
        """The embedded Ray's temp folder (None when joined to a cluster, or stopped)."""
        return self.embedded.temp_dir if self.embedded is not None else None

    def record(self) -> None:
        """Record the embedded Ray's processes now (while they run; a no-op on a joined cluster)."""
        if self.embedded is not None:
            self.embedded.record()

    def answers(self) -> bool:
        """Whether Ray can still take calls (a joined cluster is assumed to)."""
        return self.embedded is None or self.embedded.running()

    def advertised(self, address: str) -> str:
        """The address others dial for a bind address: itself, or for a wildcard bind (0.0.0.0, ::) this
        node's address as Ray knows it. A loopback bind on a cluster whose nodes are elsewhere could never
        be reached: that is refused here rather than left to time out."""
        import ray

        host = address.rsplit(":", 1)[0]
        if host in WILDCARDS:
            return unwildcard(address)
        if is_loopback(host):
            remote = sorted(
                {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} - {"127.0.0.1", "localhost", "::1"}
            )
            if remote:
                raise RuntimeError(
                    f"host: the router binds {host}, which workers on nodes {', '.join(remote)} "
                    f"cannot reach; set host: 0.0.0.0 (or this node's address) in the config"
                )
        return address

    def shutdown(self, kill_s: float) -> None:
        """The embedded Ray's processes get SIGKILL (waited for up to ``kill_s``), the driver disconnects,
        its temp folder goes; joined to a cluster, the driver disconnects and the cluster stays."""
        import ray

        if self.embedded is not None:
            self.embedded.stop(kill_s)
            self.embedded = None
        elif self.joined:
            ray.shutdown()
            self.joined = False

    def abort(self) -> None:
        """SIGKILL the embedded Ray's processes and remove its temp folder, waiting on nothing."""
        if self.embedded is not None:
            self.embedded.abort()
