"""bench/sim_cluster.py --quick: every cell, its best P:D split and the headline ratio, consistent with `pdserve plan`."""
from __future__ import annotations

import json
import re

import pytest

from bench import sim_cluster
from services.planner import workload as workloads
from services.planner.plan import evaluate, parse_fleet, resolve_slo
from services.planner.profile_data import LLAMA3_8B, roofline_profile


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim-cluster") / "cells.json"
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert sim_cluster.main(["--quick", "--jobs", "2", "--out", str(out)]) == 0
    return buf.getvalue(), json.loads(out.read_text())


def test_every_shape_and_slo_has_a_row_and_the_headline_is_the_worst_10_to_1_tight_ratio(quick_run):
    text, rows = quick_run
    assert sorted((r["shape"], r["slo"]) for r in rows) == sorted(
        (shape, slo) for shape in sim_cluster.SHAPES for slo in sim_cluster.SLOS)
    for r in rows:
        line = next(ln for ln in text.splitlines() if ln.startswith(f"{r['gpu']:<6}{r['shape']} ")
                    and f" {r['slo']} " in ln)
        assert f"{r['pd_fleet']}" in line
        assert ("n/d  (search limit: " in line) if r["at_search_limit"] else (f"{r['ratio']:.2f}" in line)
    m = re.search(r"^sim_pd_vs_colocated_goodput_per_gpu=([\d.]+)", text, re.M)
    assert m, text
    worst = min(r["ratio"] for r in rows if (r["shape"], r["slo"]) == ("10:1", "tight") and not r["at_search_limit"])
    assert float(m.group(1)) == pytest.approx(worst, abs=1e-3)


def test_each_cell_is_consistent(quick_run):
    _, rows = quick_run
    for r in rows:
        # A capacity at the search limit is flagged, never passed off as a steady state.
        assert set(r["at_search_limit"]) <= {r["pd_fleet"], f"{r['instances']}C"}
        p, d = (int(x) for x in re.fullmatch(r"(\d+)P\+(\d+)D", r["pd_fleet"]).groups())
        assert p + d == r["instances"] and p >= 1 and d >= 1
        assert r["pd_per_gpu"] == max(r["splits"].values()) > 0 and r["colocated_per_gpu"] > 0
        assert r["ratio"] == pytest.approx(r["pd_per_gpu"] / r["colocated_per_gpu"])
        assert r["slos_ms"]["ttft"] == {"loose": 2000, "tight": 500}[r["slo"]]


def test_a_tighter_slo_never_shows_more_goodput(quick_run):
    _, rows = quick_run
    by = {(r["shape"], r["slo"]): r for r in rows}
    for shape in sim_cluster.SHAPES:
        loose, tight = by[shape, "loose"], by[shape, "tight"]
        assert tight["slos_ms"]["tpot"] < loose["slos_ms"]["tpot"]
        assert tight["colocated_per_gpu"] <= loose["colocated_per_gpu"] * (1 + 1e-9)
        assert tight["pd_per_gpu"] <= loose["pd_per_gpu"] * (1 + 1e-9)


def test_the_10_to_1_tight_cell_matches_pdserve_plan_run_independently(quick_run):
    """The reference: `pdserve plan`'s own evaluate() on the same profile, workload and SLO."""
    _, rows = quick_run
    r = next(r for r in rows if (r["shape"], r["slo"]) == ("10:1", "tight"))
    profile = roofline_profile(r["gpu"], LLAMA3_8B)
    wl = workloads.poisson(sim_cluster.rate_guess(profile, r["isl"], r["osl"], r["instances"]), r["num_requests"],
                           f"fixed:{r['isl']}", f"fixed:{r['osl']}", seed=sim_cluster.SEED)
    slos = resolve_slo(sim_cluster.SLOS["tight"], profile, wl)
    assert 1000 * slos["tpot"] == pytest.approx(r["slos_ms"]["tpot"])
    for name, per_gpu in ((r["pd_fleet"], r["pd_per_gpu"]), (f"{r['instances']}C", r["colocated_per_gpu"])):
        ref = evaluate(profile, parse_fleet(name, r["transport"]), wl, slos, r["attainment"])
        assert ref.capacity_per_unit == pytest.approx(per_gpu)
