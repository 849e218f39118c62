"""Listening TCP sockets, read from /proc (no tools needed): of the whole machine, or only of given
processes (a socket is a process's when one of its file descriptors points at the socket's inode), so a
check on a deployment's own processes is neither failed nor masked by another program's listeners."""

from __future__ import annotations

import os
from pathlib import Path

LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def _listening_rows(proc_net: Path) -> list[tuple[str, int, int]]:
    """(address as /proc writes it, port, socket inode) of every listening TCP socket in this table."""
    rows = []
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc_net / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A":  # LISTEN
                address, port = parts[1].rsplit(":", 1)
                rows.append((address, int(port, 16), int(parts[9])))
    return rows


def listening_sockets() -> set[tuple[str, int]]:
    """Every listening socket on this machine (its network namespace)."""
    return {(address, port) for address, port, _ in _listening_rows(Path("/proc/net"))}


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process ``pid`` holds open."""
    found = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            found.add(int(target[len("socket:[") : -1]))
    return found


def listening_sockets_of(pid: int) -> set[tuple[str, int]]:
    """The listening sockets process ``pid`` holds (raises if there is no such process)."""
    inodes = socket_inodes(pid)
    return {(address, port) for address, port, inode in _listening_rows(Path(f"/proc/{pid}/net")) if inode in inodes}


def ray_node_pids() -> dict[str, int]:
    """The processes of the Ray node this process started (GCS, raylet, agents), by kind; {} when it
    joined one started elsewhere."""
    from splitserve.deploy import ray_adapter

    found = {}
    for kind, handles in ray_adapter.node_processes().items():
        for i, process in enumerate(handles):
            if process.poll() is None:
                found[f"ray {kind}" + (f" {i}" if i else "")] = process.pid
    return found


def deployment_pids(deployment) -> dict[str, int]:
    """A deployment's processes by name: the router's (this process) and each worker actor's."""
    return {"router": os.getpid(), **{worker_id: deployment.worker_pid(worker_id) for worker_id in deployment.actors}}


def assert_listens_on_loopback_only(deployment, include_ray: bool = True) -> dict[str, set[tuple[str, int]]]:
    """The deployment's processes (and the Ray node's) listen on loopback only, and every address the
    deployment reports is among their listeners, so the check cannot pass by looking elsewhere.
    Returns the listeners by process."""
    pids = {**deployment_pids(deployment), **(ray_node_pids() if include_ray else {})}
    listeners = {name: listening_sockets_of(pid) for name, pid in pids.items()}
    ports = {port for found in listeners.values() for _, port in found}
    reported = [deployment.address, deployment.internal_address, *(w["address"] for w in deployment.workers)]
    missing = [a for a in reported if int(a.rsplit(":", 1)[1]) not in ports]
    assert not missing, f"the deployment's processes do not listen on {missing} (listeners: {listeners})"
    for worker_id in deployment.actors:
        assert listeners[worker_id], f"worker {worker_id} (pid {pids[worker_id]}) listens on nothing"
    outside = sorted((name, a, p) for name, found in listeners.items() for a, p in found if a not in LOOPBACK)
    assert not outside, f"listening beyond loopback: {outside}"
    return listeners
