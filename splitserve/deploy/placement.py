"""Where Ray runs each worker: its actor options (CPUs, GPUs, custom resources, node labels, restarts)
and, for a tensor-parallel worker, a placement group of one bundle per rank."""

from __future__ import annotations

import logging
import uuid

from splitserve.deploy.config import DeploymentConfig

log = logging.getLogger("splitserve.deploy.deployment")

# A placement group's bundle must hold some resource: a rank that reserves no CPU gets this sliver.
MIN_BUNDLE_CPU = 0.001


class Placement:
    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.groups: dict[str, object] = {}  # worker id -> its ranks' placement group (TP > 1)

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

    def place_ranks(self, worker_id: str, role: str, slot: int, options: dict, env: dict) -> tuple[dict, tuple]:
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
        self.groups[worker_id] = group
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

    def remove(self, worker_id: str) -> None:
        from ray.util.placement_group import remove_placement_group

        group = self.groups.pop(worker_id, None)
        if group is not None:
            try:
                remove_placement_group(group)
            except Exception as e:  # the cluster is going away
                log.warning("placement group of %s: %s", worker_id, e)

    def remove_all(self) -> None:
        for worker_id in list(self.groups):
            self.remove(worker_id)
