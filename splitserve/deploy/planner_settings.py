"""The deployment config's ``planner:`` section (``splitserve.deploy.live_planner`` runs it)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.validate import check_range, check_ranges


@dataclass(frozen=True)
class PlannerSettings:
    """The deployment config's ``planner:`` section."""

    enabled: bool = False
    profile: str | None = None  # the workers' profile (splitserve profile); required when enabled
    interval_s: float = 30.0
    window_s: float = 60.0  # the router's figures are taken over this much of the past
    ttft_ms: float = 2000.0  # the SLOs the deployment is sized for
    tpot_ms: float = 100.0
    headroom: float = 1.2  # size for this much more than the predicted rate
    smoothing: float = 0.5  # weight of the newest rate in the prediction
    stable_intervals: int = 3  # decisions that must agree before a scale-up
    scale_down_intervals: int = 6  # ... before a scale-down
    cooldown_s: float = 120.0  # no change this soon after the last one
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8

    def __post_init__(self) -> None:
        check_ranges(self, ("interval_s", "window_s", "ttft_ms", "tpot_ms"), above=0)
        check_range(self, "headroom", min=1)
        check_range(self, "smoothing", above=0, max=1)
        check_ranges(self, ("stable_intervals", "scale_down_intervals", "min_prefill", "min_decode"), min=1)
        check_range(self, "cooldown_s", min=0)
        for role in ("prefill", "decode"):
            low, high = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            if high < low:
                raise ValueError(f"max_{role}: {high} is below min_{role} {low}")
        if self.enabled and not self.profile:
            raise ValueError("profile: the planner needs the workers' profile (splitserve profile)")

    def bounds(self, role: str) -> tuple[int, int]:
        return getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
