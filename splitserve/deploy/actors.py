"""The Ray actor a worker runs in."""

from __future__ import annotations

import os
from dataclasses import replace

from splitserve.worker_common.config import WorkerConfig


class WorkerActor:
    """A prefill, decode or colocated worker inside a Ray actor process. It binds and advertises the node's
    address (or the configured one) and registers with the router itself. A tensor-parallel worker's actor
    is its rank 0: it starts the other ranks (``splitserve.deploy.rank_actors``) with ``rank_options``, their Ray
    options, one per rank from 1."""

    def __init__(self, config: WorkerConfig, rank_options: tuple[dict, ...] = ()) -> None:
        import ray

        from splitserve.observability.logs import configure_logging

        configure_logging(config.log_format, static={"worker_id": config.worker_id, "role": config.role})
        from splitserve.deploy.roles import worker_class

        cls = worker_class(config.role)
        context = ray.get_runtime_context()
        self.node = context.get_node_id()
        if context.was_current_actor_reconstructed:  # fault points that end the process fire once
            config = config.restarted()
        config = replace(config, node=self.node, host=config.host or ray.util.get_node_ip_address())
        self.followers = None
        if config.engine.tensor_parallel_size > 1:
            from splitserve.deploy.rank_actors import FollowerRanks

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
