"""bench/sim_validate.py simulates exactly the requests bench-pd sends (lengths and arrivals)."""
from __future__ import annotations

import pytest

from bench.sim_validate import (ARRIVAL_SEED, compare, corrected, drift, per_request, probe_correction,
                                 probe_requests, sim_requests)
from bench.workloads import poisson_arrivals, synthetic


def test_simulated_requests_are_bench_pds():
    reqs = synthetic(12, "uniform:1024:2048", "uniform:64:128", vocab_size=4000, seed=3)  # bench-pd: seed i + 1
    sim = sim_requests(reqs, 0.3)
    assert [s.arrival for s in sim] == poisson_arrivals(12, 0.3, ARRIVAL_SEED) and ARRIVAL_SEED == 1
    assert [(s.isl, s.osl) for s in sim] == [(r.prompt_len, r.output_len) for r in reqs]


def test_compare_prints_signed_relative_errors(capsys):
    keys = ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms", "p90_tpot_ms")
    errors = compare("colocated", 0.3, dict(zip(keys, (1000, 2000, 20, 40))), dict(zip(keys, (1100, 1800, 20, 50))))
    assert errors == pytest.approx([0.1, -0.1, 0.0, 0.25])
    assert "TTFT p50     1100 /     1000 ms (  +10%)" in capsys.readouterr().out


def test_per_request_lines_name_the_instance_and_the_ttft_error(capsys):
    from services.planner.simulator import RequestTrace, SimRequest
    a = RequestTrace(SimRequest(0.0, 1500, 80), [1.2, 1.21], decode_instance="colocated1")
    b = RequestTrace(SimRequest(2.5, 1200, 64), [4.0], prefill_instance="prefill0", decode_instance="decode0")
    per_request({"ttfts": [1.5, 1.5]}, [a, b])
    out = capsys.readouterr().out.splitlines()
    assert "request   0 at     0.0 s   1500 in   80 out  colocated1" in out[0]
    assert out[0].endswith("TTFT    1200 /    1500 ms (  -20%)")
    assert "prefill0+decode0" in out[1] and out[1].endswith("TTFT    1500 /    1500 ms (   +0%)")


def test_drift_is_the_largest_move_of_the_lone_probe():
    moved, line = drift(30.0, 29.0, 21.0)  # the machine sped up between the two probes
    assert moved == pytest.approx(21 / 30 - 1)
    assert "30.0 ms predicted, 29.0 measured before the rates, 21.0 after (drift -30%)" in line
    assert drift(30.0, 29.0, 29.5)[0] == pytest.approx(29 / 30 - 1)
    assert drift(20.0, 26.0, 25.0)[0] == pytest.approx(0.3)  # slower than when profiled
    assert drift(20.0, 20.0, 20.0)[0] == 0.0


def test_the_probe_corrects_ttft_and_tpot_apart_as_the_sla_planner_does():
    predicted_probe = {"p50_ttft_ms": 800.0, "p50_tpot_ms": 16.0}
    measured_probe = {"p50_ttft_ms": 840.0, "p50_tpot_ms": 12.0}  # prefill as profiled, decode 25% faster
    factors = probe_correction(predicted_probe, measured_probe)
    assert factors == pytest.approx((1.05, 0.75))
    keys = ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms", "p90_tpot_ms")
    cell = dict(zip(keys, (1500.0, 3000.0, 16.0, 20.0)))
    assert corrected(cell, factors) == pytest.approx(dict(zip(keys, (1575.0, 3150.0, 12.0, 15.0))))
    assert cell["p50_tpot_ms"] == 16.0  # the raw prediction is left as it was
    # The planner's limits hold: a probe 20x faster than predicted says another deployment.
    assert probe_correction(predicted_probe, {"p50_ttft_ms": 42.0, "p50_tpot_ms": 16.0}) == (0.5, 1.0)


def test_each_probe_is_a_fresh_prompt_so_its_ttft_measures_a_prefill():
    probes = probe_requests()
    assert len(probes) == 3 and all(len(p) == 1 for p in probes)
    assert {(p[0].prompt_len, p[0].output_len) for p in probes} == {(1024, 64)}
    first_blocks = {tuple(p[0].prompt[:16]) for p in probes}  # the prefix cache matches whole 16-token blocks
    assert len(first_blocks) == 3
