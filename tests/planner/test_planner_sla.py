"""The planner's SLA mode: the observed load sized on the simulator, corrected by measured latency."""
from __future__ import annotations

import argparse

import pytest

from services.planner.cli import add_planner_parser, config_from_args
from services.planner.config import PlannerConfig, RoleTargets, SlaTargets
from services.planner.planner import Planner
from services.planner.policy import RoleLoad
from services.planner.simulator import Fleet, simulate
from services.planner.sla import Observation, SlaSizer
from services.planner.workload import poisson
from sim_profiles import CPU_LIKE, profile

TARGETS = SlaTargets(ttft_s=3.0, tpot_s=0.05)


def _attainment(p: int, d: int, obs: Observation, ttft_s: float, tpot_s: float) -> tuple[float, float]:
    w = poisson(obs.rate, 300, f"fixed:{round(obs.isl)}", f"fixed:{round(obs.osl)}")
    traces = simulate(profile(CPU_LIKE), Fleet(num_prefill=p, num_decode=d), list(w.requests))
    return (sum(t.ttft <= ttft_s for t in traces) / len(traces),
            sum((t.tpot or 0) <= tpot_s for t in traces) / len(traces))


def test_observation_from_the_metrics():
    obs = Observation.from_loads(RoleLoad(pods=1, prompt_tokens_per_s=3000, requests_per_s=2.0, ttft_p90_s=0.8),
                                 RoleLoad(pods=2, generation_tokens_per_s=198, itl_p90_s=0.03))
    assert (obs.rate, obs.isl, obs.osl, obs.ttft_p90_s, obs.itl_p90_s) == (2.0, 1500, 100, 0.8, 0.03)
    assert Observation.from_loads(RoleLoad(pods=1, prompt_tokens_per_s=0, requests_per_s=0), RoleLoad()) is None
    assert Observation.from_loads(None, RoleLoad()) is None


def test_plan_is_the_fewest_replicas_meeting_the_slo():
    obs = Observation(rate=2.0, isl=1500, osl=100)
    plan = SlaSizer(profile(CPU_LIKE), TARGETS, max_prefill=8, max_decode=8).size(obs, 0, 0)
    assert plan.ttft_correction == plan.itl_correction == 1.0  # nothing measured yet
    # ~0.85 s a prompt: 2 req/s needs more than one prefill, and the plan is the edge.
    assert plan.prefill >= 2
    assert _attainment(plan.prefill, 8, obs, 3.0, 0.05)[0] >= 0.9
    assert _attainment(plan.prefill - 1, 8, obs, 3.0, 0.05)[0] < 0.9
    assert _attainment(plan.prefill, plan.decode, obs, 3.0, 0.05)[1] >= 0.9
    if plan.decode > 1:
        assert _attainment(plan.prefill, plan.decode - 1, obs, 3.0, 0.05)[1] < 0.9
    assert f"{plan.prefill}P+{plan.decode}D" in plan.reason


def test_measured_latency_above_the_prediction_asks_for_more():
    sizer = SlaSizer(profile(CPU_LIKE), TARGETS, max_prefill=8, max_decode=8)
    load = Observation(rate=2.0, isl=1500, osl=100)
    plain = sizer.size(load, 0, 0)
    ttft, itl = sizer.predict(load, plain.prefill, plain.decode)
    # The deployment measures 2.5x what the simulator predicts for it, on both latencies.
    slow = Observation(2.0, 1500, 100, ttft_p90_s=2.5 * ttft, itl_p90_s=2.5 * itl)
    corrected = sizer.size(slow, plain.prefill, plain.decode)
    assert corrected.ttft_correction == pytest.approx(2.5)
    assert corrected.itl_correction == pytest.approx(2.5)
    assert corrected.prefill > plain.prefill and corrected.decode > plain.decode
    # As predicted: no correction, the same plan; wildly off: the factor is clamped.
    exact = Observation(2.0, 1500, 100, ttft_p90_s=ttft, itl_p90_s=itl)
    assert sizer.size(exact, plain.prefill, plain.decode).prefill == plain.prefill
    assert sizer.corrections(Observation(2.0, 1500, 100, 100 * ttft, itl / 100), plain.prefill,
                             plain.decode) == (4.0, 0.5)


class _Source:
    def __init__(self, loads):
        self.loads = loads

    def read(self, roles):
        return {r: self.loads.get(r) for r in roles}


class _Scaler:
    def __init__(self, counts):
        self.counts = dict(counts)

    def describe(self, role):
        return role

    def get_replicas(self, role):
        return self.counts[role]

    def set_replicas(self, role, n):
        self.counts[role] = n


def test_planner_in_sla_mode_sizes_both_pools_from_one_plan():
    config = PlannerConfig(prefill=RoleTargets(max_replicas=8), decode=RoleTargets(max_replicas=8), sla=TARGETS)
    loads = {"prefill": RoleLoad(pods=1, prompt_tokens_per_s=3000, requests_per_s=2.0),
             "decode": RoleLoad(pods=1, generation_tokens_per_s=198)}
    sizer = SlaSizer(profile(CPU_LIKE), TARGETS, 8, 8)
    scaler = _Scaler({"prefill": 1, "decode": 1})
    planner = Planner(config, _Source(loads), scaler, sla=sizer)
    decisions = {d.role: d for d in planner.step()}
    plan = planner.sla_plans[-1]
    assert plan == sizer.size(Observation(2.0, 1500, 100), 1, 1)
    assert scaler.counts == {"prefill": plan.prefill, "decode": plan.decode}
    assert decisions["prefill"].reason.startswith("SLA: 2 req/s, ISL 1500, OSL 100")
    # No traffic: the SLA mode has no opinion and the roles hold (no metrics -> feedback rules).
    idle = Planner(config, _Source({}), _Scaler({"prefill": 3, "decode": 2}), sla=sizer)
    assert all(d.direction == "hold" for d in idle.step()) and idle.sla_plans == []


def test_sla_flags():
    p = argparse.ArgumentParser()
    add_planner_parser(p.add_subparsers())
    base = ["planner", "--dry-run", "--mode", "sla"]
    with pytest.raises(ValueError, match="needs --profile FILE and --slo"):
        config_from_args(p.parse_args(base))
    with pytest.raises(ValueError, match="both ttft:MS and tpot:MS"):
        config_from_args(p.parse_args(base + ["--profile", "p.json", "--slo", "ttft:500"]))
    cfg = config_from_args(p.parse_args(base + ["--profile", "p.json", "--slo", "ttft:500,tpot:40"]))
    assert cfg.sla == SlaTargets(0.5, 0.04, 0.9, "tcp")
    assert config_from_args(p.parse_args(["planner", "--dry-run"])).sla is None


def test_pdserve_planner_once_in_sla_mode(tmp_path, caplog):
    from services.cli import main as pdserve

    prof = tmp_path / "profile.json"
    profile(CPU_LIKE).save(str(prof))
    common = ["planner", "--dry-run", "--once", "--metrics-source", "scrape", "--prefill-metrics", "127.0.0.1:9",
              "--decode-metrics", "127.0.0.1:9", "--mode", "sla", "--slo", "ttft:3000,tpot:50"]
    assert pdserve(common + ["--profile", str(prof)]) == 0  # no metrics reachable: no plan, the roles hold
    assert pdserve(common + ["--profile", str(prof), "--kv-transport", "ucx"]) == 2  # not in the profile
    assert pdserve(common + ["--profile", str(tmp_path / "missing.json")]) == 2
