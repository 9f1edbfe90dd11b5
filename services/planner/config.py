"""The planner's frozen config: per-role targets and the rules that keep it from flapping."""
from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RoleTargets:
    """What one role must deliver, and what one replica of it can do.

    Demand and capacity are tokens/s, so that they do not depend on how many replicas share them:
    prefill: latency is TTFT (p90); demand is the incoming prompt tokens/s; capacity is the prompt
    tokens/s one replica sustains (from profiling, e.g. `pdserve bench`).
    decode: latency is ITL (p90); demand is the generated tokens/s plus what queued requests would
    take; capacity is the tokens/s one replica generates at its ITL target (sequences in its
    batch at that ITL / ITL); KV cache usage above `kv_cache_usage_target` asks for more too.
    A capacity of 0 means "unknown": the role is then scaled by latency feedback alone.
    """
    min_replicas: int = 1
    max_replicas: int = 8
    latency_target_s: float = 1.0
    capacity_per_replica: float = 0.0
    utilization: float = 0.7  # plan for this fraction of capacity: headroom keeps queues (latency) short
    kv_cache_usage_target: float = 0.0  # decode: 0 = not a signal

    def __post_init__(self) -> None:
        # At 0 replicas a role reports no metrics: nothing would tell the planner to bring it back.
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas ({self.min_replicas}) <= max_replicas ({self.max_replicas})")
        if self.latency_target_s <= 0:
            raise ValueError("the latency target must be > 0 seconds")
        if self.capacity_per_replica < 0:
            raise ValueError("capacity per replica must be >= 0 (0: unknown, scale on latency)")
        if not 0 < self.utilization <= 1:
            raise ValueError("utilization must be in (0, 1]")
        if not 0 <= self.kv_cache_usage_target <= 1:
            raise ValueError("the KV cache usage target must be in [0, 1] (0: off)")


@dataclass(frozen=True)
class Stability:
    """Hysteresis: what it takes before the planner changes a replica count."""
    tolerance: float = 0.1  # scale down only when demand fits the smaller count with this margin to spare
    scale_up_cooldown_s: float = 30.0  # after any change of a role, before it may grow again
    scale_down_cooldown_s: float = 120.0  # after any change of a role, before it may shrink
    scale_down_window_s: float = 300.0  # shrink to the highest count recommended over this window
    max_scale_down_step: int = 1  # replicas removed per decision
    # Never shrink while the latency p90 is above this fraction of its target.
    scale_down_latency_ratio: float = 0.8

    def __post_init__(self) -> None:
        if not 0 <= self.tolerance < 1:
            raise ValueError("tolerance must be in [0, 1)")
        for name in ("scale_up_cooldown_s", "scale_down_cooldown_s", "scale_down_window_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.max_scale_down_step < 1:
            raise ValueError("max_scale_down_step must be >= 1")


@dataclass(frozen=True)
class SlaTargets:
    """SLA mode: the pools are sized by simulating the observed load on a profile (services/planner/sla.py)."""
    ttft_s: float
    tpot_s: float  # per request; corrected by the measured ITL p90
    attainment: float = 0.9  # fraction of requests within the SLO that sizes a pool
    transport: str = "tcp"

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError("SLA targets must be > 0 seconds")
        if not 0 < self.attainment <= 1:
            raise ValueError("SLA attainment must be in (0, 1]")


@dataclass(frozen=True)
class PlannerConfig:
    prefill: RoleTargets = field(default_factory=lambda: RoleTargets(latency_target_s=1.0))
    decode: RoleTargets = field(default_factory=lambda: RoleTargets(latency_target_s=0.05,
                                                                     kv_cache_usage_target=0.8))
    stability: Stability = field(default_factory=Stability)
    roles: tuple[str, ...] = ROLES  # the roles this planner scales
    interval_s: float = 15.0
    window_s: float = 60.0  # rates and latency quantiles are taken over this window
    dry_run: bool = False
    sla: SlaTargets | None = None  # None: feedback mode (capacity, KV usage and latency per role)

    def __post_init__(self) -> None:
        unknown = set(self.roles) - set(ROLES)
        if unknown or not self.roles:
            raise ValueError(f"roles must be a non-empty subset of {ROLES}, got {self.roles}")
        if self.interval_s <= 0 or self.window_s <= 0:
            raise ValueError("interval and window must be > 0 seconds")

    def targets(self, role: str) -> RoleTargets:
        return getattr(self, role)
