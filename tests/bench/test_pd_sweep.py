"""bench/pd_sweep.py --quick: one small cell served for real by 1P+1D and 2C, planned from a given profile."""
from __future__ import annotations

import argparse
import dataclasses
import json
import re

import pytest

from bench import pd_sweep
from bench.capacity import Ladder
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
    assert_probed(out, tmp_path / "out", {"disaggregated", "colocated"})


def assert_probed(out: str, out_dir, configs: set[str]) -> None:
    """Each configuration's lone request before and after its cells, against its profile's prediction."""
    lines = dict(re.findall(r"^  (disaggregated|colocated)\s+(predicted TTFT \d+ ms, TPOT [\d.]+ ms; measured "
                            r"[+-]\d+%: before its cells TTFT \d+ ms, TPOT [\d.]+ ms; after its cells .*)$", out, re.M))
    assert set(lines) == configs, out
    drift = re.search(r"^profile_drift=([\d.]+) ", out, re.M)
    assert drift and re.search(r"^machine_drift=[\d.]+ ", out, re.M), out
    # profile_drift is the largest move the probe lines print, and the warning comes exactly past 20%
    # (the test's profile is a synthetic CPU's: how far it is from this machine is the machine's).
    moves = [abs(int(m)) for m in re.findall(r"; measured ([+-]\d+)%: before its cells", out)]
    assert len(moves) == len(configs) and abs(max(moves) / 100 - float(drift[1])) <= 0.006, out
    assert (float(drift[1]) > 0.2) == ("profile again (omit --profile)" in out)
    saved = json.loads((out_dir / "probes.json").read_text())
    assert set(saved) == configs
    for p in saved.values():
        assert p["before"]["p50_ttft_ms"] > 0 and p["after"]["p50_tpot_ms"] > 0 and p["predicted"]["p50_ttft_ms"] > 0


def test_capacity_rungs_draw_fresh_requests_shared_by_every_config():
    cell = pd_sweep.Cell("1:1", "loose", [], {"ttft": 4, "tpot": 0.1}, 2.0, "colocated", {},
                         ("uniform:48:80", "uniform:16:24"), 100)
    a, b = pd_sweep.rung_requests(cell, 1, 5), pd_sweep.rung_requests(cell, 1, 5)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert {tuple(r.prompt) for r in a}.isdisjoint({tuple(r.prompt) for r in pd_sweep.rung_requests(cell, 2, 5)})
    assert all(48 <= len(r.prompt) <= 80 for r in a)
    # --refine's rungs between two (k + 1/2, k + 1/4) draw fresh prompts of their own.
    seeds = [pd_sweep.rung_seed(cell, k) for k in (-2, -1, 0, 1, 2, 1.5, 1.25, 1.75, -1.5, 0.5)]
    assert seeds[:5] == [100_498, 100_499, 100_500, 100_501, 100_502] and len(set(seeds)) == len(seeds)
    assert all(isinstance(x, int) for x in seeds)
    refined = pd_sweep.rung_requests(cell, 1.5, 5)
    assert {tuple(r.prompt) for r in refined}.isdisjoint({tuple(r.prompt) for r in a})


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
    # Both stacks up at once, their rungs in turn: each configuration's rung 0 before either's next.
    turns = re.findall(r"^  (disaggregated|colocated)\s+rung ([+-][\d.]+) ", out, re.M)
    assert {turns[0][0], turns[1][0]} == {"disaggregated", "colocated"} and turns[0][1] == turns[1][1] == "+0", out
    assert re.search(r"^plan_choice_won_capacity_cells=[01]/1$", out, re.M)
    assert re.search(r"^planned_vs_vllm_capacity_min_ratio=nan  \(vLLM not run\)", out, re.M)
    assert_probed(out, tmp_path / "out", {"disaggregated", "colocated"})
    # The machine read before each round, on the one-thread colocated stack, and its largest move.
    assert re.search(r"^  round 0: one request alone on colocated: TTFT \d+ ms, TPOT [\d.]+ ms \(\+0% from round 0\)$",
                     out, re.M), out
    assert re.search(r"^ +the machine, round by round \(one request alone on colocated\): \+0%", out, re.M), out
    assert re.search(r"^machine_drift_during_search=\d+\.\d{3}  ", out, re.M), out
    gauge = json.loads((tmp_path / "out" / "gauge.json").read_text())
    assert gauge["0"]["config"] == "colocated" and len(gauge["0"]["readings"]) >= 1


def test_probe_says_how_far_the_machine_is_from_the_profile_and_how_far_it_moved():
    def s(ttft, tpot):
        return {"p50_ttft_ms": ttft, "p50_tpot_ms": tpot}

    p = pd_sweep.Probe(before=s(1200, 20.0), after=s(1200, 15.0), predicted=s(1000, 20.0))
    assert p.profile_error() == pytest.approx(0.2)  # TTFT's +20% outweighs TPOT's 0
    assert p.moved() == pytest.approx(-0.25)  # the larger move keeps its sign
    assert pd_sweep.Probe(before=s(1200, 20.0)).profile_error() == 0.0  # vLLM: nothing predicted
    assert pd_sweep.Probe(before=s(1200, 20.0)).moved() == 0.0  # its cells failed before the second probe


def test_the_probe_is_predicted_on_the_profile_of_the_configurations_width():
    one = profile(CPU_LIKE, machine={"device": "cpu", "threads": 1})
    two = profile(dataclasses.replace(CPU_LIKE, base=CPU_LIKE.base / 2), machine={"device": "cpu", "threads": 2})
    probe = pd_sweep.probe_requests(pd_sweep.PROBE)[1]
    assert pd_sweep.predict_probe([one, two], "vllm", probe) is None
    assert pd_sweep.predict_probe([one], "colocated-wide", probe) is None  # no two-thread profile
    narrow = pd_sweep.predict_probe([one, two], "colocated", probe)
    wide = pd_sweep.predict_probe([one, two], "colocated-wide", probe)
    assert wide == pd_sweep.predict_probe([two, one], "colocated-wide", probe)
    assert 0 < wide["p50_tpot_ms"] < narrow["p50_tpot_ms"]  # the two-thread profile's faster step
    disagg = pd_sweep.predict_probe([one, two], "disaggregated", probe)
    # The prefill streams the first token (the colocated TTFT on the same profile); the KV pull
    # delays the decode's first step, so the lone request's TPOT is longer.
    assert disagg["p50_ttft_ms"] == pytest.approx(narrow["p50_ttft_ms"])
    assert disagg["p50_tpot_ms"] > narrow["p50_tpot_ms"]


def test_the_gauge_reads_the_machine_before_each_round_on_fresh_prompts(monkeypatch, capsys):
    seen, tpots = [], iter([10.0, 12.5, 9.0])

    async def fake_benchmark(url, tokenizer, requests, progress=True):
        seen.append(tuple(requests[0].prompt))
        return {"p50_ttft_ms": 200.0, "p50_tpot_ms": next(tpots)}

    monkeypatch.setattr(pd_sweep, "run_benchmark", fake_benchmark)
    saved = []
    gauge = pd_sweep.Gauge("colocated", "http://x", ("fixed:32", "fixed:4"), pd_sweep.GAUGE_SEED,
                           on_reading=lambda: saved.append(len(gauge.readings)))
    for r in range(3):
        gauge(r)
    assert saved == [1, 2, 3]  # each reading handed on as it comes (the sweep saves gauge.json)
    assert len(set(seen)) == 3 and all(len(p) == 32 for p in seen)  # no prefix-cache hits
    assert gauge.moves() == pytest.approx([0.0, 0.25, -0.1])
    assert gauge.drift() == pytest.approx(0.25)
    out = capsys.readouterr().out
    assert "round 1: one request alone on colocated: TTFT 200 ms, TPOT 12.5 ms (+25% from round 0)" in out


def test_like_rate_check_serves_the_top_capacity_to_the_plans_choice_and_the_top(monkeypatch, capsys):
    """A ladder under a steady drift favours the configuration that climbs: the plan's choice and the
    top configuration serve the top's capacity rung again, the same requests at the same rate, and
    the report reads the plan's choice as level with vLLM where it held it."""
    cell = pd_sweep.Cell("1:10", "tight", [], {"ttft": 4, "tpot": 0.018}, 1.0, "colocated-wide",
                         {"colocated-wide": 1.5}, ("uniform:24:40", "uniform:240:400"), 104)
    served = []

    def fake_runner(url, c, base, factor, seconds, min_prompts, log=print):
        def run(k):
            served.append((url, round(base * factor ** k, 6), k))
            return {"slo_attainment": 0.95 if url == "wide" else 1.0}
        return run

    monkeypatch.setattr(pd_sweep, "rung_runner", fake_runner)
    args = argparse.Namespace(rung_factor=1.2, rung_seconds=60.0, rung_prompts=20)
    found = {"colocated-wide": Ladder([{"rate": 1.25, "slo_attainment": 1.0}], 1.25, True),
             "vllm": Ladder([{"rate": 1.2 * 1.2 ** 2, "slo_attainment": 1.0}], 1.2 * 1.2 ** 2, True)}
    check = pd_sweep.like_rate_check({"colocated-wide": "wide", "vllm": "v"}, cell,
                                     {"colocated-wide": 1.5, "vllm": 1.2}, found, args)
    # vLLM's own rung +2 (from its base), served by the plan's choice first, then by vLLM.
    assert served == [("wide", round(1.2 * 1.44, 6), 2.0), ("v", round(1.2 * 1.44, 6), 2.0)]
    assert check == {"top": "vllm", "rate": pytest.approx(1.728), "attainment": {"colocated-wide": 0.95, "vllm": 1.0}}
    assert pd_sweep.like_rate_check({"colocated-wide": "wide", "vllm": "v"}, cell, {"colocated-wide": 1.5, "vllm": 1.2},
                                    {**found, "colocated-wide": Ladder([{"rate": 2.0}], 2.0, True)}, args) is None
    pd_sweep.capacity_report([cell], {n: {0: lad} for n, lad in found.items()}, {}, 1.2, 0.9, None, {0: check})
    out = capsys.readouterr().out
    assert "at like rates (vllm's capacity, 1.728 req/s, the same requests back to back): colocated-wide 95% in SLO, " \
           "vllm 100%" in out
    assert re.search(r"^planned_vs_vllm_capacity_min_ratio=0\.723", out, re.M), out
    assert re.search(r"^planned_vs_vllm_capacity_min_ratio_like_rates=1\.000 ", out, re.M), out


def test_a_vllm_that_held_no_rung_bounds_the_ratio_from_below(capsys):
    """vLLM failing every rung down to its lowest: its capacity is under that rung, so the plan's
    ratio to it is at least the plan's capacity over that rate (printed as a bound, not NaN)."""
    cell = pd_sweep.Cell("10:1", "tight", [], {"ttft": 4, "tpot": 0.0178}, 0.16, "disaggregated",
                         {"disaggregated": 0.2, "colocated": 0.132}, ("uniform:1000:2000", "uniform:64:128"), 104)
    found = {"disaggregated": Ladder([{"rate": 0.2, "slo_attainment": 0.85}, {"rate": 0.167, "slo_attainment": 0.9}],
                                     0.167, True),
             "colocated": Ladder([{"rate": 0.132, "slo_attainment": 0.9}, {"rate": 0.158, "slo_attainment": 0.85}],
                                 0.132, True),
             "vllm": Ladder([{"rate": 0.16, "slo_attainment": 0.65}, {"rate": 0.054, "slo_attainment": 0.7}], 0.0, True)}
    pd_sweep.capacity_report([cell], {n: {0: lad} for n, lad in found.items()}, {}, 1.2, 0.9, None, {})
    out = capsys.readouterr().out
    assert "vLLM held no rung down to 0.054 req/s: planned/vLLM is above 3.093" in out, out
    assert re.search(r"^planned_vs_vllm_capacity_min_ratio=3\.093  \(a lower bound: vLLM held no rung in 1 cell",
                     out, re.M), out
    assert re.search(r"^plan_choice_won_capacity_cells=1/1", out, re.M), out
