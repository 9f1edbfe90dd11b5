"""The planner loop: read the load, decide per role, scale (or, in dry-run, only log and export)."""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from services.planner.config import PlannerConfig
from services.planner.policy import Decision, RoleLoad, make_policies

if TYPE_CHECKING:
    from services.planner.sla import SlaSizer

logger = logging.getLogger("pdserve.planner")


class LoadSource(Protocol):
    def read(self, roles) -> dict[str, RoleLoad | None]: ...


class Scaler(Protocol):
    def describe(self, role: str) -> str: ...
    def get_replicas(self, role: str) -> int: ...
    def set_replicas(self, role: str, replicas: int) -> None: ...


class PlannerMetrics:
    """What the planner saw and decided, as Prometheus metrics (the dry-run's output)."""

    def __init__(self, dry_run: bool) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.current = Gauge("pdserve:planner_current_replicas", "Replicas of the role now.", ["role"], registry=r)
        self.desired = Gauge("pdserve:planner_desired_replicas", "Replicas the planner sets (or would, in dry-run).",
                             ["role"], registry=r)
        self.recommended = Gauge("pdserve:planner_recommended_replicas",
                                 "Replicas the load asks for, before cool-downs and hysteresis.", ["role"], registry=r)
        self.signal = Gauge("pdserve:planner_signal", "The load the planner decided on.", ["role", "signal"],
                            registry=r)
        self.decisions = Counter("pdserve:planner_scaling_decisions", "Replica count changes (dry-run: would-be).",
                                 ["role", "direction", "dry_run"], registry=r)
        self.errors = Counter("pdserve:planner_errors", "Failed planning steps.", ["stage"], registry=r)
        Gauge("pdserve:planner_dry_run", "1 when the planner only logs and exports.", registry=r).set(int(dry_run))
        self.dry_run = "true" if dry_run else "false"

    def observe(self, d: Decision, load: RoleLoad | None, demand: float | None, latency: float | None) -> None:
        self.current.labels(d.role).set(d.current)
        self.desired.labels(d.role).set(d.desired)
        self.recommended.labels(d.role).set(d.recommended)
        signals = {"pods": load.pods if load else 0, "demand_tokens_per_s": demand, "latency_p90_seconds": latency,
                   "kv_cache_usage": load.kv_cache_usage if load else None}
        for name, value in signals.items():
            self.signal.labels(d.role, name).set(float("nan") if value is None else value)
        if d.direction != "hold":
            self.decisions.labels(d.role, d.direction, self.dry_run).inc()

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)


class Planner:
    """`scaler` None (dry-run only): the current count is taken as the instances reporting metrics."""

    def __init__(self, config: PlannerConfig, source: LoadSource, scaler: Scaler | None,
                 metrics: PlannerMetrics | None = None, clock: Callable[[], float] = time.monotonic,
                 sla: "SlaSizer | None" = None) -> None:
        if scaler is None and not config.dry_run:
            raise ValueError("without Deployments to scale the planner can only run in dry-run")
        self.config, self.source, self.scaler, self.clock = config, source, scaler, clock
        self.metrics = metrics or PlannerMetrics(config.dry_run)
        self.policies = make_policies(config)
        self.sla = sla  # SLA mode: both pools sized together from the observed load
        self.sla_plans: list = []  # every SLA plan made (the latest last)
        self.decisions: list[Decision] = []  # every decision that changed (or would change) a count

    def step(self) -> list[Decision]:
        """One planning round; returns every role's decision (holds too)."""
        now = self.clock()
        try:
            loads = self.source.read(self.config.roles)
        except Exception as e:  # noqa: BLE001 - one failed read must not stop the loop
            logger.warning("cannot read metrics: %s", e)
            self.metrics.errors.labels("metrics").inc()
            loads = {}
        out = []
        currents: dict[str, int] = {}
        for role in self.policies:
            load = loads.get(role)
            try:
                currents[role] = self.scaler.get_replicas(role) if self.scaler else (load.pods if load else 0)
            except Exception as e:  # noqa: BLE001
                logger.warning("cannot read the %s replica count: %s", role, e)
                self.metrics.errors.labels("kubernetes").inc()
        sla = self._sla_counts(loads, currents)
        for role, policy in self.policies.items():
            load = loads.get(role)
            if role not in currents:
                continue
            current = currents[role]
            d = policy.decide(load, current, now, sla.get(role))
            if d.direction != "hold":
                self._act(d, policy, now)
            else:
                logger.debug("%s: %d replicas, holding: %s", role, current, d.reason)
            latency = load.latency(role) if load else None
            self.metrics.observe(d, load, load.demand(role, policy.targets.latency_target_s) if load else None,
                                 latency)
            out.append(d)
        return out

    def _sla_counts(self, loads: dict, currents: dict[str, int]) -> dict[str, tuple[int, str]]:
        """SLA mode: each role's count from one simulated plan of both pools ({} when the load is unknown)."""
        if self.sla is None:
            return {}
        from services.planner.sla import Observation

        obs = Observation.from_loads(loads.get("prefill"), loads.get("decode"))
        if obs is None:
            return {}
        try:
            plan = self.sla.size(obs, currents.get("prefill", 0), currents.get("decode", 0))
        except Exception as e:  # noqa: BLE001 - a failed prediction leaves the roles on their other signals
            logger.warning("SLA sizing failed: %s", e)
            self.metrics.errors.labels("sla").inc()
            return {}
        self.sla_plans.append(plan)
        return {"prefill": (plan.prefill, plan.reason), "decode": (plan.decode, plan.reason)}

    def _act(self, d: Decision, policy, now: float) -> None:
        where = f" ({self.scaler.describe(d.role)})" if self.scaler else ""
        if self.config.dry_run:
            logger.info("[dry-run] would scale %s %d -> %d%s: %s", d.role, d.current, d.desired, where, d.reason)
        else:
            try:
                self.scaler.set_replicas(d.role, d.desired)
            except Exception as e:  # noqa: BLE001
                logger.error("scaling %s %d -> %d%s failed: %s", d.role, d.current, d.desired, where, e)
                self.metrics.errors.labels("kubernetes").inc()
                return
            logger.info("scaled %s %d -> %d%s: %s", d.role, d.current, d.desired, where, d.reason)
        policy.changed(now)
        self.decisions.append(d)

    def run(self, stop: threading.Event) -> None:
        logger.info("planner started: roles %s, every %.0fs over a %.0fs window%s", ",".join(self.config.roles),
                    self.config.interval_s, self.config.window_s, " (dry-run)" if self.config.dry_run else "")
        while not stop.is_set():
            self.step()
            stop.wait(self.config.interval_s)
        logger.info("planner stopped")
