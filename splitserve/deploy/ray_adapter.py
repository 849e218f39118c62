"""The one module that touches Ray's private API (``ray._private``): what the deployment needs of Ray
that its public API does not give. If a Ray release moves any of these, this file is the one to change;
each function says what it falls back to when the private object is not there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def disable_cluster_mode() -> None:
    """Force Ray's loopback switch for a Ray module imported before ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
    was set (Ray reads it into ``ray_constants`` at import)."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def node_processes() -> Mapping[str, list[Any]]:
    """The processes ``ray.init`` started in this process (GCS, raylet, agents, ...), by kind, as Ray's
    ``Popen`` handles; empty when this process joined a Ray started elsewhere."""
    import ray._private.worker

    node = getattr(ray._private.worker, "_global_node", None)
    table = getattr(node, "all_processes", None) or {}
    return {kind: [info.process for info in infos if info.process is not None] for kind, infos in table.items()}


def actor_pid(actor) -> int | None:
    """The pid of an actor's process from the GCS actor table: set once Ray placed it and its process
    started (a pending actor on a cluster has a raylet's address already, but no pid). None when it has
    none yet or the table cannot be read."""
    try:
        from ray._private import state

        info = state.actors(actor._actor_id.hex())
    except Exception:  # a private table: if it moves, callers fall back to what they can see
        return None
    return info.get("Pid") or None


def actor_table() -> list[dict]:
    """Every actor the GCS knows: class name, state and pid."""
    from ray._private import state

    return [{"class": a["ActorClassName"], "state": a["State"], "pid": a["Pid"]} for a in state.actors().values()]


def logs_dir() -> str:
    """This Ray node's log folder (the workers' stdout/stderr files are there)."""
    import ray._private.worker

    return ray._private.worker.global_worker.node.get_logs_dir_path()


def validate_node_labels(labels: Mapping[str, str]) -> None:
    """Ray's own check of a node type's labels (raises ValueError on a bad key or value)."""
    from ray._private.label_utils import validate_node_label_syntax

    validate_node_label_syntax(dict(labels))
