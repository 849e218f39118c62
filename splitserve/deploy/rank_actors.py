"""The ranks of a tensor-parallel worker on Ray: rank 0 is the worker's own actor (``launch.WorkerActor``),
and it starts the other ranks as actors it owns, in the bundles of the worker's placement group.

    Deployment._spawn: placement group of t bundles (STRICT_PACK: one node) ─▶ WorkerActor in bundle 0
    WorkerActor (rank 0): rendezvous store on its address ─▶ RankActor r in bundle r, for r = 1 .. t-1
    every rank: meets the others at the store, forms the group (TPGroup: gloo on CPU, NCCL on CUDA),
                loads its shard; rank 0 links to the others, they start following, rank 0 serves

The followers share their owner's fate: when rank 0's process ends, Ray ends the actors it owns. A rank
that dies or stalls fails the group's next collective (at once, or by ``engine.tensor_parallel_timeout_s``),
rank 0's process ends (``WorkerBase.group_failed``), and Ray restarts rank 0's actor, which starts a new
group in the same bundles: "Ray restarts the group".
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence

from splitserve.engine.tp.distributed import TPGroup, bind_store, connect_store
from splitserve.worker_common.config import WorkerConfig
from splitserve.worker_common.tp.follower import Follower
from splitserve.worker_common.tp.rank_link import RankInfo, Ranks

# Ranks start seconds apart (a Ray worker process, torch to import, on busy cores): they meet at the store
# within this, before the group's own short timeout applies; loading a shard is bounded by it too.
SETUP_TIMEOUT_S = 120.0


def _backend_and_device(config: WorkerConfig):
    import torch

    device = torch.device(config.engine.device)
    return ("nccl" if device.type == "cuda" else "gloo"), device


def _join(config: WorkerConfig, store, group_id: str) -> TPGroup:
    backend, device = _backend_and_device(config)
    engine = config.engine
    return TPGroup.join(
        backend,
        store,
        f"tp/{group_id}/",
        engine.tensor_parallel_rank,
        engine.tensor_parallel_size,
        config.host,
        engine.tensor_parallel_timeout_s,
        SETUP_TIMEOUT_S,
        device,
    )


class RankActor:
    """A rank other than 0 of a tensor-parallel worker, inside a Ray actor that rank 0's actor owns."""

    def __init__(self, config: WorkerConfig, store_host: str, store_port: int, group_id: str) -> None:
        from splitserve.observability.logs import configure_logging

        rank = config.engine.tensor_parallel_rank
        configure_logging(
            config.log_format, static={"worker_id": f"{config.worker_id}.rank{rank}", "role": config.role}
        )
        self._store = connect_store(store_host, store_port, SETUP_TIMEOUT_S)
        group = _join(config, self._store, group_id)
        self.follower = Follower(config, group, group_id, rendezvous=(store_host, store_port))
        self.info = self.follower.start()

    def rank_info(self) -> RankInfo:
        return self.info

    def follow(self) -> None:
        self.follower.follow()

    def pid(self) -> int:
        return os.getpid()

    def status(self) -> dict[str, int]:
        return {**self.follower.status(), "pid": os.getpid()}


class FollowerRanks:
    """Rank 0's side: the follower actors it starts and owns, and its ``Ranks`` (the group and the links)."""

    def __init__(self, config: WorkerConfig, rank_options: Sequence[dict]) -> None:
        """Start ranks 1 .. t-1 (``rank_options[r - 1]``: Ray options of rank r, its placement-group bundle
        among them) and join the group as rank 0; returns once every rank is in it."""
        import ray

        size = config.engine.tensor_parallel_size
        if len(rank_options) != size - 1:
            raise ValueError(f"rank_options: {len(rank_options)} for {size - 1} follower ranks")
        self._store, port = bind_store(config.host, 0, SETUP_TIMEOUT_S)
        group_id = f"{config.worker_id}-{uuid.uuid4().hex[:12]}"
        self.actors = [
            ray.remote(RankActor).options(**rank_options[r - 1]).remote(config.for_rank(r), config.host, port, group_id)
            for r in range(1, size)
        ]
        self.ranks = Ranks(_join(config, self._store, group_id), group_id, config.security, (config.host, port))

    def connect(self) -> None:
        """Once rank 0's engine is built: wait for the others' (each loads its shard meanwhile), link to
        them, and let them follow."""
        import ray

        self.ranks.connect(ray.get([a.rank_info.remote() for a in self.actors], timeout=SETUP_TIMEOUT_S))
        ray.get([a.follow.remote() for a in self.actors], timeout=30)

    def status(self) -> list[dict[str, int]]:
        """Each follower's ``Follower.status`` and pid, in rank order."""
        import ray

        return ray.get([a.status.remote() for a in self.actors], timeout=30)
