"""``splitserve plan``: which deployment serves a workload within its SLOs on the fewest devices.

The search follows DistServe's (Zhong et al., OSDI 2024, Algorithm 1), with the simulator as its oracle:

1. For each tensor-parallel size of the prefill phase, the highest rate one prefill worker sustains with
   the TTFT SLO met (decode given room to spare, so only prefill limits); for each decode TP, the highest
   rate one decode worker sustains with the TPOT SLO met (prefill given room to spare). Each is a binary
   search over rates, one simulation per probe.
2. A disaggregated deployment of ``n_p`` prefill workers of TP ``t_p`` and ``n_d`` decode workers of TP
   ``t_d`` then serves ``min(n_p r_p, n_d r_d)``; on a budget of devices, the best counts follow. A
   colocated deployment of TP ``t_c`` serves ``n_c r_c`` with ``r_c`` searched against both SLOs.
3. The best candidates are checked by simulating the whole deployment at the rate they promise
   (the per-phase searches ignore the other phase's queueing and the KV transfer).

Ranked by goodput per device: the highest rate meeting the attainment target, over the devices used.

A disaggregated deployment is searched only where every profile has a KV transfer (its hand-offs are
timed by it); ``modes`` ``("colocated",)`` plans without one. A profile without a transfer, with
disaggregated deployments in ``modes``, is refused by name (``MissingPart``) rather than planned as if
hand-offs were free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from splitserve.bench.arrivals import arrival_offsets
from splitserve.deploy.config import DeploymentConfig, RoleConfig
from splitserve.deploy.profile import Profile
from splitserve.planning.deployment import sim_config
from splitserve.planning.simulator import simulate

Workload = Sequence[tuple[list[int], int]]  # (prompt token ids, output length)
MODES = ("disaggregated", "colocated")


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float
    attainment: float = 0.9

    def goodput(self) -> dict[str, float]:
        return {"ttft": self.ttft_ms, "tpot": self.tpot_ms}


@dataclass(frozen=True)
class Budget:
    devices: int
    devices_per_node: int = 8


@dataclass(frozen=True)
class Candidate:
    mode: str
    counts: dict[str, int]  # role -> workers
    tp: dict[str, int]  # role -> tensor_parallel_size
    rate: float  # the rate it is predicted to sustain within the SLOs (req/s)
    checked_rate: float | None = None  # what a whole-deployment simulation at that rate attained (req/s met)
    checked_attainment: float | None = None
    local_prefill_max_tokens: int = 0  # conditional disaggregation: short prompts prefilled on decode workers

    @property
    def devices(self) -> int:
        return sum(self.counts[r] * self.tp[r] for r in self.counts)

    @property
    def goodput_per_device(self) -> float:
        rate = self.rate if self.checked_rate is None else self.checked_rate
        return rate / self.devices if self.devices else 0.0

    def describe(self) -> str:
        roles = " + ".join(f"{self.counts[r]}x{r[0].upper()} TP{self.tp[r]}" for r in self.counts)
        local = f", local prefill <= {self.local_prefill_max_tokens}" if self.local_prefill_max_tokens else ""
        return f"{self.mode} {roles}{local}"


def attainment(
    deployment: DeploymentConfig,
    profiles: Mapping[str, Profile],
    workload: Workload,
    rate: float,
    slo: Slo,
    seed: int,
    min_duration_s: float = 0.0,
) -> float:
    """Fraction of the workload's requests meeting both SLOs at ``rate`` (Poisson arrivals), the workload
    repeated (each copy's prompts made distinct) until its arrivals span ``min_duration_s``: a short burst
    fits in the batches it fills at any rate, and only arrivals that go on show what a deployment sustains."""
    work = sustained(workload, rate, min_duration_s)
    offsets = arrival_offsets(len(work), rate, 1.0, seed)
    result, _ = simulate(sim_config(deployment, profiles), work, offsets, goodput=slo.goodput())
    return (result["good_requests"] or 0) / len(work)


def sustained(workload: Workload, rate: float, min_duration_s: float) -> Workload:
    """``workload``, repeated until ``rate`` takes ``min_duration_s`` to send it; each copy's first token
    changed so that copies share no prefix (the prefix cache would make them cheaper than the first)."""
    n = max(len(workload), math.ceil(rate * min_duration_s))
    if n == len(workload):
        return workload
    top = max(max(p) if p else 0 for p, _ in workload) + 1
    out = []
    for i in range(n):
        prompt, output = workload[i % len(workload)]
        copy = i // len(workload)
        out.append(([(prompt[0] + copy) % top, *prompt[1:]] if prompt and copy else list(prompt), output))
    return out


def max_rate(meets: Callable[[float], bool], low: float = 0.01, high: float = 1.0, iterations: int = 12) -> float:
    """The highest rate with ``meets(rate)``, assuming it holds below some threshold and not above: grow
    ``high`` until it fails, then bisect. 0 when even ``low`` fails."""
    if not meets(low):
        return 0.0
    while meets(high):
        low, high = high, high * 2
        if high > 1e7:
            return high
    for _ in range(iterations):
        mid = math.sqrt(low * high)
        if meets(mid):
            low = mid
        else:
            high = mid
    return low


def with_roles(base: DeploymentConfig, mode: str, **roles: tuple[int, int]) -> DeploymentConfig:
    """``base`` in ``mode`` with these (replicas, tensor_parallel_size) per role."""
    changes = {
        role: replace(getattr(base, role), replicas=count, tensor_parallel_size=tp)
        for role, (count, tp) in roles.items()
    }
    return replace(base, mode=mode, **changes)


def tp_choices(profiles: Mapping[int, Profile], budget: Budget) -> list[int]:
    return sorted(t for t in profiles if t <= budget.devices_per_node and t <= budget.devices)


def search(
    base: DeploymentConfig,
    profiles: Mapping[int, Profile],
    workload: Workload,
    slo: Slo,
    budget: Budget,
    seed: int = 0,
    check: int = 3,
    spare_workers: int = 4,
    local_prefill: Sequence[int] = (),
    min_duration_s: float = 0.0,
    modes: Sequence[str] = MODES,
) -> list[Candidate]:
    """Ranked candidates, best goodput per device first. ``profiles``: a profile per TP size of the device;
    ``modes``: the deployment modes searched."""
    tps = tp_choices(profiles, budget)
    if not tps:
        raise ValueError(f"profiles: none for a TP size that fits {budget.devices_per_node} devices per node")
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"modes: expected some of {', '.join(MODES)}, got {list(modes)}")
    if "disaggregated" in modes:
        for tp in tps:
            profiles[tp].require_transfer(
                f"plan compares disaggregated deployments, whose KV hand-offs it times (TP {tp}'s profile); "
                "or plan colocated deployments only (--mode colocated)"
            )

    def per_phase(role: str, tp: int) -> float:
        other = "decode" if role == "prefill" else "prefill"
        deployment = with_roles(base, "disaggregated", **{role: (1, tp), other: (spare_workers, min(tps))})
        roles = {role: profiles[tp], other: profiles[min(tps)]}
        # A full decode worker keeps requests waiting for a lease: that shows in their TTFT, so the decode
        # phase keeps the TTFT SLO too (its spare prefill workers keep the prefill's share of it small).
        one = Slo(slo.ttft_ms, slo.tpot_ms if role == "decode" else 1e12, slo.attainment)
        return max_rate(
            lambda r: attainment(deployment, roles, workload, r, one, seed, min_duration_s) >= slo.attainment
        )

    disaggregated = "disaggregated" in modes
    prefill_rates = {t: per_phase("prefill", t) for t in tps} if disaggregated else {}
    decode_rates = {t: per_phase("decode", t) for t in tps} if disaggregated else {}
    candidates = []
    for tp_p in tps if disaggregated else ():
        for tp_d in tps:
            best = _best_split(prefill_rates[tp_p], decode_rates[tp_d], tp_p, tp_d, budget.devices)
            if best is not None:
                n_p, n_d, rate = best
                candidates.append(
                    Candidate("disaggregated", {"prefill": n_p, "decode": n_d}, {"prefill": tp_p, "decode": tp_d}, rate)
                )
    for tp in tps if "colocated" in modes else ():
        deployment = with_roles(base, "colocated", colocated=(1, tp))
        r = max_rate(
            lambda r, d=deployment, t=tp: (
                attainment(d, {"colocated": profiles[t]}, workload, r, slo, seed, min_duration_s) >= slo.attainment
            )
        )
        count = budget.devices // tp
        if r > 0 and count:
            candidates.append(Candidate("colocated", {"colocated": count}, {"colocated": tp}, r * count))
    candidates.sort(key=lambda c: -c.goodput_per_device)
    checked = [_check(c, base, profiles, workload, slo, seed, min_duration_s) for c in candidates[:check]]
    # Conditional disaggregation: the best disaggregated counts again, with short prompts prefilled on the
    # decode workers, searched whole (the per-phase rates do not apply to it).
    for candidate in [c for c in checked if c.mode == "disaggregated"][:1]:
        for threshold in local_prefill:
            checked.append(_conditional(candidate, threshold, base, profiles, workload, slo, seed, min_duration_s))
    ranked = checked + candidates[check:]
    ranked.sort(key=lambda c: -c.goodput_per_device)
    return ranked


def _conditional(
    candidate: Candidate,
    threshold: int,
    base: DeploymentConfig,
    profiles: Mapping[int, Profile],
    workload: Workload,
    slo: Slo,
    seed: int,
    min_duration_s: float = 0.0,
) -> Candidate:
    deployment = deployment_config(base, replace(candidate, local_prefill_max_tokens=threshold))
    role_profiles = {role: profiles[candidate.tp[role]] for role in candidate.counts}

    def meets(r: float) -> bool:
        return attainment(deployment, role_profiles, workload, r, slo, seed, min_duration_s) >= slo.attainment

    rate = max_rate(meets)
    reached = attainment(deployment, role_profiles, workload, rate, slo, seed, min_duration_s) if rate > 0 else 0.0
    return replace(
        candidate, rate=rate, checked_rate=rate, checked_attainment=reached, local_prefill_max_tokens=threshold
    )


def local_prefill_threshold(profile: Profile, tpot_ms: float, share: float = 0.5) -> int:
    """Conditional disaggregation's threshold (``router.local_prefill_max_tokens``) from a decode worker's
    profile: the longest uncached prompt whose prefill takes at most ``share`` of the TPOT SLO, so that the
    decode step that carries it still leaves the rest of the SLO to the batch it stalls. 0: none does (no
    local prefill). A remote prefill of such a prompt would cost a KV transfer and a second worker's step
    for little: Dynamo's rule of thumb, made a number by the profile."""
    from splitserve.deploy.profile import StepShape

    budget = share * tpot_ms / 1e3
    if profile.serving_step_s(StepShape.of([(0, 1)]), 1) > budget:
        return 0
    low, high = 1, 1
    while profile.serving_step_s(StepShape.of([(0, high)]), 1) <= budget and high < 1 << 20:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        if profile.serving_step_s(StepShape.of([(0, mid)]), 1) <= budget:
            low = mid
        else:
            high = mid
    return low


def _best_split(rate_p: float, rate_d: float, tp_p: int, tp_d: int, devices: int) -> tuple[int, int, float] | None:
    """Counts of prefill and decode workers within ``devices`` that sustain the most: the rate is the
    smaller phase's, so the devices go to the two phases in proportion to what each needs."""
    if rate_p <= 0 or rate_d <= 0:
        return None
    best = None
    for n_p in range(1, devices // tp_p + 1):
        n_d = (devices - n_p * tp_p) // tp_d
        if n_d < 1:
            break
        rate = min(n_p * rate_p, n_d * rate_d)
        # the fewest devices for that rate: no more decode workers than it needs
        n_d = min(n_d, math.ceil(rate / rate_d - 1e-9))
        if best is None or rate > best[2] * (1 + 1e-9):
            best = (n_p, n_d, rate)
    return best


def _check(
    candidate: Candidate,
    base: DeploymentConfig,
    profiles: Mapping[int, Profile],
    workload: Workload,
    slo: Slo,
    seed: int,
    min_duration_s: float = 0.0,
) -> Candidate:
    """Simulate the whole deployment at the rate it promises; its goodput is then what it attained there."""
    roles = {role: (candidate.counts[role], candidate.tp[role]) for role in candidate.counts}
    deployment = with_roles(base, candidate.mode, **roles)
    role_profiles = {role: profiles[candidate.tp[role]] for role in candidate.counts}
    reached = attainment(deployment, role_profiles, workload, candidate.rate, slo, seed, min_duration_s)
    met = candidate.rate if reached >= slo.attainment else candidate.rate * reached / slo.attainment
    return replace(candidate, checked_rate=met, checked_attainment=reached)


def fewest_devices(
    base: DeploymentConfig,
    profiles: Mapping[int, Profile],
    workload: Workload,
    slo: Slo,
    rate: float,
    devices_per_node: int = 8,
    most: int = 4096,
    seed: int = 0,
    min_duration_s: float = 0.0,
    modes: Sequence[str] = MODES,
) -> Candidate | None:
    """The inverse: the smallest budget whose best candidate sustains ``rate`` (doubling, then bisecting)."""

    def best_at(devices: int) -> Candidate | None:
        ranked = search(
            base,
            profiles,
            workload,
            slo,
            Budget(devices, devices_per_node),
            seed,
            check=1,
            min_duration_s=min_duration_s,
            modes=modes,
        )
        ok = [c for c in ranked if (c.checked_rate or c.rate) >= rate]
        return min(ok, key=lambda c: c.devices) if ok else None

    low, high = 0, 1
    while best_at(high) is None:
        low, high = high, high * 2
        if high > most:
            return None
    while high - low > 1:
        mid = (low + high) // 2
        if best_at(mid) is None:
            low = mid
        else:
            high = mid
    return best_at(high)


def deployment_config(base: DeploymentConfig, candidate: Candidate) -> DeploymentConfig:
    roles = {role: (candidate.counts[role], candidate.tp[role]) for role in candidate.counts}
    config = with_roles(base, candidate.mode, **roles)
    router = replace(config.router, local_prefill_max_tokens=candidate.local_prefill_max_tokens)
    return replace(config, router=router)


def to_yaml(config: DeploymentConfig, base_raw: dict | None = None) -> str:
    """A deployment file ``splitserve serve --config`` accepts: the planned roles over the base file's keys."""
    import yaml

    raw = dict(base_raw or {})
    raw["mode"] = config.mode
    for role in config.roles:
        r: RoleConfig = getattr(config, role)
        section = dict(raw.get(role) or {})
        section.update(replicas=r.replicas, tensor_parallel_size=r.tensor_parallel_size)
        raw[role] = section
    if config.router.local_prefill_max_tokens:
        raw["router"] = {
            **(raw.get("router") or {}),
            "local_prefill_max_tokens": config.router.local_prefill_max_tokens,
        }
    return yaml.safe_dump(raw, sort_keys=False)
