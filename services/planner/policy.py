"""Scaling decisions for one role: a recommendation from load and latency, then hysteresis.

Pure logic (no I/O, time passed in), so a simulated load can drive it as the real loop does.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from services.planner.config import PlannerConfig, RoleTargets, Stability


@dataclass(frozen=True)
class RoleLoad:
    """What the metrics say about one role, aggregated over its instances and a window."""
    pods: int = 0  # instances reporting metrics (ready replicas)
    # Incoming prompt tokens/s: those processed plus the growth of the queue, so that a
    # saturated prefill (which processes only its capacity) still shows the real demand.
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    running: float | None = None  # requests in running batches, summed
    waiting: float | None = None  # requests queued, summed
    kv_cache_usage: float | None = None  # mean fraction of KV blocks in use
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None
    requests_per_s: float | None = None  # prefill: prompts served per second (TTFT observations)

    def demand(self, role: str, latency_target_s: float) -> float | None:
        """Tokens/s the role is asked for. Decode: generated tokens/s, plus what the queued requests
        would take at the ITL target (a saturated decode generates only what it can)."""
        if role == "prefill":
            return self.prompt_tokens_per_s
        if self.generation_tokens_per_s is None:
            return None
        return self.generation_tokens_per_s + (self.waiting or 0.0) / latency_target_s

    def latency(self, role: str) -> float | None:
        return self.ttft_p90_s if role == "prefill" else self.itl_p90_s


_LATENCY_NAME = {"prefill": "TTFT", "decode": "ITL"}


def _fmt(x: float) -> str:
    return f"{x:.3g}"


@dataclass(frozen=True)
class Decision:
    role: str
    current: int
    desired: int  # what the planner sets; == current: hold
    recommended: int  # before cool-downs and the scale-down window
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"


class RolePolicy:
    """Recommends a replica count for one role and decides whether to act on it now."""

    def __init__(self, role: str, targets: RoleTargets, stability: Stability, window_s: float) -> None:
        self.role, self.targets, self.stability = role, targets, stability
        self.window_s = window_s  # latency judges the current replicas after they all served this long
        self.history: deque[tuple[float, int]] = deque()  # (time, recommendation)
        self.started: float | None = None
        self.last_change: float | None = None
        self.settled_since: float | None = None  # since when every replica asked for is serving

    def _band(self, units: float, current: int) -> int:
        """Replicas for `units` replicas' worth of work: up at once, down only with `tolerance` to spare."""
        up = math.ceil(units - 1e-9)
        if up > current:
            return up
        return min(current, math.ceil(units / (1.0 - self.stability.tolerance) - 1e-9))

    def recommend(self, load: RoleLoad, current: int, latency_settled: bool = True,
                  sla: tuple[int, str] | None = None) -> tuple[int, str]:
        """(replicas, why). Latency raises the count only when `latency_settled`: measured over a
        whole window of the current replicas serving, not the queue left from before. `sla`: the
        SLA mode's count for this role, which then stands in for capacity and latency feedback
        (the latency enters its prediction as a correction factor)."""
        t, role = self.targets, self.role
        ready = load.pods or current
        demand, latency = load.demand(role, t.latency_target_s), load.latency(role)
        lat_name = _LATENCY_NAME[role]
        candidates: list[tuple[int, str]] = []
        if sla is not None:
            candidates.append(sla)
        if sla is None and t.capacity_per_replica > 0 and demand is not None:
            per = t.capacity_per_replica * t.utilization
            what = "prompt" if role == "prefill" else "generation"
            if role == "decode" and load.waiting:
                what += f" (+{_fmt(load.waiting)} waiting)"
            n = self._band(demand / per, current)
            candidates.append((n, f"{what} {_fmt(demand)} tokens/s needs {n} x {_fmt(t.capacity_per_replica)} "
                                  f"tokens/s at {t.utilization:.0%}"))
        if t.kv_cache_usage_target > 0 and load.kv_cache_usage is not None:
            n = self._band(ready * load.kv_cache_usage / t.kv_cache_usage_target, current)
            candidates.append((n, f"KV cache usage {load.kv_cache_usage:.0%} on {ready} "
                                  f"(target {t.kv_cache_usage_target:.0%}) needs {n}"))
        if sla is None and latency is not None and latency > t.latency_target_s:
            breach = f"{lat_name} p90 {_fmt(latency)}s > target {_fmt(t.latency_target_s)}s"
            if not latency_settled:
                candidates.append((current, f"{breach} (measured before the current replicas all served)"))
            elif t.capacity_per_replica > 0:  # the capacity is optimistic: one more
                candidates.append((current + 1, breach))
            else:  # latency is the only signal: grow in proportion, at most double
                candidates.append((max(current + 1, math.ceil(ready * min(latency / t.latency_target_s, 2.0))),
                                   breach))
        if not candidates:
            idle = demand is not None and demand == 0 and not load.waiting
            candidates.append((t.min_replicas, "no load") if idle else
                              (current, f"{lat_name} p90 within target"))
        n, reason = max(candidates, key=lambda c: c[0])
        clamped = min(max(n, t.min_replicas), t.max_replicas)
        if clamped != n:
            reason += f" (clamped to [{t.min_replicas}, {t.max_replicas}])"
        near = t.latency_target_s * self.stability.scale_down_latency_ratio
        if clamped < current and latency is not None and latency > near:
            return current, (f"{reason}; not shrinking: {lat_name} p90 {_fmt(latency)}s is above "
                             f"{self.stability.scale_down_latency_ratio:.0%} of its target")
        return clamped, reason

    def decide(self, load: RoleLoad | None, current: int, now: float,
               sla: tuple[int, str] | None = None) -> Decision:
        s = self.stability
        if self.started is None:
            self.started = now
        t = self.targets
        if not t.min_replicas <= current <= t.max_replicas:  # whatever the metrics say (none, at 0 replicas)
            n = min(max(current, t.min_replicas), t.max_replicas)
            return Decision(self.role, current, n, n, f"{current} replicas is outside [{t.min_replicas}, "
                                                      f"{t.max_replicas}]")
        if load is None:
            return Decision(self.role, current, current, current, "no metrics: holding")
        if load.pods < current:  # replicas still starting
            self.settled_since = None
        elif self.settled_since is None:
            self.settled_since = now
        settled = self.settled_since is not None and now - self.settled_since >= self.window_s
        rec, reason = self.recommend(load, current, settled, sla)
        self.history.append((now, rec))
        while self.history and self.history[0][0] < now - s.scale_down_window_s:
            self.history.popleft()
        since = math.inf if self.last_change is None else now - self.last_change
        desired = current
        if rec > current:
            if since < s.scale_up_cooldown_s:
                reason += f"; cooling down ({since:.0f}s < {s.scale_up_cooldown_s:.0f}s since the last change)"
            else:
                desired = rec
        elif rec < current:
            highest = max(n for _, n in self.history)
            if now - self.started < s.scale_down_window_s:
                reason += f"; not shrinking in the first {s.scale_down_window_s:.0f}s"
            elif highest >= current:
                reason += f"; {highest} was recommended within {s.scale_down_window_s:.0f}s"
            elif since < s.scale_down_cooldown_s:
                reason += f"; cooling down ({since:.0f}s < {s.scale_down_cooldown_s:.0f}s since the last change)"
            else:
                desired = max(highest, current - s.max_scale_down_step)
        return Decision(self.role, current, desired, rec, reason)

    def changed(self, now: float) -> None:
        """The planner acted (or, in dry-run, would have): cool-downs start now."""
        self.last_change = now


def make_policies(config: PlannerConfig) -> dict[str, RolePolicy]:
    return {role: RolePolicy(role, config.targets(role), config.stability, config.window_s) for role in config.roles}
