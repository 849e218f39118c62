"""Crashing a worker on purpose: the serving tests' fault, not something the product does."""

from __future__ import annotations

import os
import signal

from splitserve.deploy.deployment import Deployment


def kill_worker(deployment: Deployment, worker_id: str) -> None:
    """SIGKILL a worker's process, as a crash would (the process must be on this machine).
    Ray restarts it if its max_restarts allows."""
    os.kill(deployment.worker_pid(worker_id), signal.SIGKILL)
