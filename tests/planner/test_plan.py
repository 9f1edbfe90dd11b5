"""`pdserve plan`: fleets enumerated, capacity searched, and the choice the issue's story predicts."""
from __future__ import annotations

import json

import pytest

from services.cli import main as pdserve
from services.planner.plan import (LIVES, MAX_REQUESTS, MIN_REQUESTS, attainment, capacity, fleets_of, plan, plan_widths,
                                   search_workload, window_seconds)
from services.planner.sim_metrics import parse_slo
from services.planner.simulator import Fleet
from services.planner.workload import poisson
from services.planner.costmodel import StepCost
from sim_profiles import CPU_LIKE, profile

# bench-pd's shape: 1-2k-token prompts, 64-128-token outputs, 0.3 req/s.
BENCH_PD = poisson(0.3, 80, "uniform:1024:2048", "uniform:64:128", seed=1)


def test_fleets_of_n():
    assert [f.name for f in fleets_of(3)] == ["1P+2D", "2P+1D", "3C"]
    assert [f.name for f in fleets_of(1)] == ["1C"]
    with pytest.raises(ValueError, match="at least one"):
        fleets_of(0)


def test_capacity_is_the_edge_of_the_attainment_target():
    prof, fleet, slos = profile(CPU_LIKE), Fleet(num_prefill=1, num_decode=1), parse_slo("ttft:4000,tpot:100")
    cap = capacity(prof, fleet, BENCH_PD, slos, 0.9)
    assert 0.3 < cap < 3
    at = lambda rate: attainment(prof, fleet, search_workload(BENCH_PD, rate / BENCH_PD.rate, slos), slos)  # noqa: E731
    assert at(cap) >= 0.9
    assert at(cap * 1.1) < 0.9


def test_each_rate_is_simulated_over_request_lives_not_one_burst():
    # A fast instance and a loose SLO on short prompts with long outputs (ISL:OSL 1:10): 300
    # requests arriving at once fit its seats and all meet the SLO at any rate (seen on this
    # VM's profile: "capacity" 1,990 req/s for two one-core instances). Sustained, it holds ~17.
    prof = profile(StepCost(base=0.003, per_token=2.5e-4, per_attn=2e-7, per_kv_token=5e-7, per_seq=0.0))
    slos, fleet = parse_slo("ttft:4000,tpot:100"), Fleet(num_colocated=2)
    wl = poisson(1.0, 60, "uniform:24:40", "uniform:240:400", seed=1)
    life = 4.0 + wl.mean_osl * 0.1
    assert window_seconds(wl, slos) == pytest.approx(LIVES * life)
    cap = capacity(prof, fleet, wl, slos, 0.9)
    assert 10 < cap < 30
    burst = wl.scaled(4 * cap / wl.rate, MIN_REQUESTS)
    assert len(burst.requests) == 300 and attainment(prof, fleet, burst, slos) >= 0.9  # absorbed
    sustained = search_workload(wl, 4 * cap / wl.rate, slos)
    span = sustained.requests[-1].arrival - sustained.requests[0].arrival
    assert span >= window_seconds(wl, slos) * 0.95 and attainment(prof, fleet, sustained, slos) < 0.1
    # The window is capped (a big fleet at thousands of req/s), never below MIN_REQUESTS.
    assert len(search_workload(wl, 10_000, slos).requests) <= MAX_REQUESTS
    assert len(search_workload(wl, 1e-3, {"ttft": 1e-3}).requests) >= MIN_REQUESTS


def test_loose_slo_picks_colocated_tight_tpot_picks_disaggregation():
    prof = profile(CPU_LIKE)
    # Loose: halving prefill capacity costs more than isolation earns (what bench-pd measured).
    results, best = plan(prof, BENCH_PD, parse_slo("ttft:4000,tpot:100"), [2], "tcp")
    assert [r.fleet.name for r in results] == ["1P+1D", "2C"]
    assert best.fleet.name == "2C"
    # Tight TPOT (under 2x an unloaded decode step): colocated decodes stall behind prompts.
    results, best = plan(prof, BENCH_PD, parse_slo("ttft:4000,tpot:30"), [2], "tcp")
    assert best.fleet.name == "1P+1D"
    by_name = {r.fleet.name: r for r in results}
    assert by_name["2C"].at_rate["max_itl_ms"] > 5 * by_name["1P+1D"].at_rate["max_itl_ms"]


def test_pdserve_plan_prints_the_table_and_the_winner(tmp_path, capsys):
    prof_path, wl_path = tmp_path / "profile.json", tmp_path / "workload.json"
    profile(CPU_LIKE).save(str(prof_path))
    wl_path.write_text(json.dumps({"rate": 0.3, "num_requests": 80, "isl": "uniform:1024:2048",
                                   "osl": "uniform:64:128", "seed": 1}))
    rc = pdserve(["plan", "--profile", str(prof_path), "--workload", str(wl_path), "--slo", "ttft:4000,tpot:30",
                  "--instances", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "1P+1D" in out and "2C" in out
    assert out.strip().splitlines()[-1].startswith("best: 1P+1D")
    rc = pdserve(["plan", "--profile", str(prof_path), "--workload", str(wl_path), "--slo", "ttft:4000,e2e:9"])
    assert rc == 2
    assert "bad SLO 'e2e:9'" in capsys.readouterr().err
    rc = pdserve(["plan", "--profile", str(prof_path), "--workload", str(wl_path), "--slo", "ttft:1",
                  "--instances", "0"])
    assert rc == 2


def test_large_fleets_search_the_best_split_instead_of_trying_all():
    prof = profile(CPU_LIKE)
    w = poisson(1.0, 60, "uniform:1024:2048", "uniform:64:128", seed=2)
    slos = parse_slo("ttft:4000,tpot:30")
    everything, best_all = plan(prof, w, slos, [10], "tcp", exhaustive_up_to=10)
    searched, best = plan(prof, w, slos, [10], "tcp", exhaustive_up_to=0)
    assert len(everything) == 10 and len(searched) < 10
    assert searched[-1].fleet.name == "10C"
    assert best.fleet == best_all.fleet


def test_tight_tpot_relative_to_the_unloaded_step():
    from services.planner.plan import resolve_slo

    prof = profile(CPU_LIKE)
    slos = resolve_slo("ttft:4000,tpot:x1.5", prof, BENCH_PD)
    context = round(BENCH_PD.mean_isl + BENCH_PD.mean_osl / 2)
    assert slos == {"ttft": 4.0, "tpot": pytest.approx(1.5 * CPU_LIKE.decode_seconds(1, context))}
    assert resolve_slo("tpot:20", prof, BENCH_PD) == {"tpot": 0.02}
    for bad in ("tpot:x", "tpot:x-1", "tpot:xabc"):
        with pytest.raises(ValueError, match="factor F > 0"):
            resolve_slo(bad, prof, BENCH_PD)


def test_a_workload_without_a_rate_is_refused():
    from services.planner.workload import from_trace

    with pytest.raises(ValueError, match="arriving at different times"):
        plan(profile(CPU_LIKE), from_trace([[0, 100, 10], [0, 200, 10]]), parse_slo("ttft:1000"), [2], "tcp")


def test_pdserve_simulate_one_fleet(tmp_path, capsys):
    from services.planner.plan import parse_fleet

    assert parse_fleet("1p+3d") == Fleet(num_prefill=1, num_decode=3)
    assert parse_fleet("4C") == Fleet(num_colocated=4)
    for bad in ("3", "1P", "P+D", "1P+0D", "0C"):
        with pytest.raises(ValueError):
            parse_fleet(bad)
    prof_path, wl_path = tmp_path / "profile.json", tmp_path / "workload.json"
    profile(CPU_LIKE).save(str(prof_path))
    wl_path.write_text(json.dumps({"trace": [[0, 1000, 20], [0.5, 1500, 30]]}))
    args = ["simulate", "--profile", str(prof_path), "--workload", str(wl_path), "--fleet", "2C"]
    assert pdserve(args + ["--slo", "ttft:5000,tpot:x1.5"]) == 0
    out = capsys.readouterr().out
    assert "2C on" in out and "goodput req/s (in SLO)" in out and "longest inter-token gap ms" in out
    assert pdserve(args + ["--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["fleet"] == "2C" and s["completed"] == 2
    assert pdserve(args[:-1] + ["1P+1D+1D"]) == 2


# The same machine two threads wide: prompts nearly twice as fast, decode steps a little faster
# (memory-bound), as bench-pd's model measured one and two threads here.
CPU_WIDE = StepCost(base=0.010, per_token=2.2e-4, per_attn=1.1e-7, per_kv_token=1.2e-6, per_seq=4e-4)


def cpu(step: StepCost, threads: int):
    return profile(step, machine={"device": "cpu", "threads": threads})


def test_profile_width_is_its_threads_on_a_cpu():
    assert cpu(CPU_LIKE, 2).width == 2 and cpu(CPU_LIKE, 1).width == 1
    assert profile(CPU_LIKE).width == 1  # no machine recorded (a GPU roofline): one unit an instance
    assert profile(CPU_LIKE, machine={"device": "cuda:0", "threads": 16}).width == 1


def test_plan_widths_counts_units_and_picks_per_unit():
    narrow, wide = cpu(CPU_LIKE, 1), cpu(CPU_WIDE, 2)
    slos = parse_slo("ttft:4000,tpot:30")
    results, best = plan_widths([narrow, wide], BENCH_PD, slos, [2], "tcp")
    assert [r.name for r in results] == ["1P+1D", "2C", "1Cx2"]
    by_name = {r.name: r for r in results}
    wide_one = by_name["1Cx2"]
    assert wide_one.units == 2 and wide_one.capacity_per_unit == pytest.approx(wide_one.capacity_rps / 2)
    # The same numbers as planning the wide profile alone at one instance.
    alone, _ = plan(wide, BENCH_PD, slos, [1], "tcp")
    assert wide_one.capacity_rps == pytest.approx(alone[0].capacity_rps)
    assert best is max(results, key=lambda r: (r.capacity_per_unit, r.at_rate["slo_attainment"]))
    # 3 units: no 2-wide fleet fits exactly; 1 unit: only the narrow instance.
    assert {r.width for r in plan_widths([narrow, wide], BENCH_PD, slos, [3], "tcp")[0]} == {1}
    with pytest.raises(ValueError, match="no profile's instance width"):
        plan_widths([wide], BENCH_PD, slos, [1], "tcp")


def test_pdserve_plan_takes_profiles_of_several_widths(tmp_path, capsys):
    paths = [tmp_path / "p1.json", tmp_path / "p2.json", tmp_path / "workload.json"]
    cpu(CPU_LIKE, 1).save(str(paths[0]))
    cpu(CPU_WIDE, 2).save(str(paths[1]))
    paths[2].write_text(json.dumps({"rate": 0.3, "num_requests": 80, "isl": "uniform:1024:2048",
                                    "osl": "uniform:64:128", "seed": 1}))
    rc = pdserve(["plan", "--profile", str(paths[0]), "--profile", str(paths[1]), "--workload", str(paths[2]),
                  "--slo", "ttft:4000,tpot:30", "--instances", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in ("1P+1D", "2C", "1Cx2")]
    assert rows == ["1P+1D", "2C", "1Cx2"]
    assert "per unit" in out and out.strip().splitlines()[-1].startswith("best: ")
