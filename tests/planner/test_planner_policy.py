"""One role's decisions, step by step: bounds, missing metrics, latency, cool-downs, hysteresis."""
from __future__ import annotations

from services.planner.config import RoleTargets, Stability
from services.planner.policy import RoleLoad, RolePolicy

STABLE = Stability(scale_up_cooldown_s=30, scale_down_cooldown_s=120, scale_down_window_s=300)


def prefill(capacity: float = 1000.0, **kwargs) -> RolePolicy:
    targets = RoleTargets(min_replicas=1, max_replicas=6, latency_target_s=1.0, capacity_per_replica=capacity)
    return RolePolicy("prefill", targets, Stability(**{**STABLE.__dict__, **kwargs}), window_s=60)


def test_a_count_outside_min_max_is_corrected_even_without_metrics():
    d = prefill().decide(None, current=0, now=0)
    assert (d.current, d.desired, d.direction) == (0, 1, "up") and "outside [1, 6]" in d.reason
    assert prefill().decide(None, current=9, now=0).desired == 6


def test_no_metrics_holds():
    d = prefill().decide(None, current=3, now=0)
    assert d.direction == "hold" and d.reason == "no metrics: holding"


def test_demand_sets_the_count_in_one_step_and_cool_down_blocks_the_next_rise():
    p = prefill()
    d = p.decide(RoleLoad(pods=1, prompt_tokens_per_s=2500, ttft_p90_s=0.3), current=1, now=100)
    assert d.desired == 4  # 2500 / (1000 x 70%) = 3.6
    p.changed(100)
    d = p.decide(RoleLoad(pods=1, prompt_tokens_per_s=4000, ttft_p90_s=0.3), current=4, now=110)
    assert d.direction == "hold" and d.recommended == 6 and "cooling down" in d.reason
    assert p.decide(RoleLoad(pods=4, prompt_tokens_per_s=4000, ttft_p90_s=0.3), current=4, now=131).desired == 6


def test_latency_adds_a_replica_only_once_the_current_ones_have_served_a_window():
    p = prefill()
    slow = RoleLoad(pods=2, prompt_tokens_per_s=1000, ttft_p90_s=3.0)  # demand fits 2; TTFT says otherwise
    assert p.decide(slow, current=2, now=0).direction == "hold"  # measured before a full window
    d = p.decide(slow, current=2, now=61)
    assert d.desired == 3 and d.reason.startswith("TTFT p90 3s > target 1s")
    p.changed(61)
    starting = RoleLoad(pods=2, prompt_tokens_per_s=1000, ttft_p90_s=3.0)  # the third is still loading
    assert p.decide(starting, current=3, now=100).direction == "hold"


def test_without_capacity_latency_alone_grows_the_role_in_proportion():
    p = prefill(capacity=0)
    p.decide(RoleLoad(pods=2, prompt_tokens_per_s=1000, ttft_p90_s=0.5), current=2, now=0)
    d = p.decide(RoleLoad(pods=2, prompt_tokens_per_s=1000, ttft_p90_s=1.6), current=2, now=61)
    assert d.desired == 4  # ceil(2 x 1.6)
    assert p.decide(RoleLoad(pods=2, prompt_tokens_per_s=0, ttft_p90_s=None), current=2, now=61).recommended == 1


def test_shrinking_waits_for_the_window_the_cooldown_and_latency_and_goes_one_at_a_time():
    p = prefill()
    light = RoleLoad(pods=5, prompt_tokens_per_s=500, ttft_p90_s=0.2)  # fits 1 replica
    assert "first 300s" in p.decide(light, current=5, now=0).reason
    assert p.decide(light, current=5, now=301).desired == 4  # then one at a time
    p.changed(301)
    assert "cooling down" in p.decide(light, current=4, now=400).reason
    near_target = RoleLoad(pods=4, prompt_tokens_per_s=500, ttft_p90_s=0.9)
    assert "not shrinking" in p.decide(near_target, current=4, now=500).reason
    assert "4 was recommended within 300s" in p.decide(light, current=4, now=700).reason  # that counts too
    assert p.decide(light, current=4, now=801).desired == 3


def test_hysteresis_band_keeps_a_count_that_demand_barely_fits():
    p = prefill()
    # 1300 tokens/s: 2 replicas are needed (1.86 x 700); 1 more would not fit with 10% to spare.
    assert p.decide(RoleLoad(pods=2, prompt_tokens_per_s=1300, ttft_p90_s=0.2), current=2, now=400).direction == "hold"
    assert p.recommend(RoleLoad(pods=3, prompt_tokens_per_s=1300), current=3)[0] == 3  # 1300/630 = 2.06: keep 3
