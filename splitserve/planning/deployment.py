"""A deployment config (``splitserve serve --config``) as the simulator sees it: ``SimConfig``."""

from __future__ import annotations

from collections.abc import Mapping

from splitserve.deploy.config import DeploymentConfig
from splitserve.deploy.live_planner import role_blocks
from splitserve.deploy.profile import Profile
from splitserve.planning.simulator import RoleSpec, SimConfig


def sim_config(
    deployment: DeploymentConfig,
    profiles: Mapping[str, Profile],
    ttft_overhead_s: float | None = None,
    losses: tuple[tuple[float, str], ...] = (),
) -> SimConfig:
    """The simulation of ``deployment`` with each role timed by ``profiles[role]``; ``ttft_overhead_s``
    None takes the first role's profile's measured one."""
    specs = {}
    for role in deployment.roles:
        r, profile = getattr(deployment, role), profiles[role]
        specs[role] = RoleSpec(
            count=r.replicas,
            profile=profile,
            num_blocks=role_blocks(deployment, role, profile),
            max_inflight=r.max_inflight,
            tensor_parallel_size=r.tensor_parallel_size,
        )
    engine, router = deployment.engine, deployment.router
    first = profiles[deployment.roles[0]]
    return SimConfig(
        mode=deployment.mode,
        **specs,
        block_size=engine.block_size,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        prefill_chunk_size=engine.prefill_chunk_size,
        max_model_len=first.model.max_position_embeddings,
        routing_policy=router.routing_policy,
        overlap_weight=router.overlap_weight,
        max_queue=router.max_queue,
        lease_timeout_s=router.lease_timeout_s,
        max_prefill_retries=router.max_prefill_retries,
        max_migrations=router.max_migrations,
        local_prefill_max_tokens=router.local_prefill_max_tokens,
        remote_prefill_max_queue_tokens=router.remote_prefill_max_queue_tokens,
        ttft_overhead_s=first.ttft_overhead_s if ttft_overhead_s is None else ttft_overhead_s,
        losses=losses,
    )
