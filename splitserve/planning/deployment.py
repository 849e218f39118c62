"""A deployment config (``splitserve serve --config``) as the simulator sees it: ``SimConfig``."""

from __future__ import annotations

from collections.abc import Mapping

from splitserve.deploy_config import DeploymentConfig
from splitserve.planning.profile import Profile
from splitserve.planning.simulator import RoleSpec, SimConfig


def role_blocks(deployment: DeploymentConfig, role: str, profile: Profile) -> int:
    """KV blocks of one worker of the role: its ``num_blocks``, the engine's, else what one rank's KV
    memory holds (every rank of a worker has the same count): the profile's ``kv_cache_bytes`` where it
    says what the device leaves after the weights (a GPU profile), else the engine's ``kv_cache_bytes``."""
    role_config = getattr(deployment, role)
    engine = deployment.engine
    if role_config.num_blocks or engine.num_blocks:
        return role_config.num_blocks or engine.num_blocks
    per_block = profile.block_bytes(engine.block_size, role_config.tensor_parallel_size)
    memory = int(profile.notes.get("kv_cache_bytes") or engine.kv_cache_bytes)
    return max(1, memory // per_block)


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
