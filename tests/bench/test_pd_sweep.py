"""bench/pd_sweep.py --quick: one small cell served for real by 1P+1D and 2C, planned from a given profile."""
from __future__ import annotations

import re

from bench import pd_sweep
from tests.planner.sim_profiles import CPU_LIKE, profile


def test_quick_sweep_prints_each_config_the_plans_verdict_and_the_vllm_ratio(tmp_path, capsys):
    prof = tmp_path / "profile.json"
    profile(CPU_LIKE).save(str(prof))
    assert pd_sweep.main(["--quick", "--profile", str(prof), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    m = re.search(r"^cell 1:1 loose: rate ([\d.]+) req/s; simulated capacity disaggregated ([\d.]+), "
                  r"colocated ([\d.]+); plan: (\w+)$", out, re.M)
    assert m, out
    rate, pd_cap, colo_cap, planned = float(m[1]), float(m[2]), float(m[3]), m[4]
    assert rate == round(0.8 * max(pd_cap, colo_cap), 3) or abs(rate - 0.8 * max(pd_cap, colo_cap)) < 2e-3
    assert planned == ("disaggregated" if pd_cap > colo_cap else "colocated")
    rows = {r[1]: r for r in re.findall(r"^\s+[\d.]+ ([* ])(disaggregated|colocated)\s+(\d+)%\s+([\d.]+)\s+"
                                        r"([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", out, re.M)}
    assert set(rows) == {"disaggregated", "colocated"}
    assert rows[planned][0] == "*"
    for mark, _, attain, goodput, *_ in rows.values():
        assert 0 <= int(attain) <= 100 and float(goodput) >= 0
    assert re.search(r"plan's choice \w+: (measured winner or within noise|LOST)", out)
    assert "vllm: not run (--quick)" in out
    assert re.search(r"^plan_choice_won_cells=[01]/1$", out, re.M)
    assert re.search(r"^planned_vs_vllm_goodput_min_ratio=nan  \(vLLM not run\)", out, re.M)


def test_capacity_rungs_draw_fresh_requests_shared_by_every_config():
    cell = pd_sweep.Cell("1:1", "loose", [], {"ttft": 4, "tpot": 0.1}, 2.0, "colocated", {},
                         ("uniform:48:80", "uniform:16:24"), 100)
    a, b = pd_sweep.rung_requests(cell, 1, 5), pd_sweep.rung_requests(cell, 1, 5)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert {tuple(r.prompt) for r in a}.isdisjoint({tuple(r.prompt) for r in pd_sweep.rung_requests(cell, 2, 5)})
    assert all(48 <= len(r.prompt) <= 80 for r in a)


def test_quick_capacity_sweep_measures_each_configs_capacity(tmp_path, capsys):
    prof = tmp_path / "profile.json"
    profile(CPU_LIKE).save(str(prof))
    assert pd_sweep.main(["--quick", "--capacity", "--profile", str(prof), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    rows = {name: float(cap) for name, cap in
            re.findall(r"^\s+[* ](disaggregated|colocated)\s+(?:>=)?([\d.]+)\s+[\d.]+\s", out, re.M)}
    assert set(rows) == {"disaggregated", "colocated"}, out
    # The tiny model serves 4 short requests well inside the loose SLO at the cell's rate.
    assert all(cap > 0 for cap in rows.values()), out
    assert re.search(r"rung \+0 [\d.]+ req/s x 4: \d+% in SLO", out)
    assert re.search(r"^plan_choice_won_capacity_cells=[01]/1$", out, re.M)
    assert re.search(r"^planned_vs_vllm_capacity_min_ratio=nan  \(vLLM not run\)", out, re.M)
