"""The planner's decisions on a simulated deployment: the right role grows, nothing flaps, and
autoscaling meets the TTFT/ITL targets on fewer replica-seconds than a static peak allocation."""
from __future__ import annotations

import pytest

from planner_sim import Phase, Simulation
from services.planner.config import PlannerConfig, RoleTargets, Stability

TTFT_TARGET, ITL_TARGET = 1.5, 0.05
# What profiling the simulated hardware gives: 8000 prompt tokens/s per prefill replica; a decode
# replica holds 96 sequences at the ITL target, i.e. 96 / 0.05 = 1920 generated tokens/s.
CONFIG = PlannerConfig(
    prefill=RoleTargets(min_replicas=1, max_replicas=16, latency_target_s=TTFT_TARGET, capacity_per_replica=8000),
    decode=RoleTargets(min_replicas=1, max_replicas=16, latency_target_s=ITL_TARGET, capacity_per_replica=1920,
                       kv_cache_usage_target=0.8),
    interval_s=15, window_s=60)
BASELINE = Phase(600, rate=2, prompt_tokens=512, output_tokens=128)


def test_more_long_prompts_scale_prefill_not_decode():
    result = Simulation([BASELINE, Phase(900, rate=3, prompt_tokens=6000, output_tokens=64)], CONFIG).run()
    assert result.changes("prefill", after=0) and all(t >= BASELINE.duration_s for t, _ in result.changes("prefill"))
    assert result.peak("prefill") >= 4  # 3 req/s x 6000 tokens = 18000 tokens/s over 5600 per replica
    assert result.replicas["decode"] == [(0.0, 1)]
    assert result.p90_ttft(since=BASELINE.duration_s + 600) <= TTFT_TARGET  # caught up within 10 minutes


def test_longer_generations_scale_decode_not_prefill():
    result = Simulation([BASELINE, Phase(900, rate=4, prompt_tokens=256, output_tokens=1500)], CONFIG).run()
    assert result.peak("decode") >= 4  # 4 req/s x 1500 tokens = 6000 tokens/s over 1344 per replica
    assert all(t >= BASELINE.duration_s for t, _ in result.changes("decode"))
    assert result.replicas["prefill"] == [(0.0, 1)]
    assert result.p90_itl(since=BASELINE.duration_s + 300) <= ITL_TARGET


@pytest.mark.parametrize("seed", [0, 1])
def test_flat_load_does_not_flap(seed, capsys):
    # 5700 prompt tokens/s sits on the 1-or-2 prefill boundary (5600 per replica at 70%): Poisson
    # noise crosses it again and again; decode needs 2 replicas (2100 tokens/s).
    flat = [Phase(3600, rate=3, prompt_tokens=1900, output_tokens=700)]
    result = Simulation(flat, CONFIG, prefill=2, decode=1, seed=seed).run()
    assert result.changes("prefill") == []
    assert [n for _, n in result.changes("decode")] == [2]
    assert result.p90_ttft() <= TTFT_TARGET and result.p90_itl() <= ITL_TARGET
    # The same load without hysteresis does flap: what the assertions above rule out is real.
    bare = Stability(tolerance=0, scale_up_cooldown_s=0, scale_down_cooldown_s=0, scale_down_window_s=0,
                     scale_down_latency_ratio=100)
    flapping = Simulation(flat, PlannerConfig(CONFIG.prefill, CONFIG.decode, bare, interval_s=15, window_s=60),
                          prefill=2, decode=1, seed=seed).run()
    assert len(flapping.changes("prefill")) >= 10
    with capsys.disabled():
        print(f"\n[planner sim, flat load, seed {seed}] prefill changes in 1 h: {len(result.changes('prefill'))} "
              f"with hysteresis, {len(flapping.changes('prefill'))} without")


def test_planner_meets_targets_on_fewer_replica_seconds_than_static_peak(capsys):
    day = [Phase(600, rate=1, prompt_tokens=2048, output_tokens=512),
           Phase(300, rate=1, prompt_tokens=2048, output_tokens=512, rate_end=6),
           Phase(600, rate=6, prompt_tokens=2048, output_tokens=512),
           Phase(300, rate=6, prompt_tokens=2048, output_tokens=512, rate_end=1),
           Phase(600, rate=1, prompt_tokens=2048, output_tokens=512)]
    planned = Simulation(day, CONFIG, seed=3).run()
    static = Simulation(day, None, prefill=planned.peak("prefill"), decode=planned.peak("decode"), seed=3).run()
    rows = [("planner", planned), (f"static {planned.peak('prefill')}P+{planned.peak('decode')}D", static)]
    with capsys.disabled():
        print(f"\n[planner sim, 40 min ramp to 6x] targets: TTFT p90 <= {TTFT_TARGET}s, ITL p90 <= {ITL_TARGET}s")
        print(f"{'':>14} {'TTFT p90':>9} {'ITL p90':>8} {'prefill rs':>11} {'decode rs':>10} {'total rs':>9}")
        for name, r in rows:
            rs = r.replica_seconds
            print(f"{name:>14} {r.p90_ttft():9.3f} {r.p90_itl():8.4f} {rs['prefill']:11.0f} {rs['decode']:10.0f} "
                  f"{rs['prefill'] + rs['decode']:9.0f}")
        ratio = sum(planned.replica_seconds.values()) / sum(static.replica_seconds.values())
        print(f"planner / static replica-seconds: {ratio:.2f}")
    assert planned.peak("prefill") >= 2 and planned.peak("decode") >= 2
    assert planned.p90_ttft() <= TTFT_TARGET and planned.p90_itl() <= ITL_TARGET
    assert static.p90_ttft() <= TTFT_TARGET and static.p90_itl() <= ITL_TARGET
    assert ratio < 0.8
    assert planned.replicas["prefill"][-1][1] == 1 and planned.replicas["decode"][-1][1] == 1  # back down
