"""bench/routing_bench.py's workloads: what each configuration is sent, before and during its run."""
from __future__ import annotations

import pytest

from bench.routing_bench import (decision_counts, main, mixed_workload, pd_verdict, rung_seed, split_slos,
                                 tenant_warm_up, tenants_workload)
from services.router.metrics import RouterMetrics
from bench.workloads import relabel


def test_warm_up_sends_each_tenants_prefix_once_with_a_fresh_question():
    reqs = relabel(tenants_workload(5, 4, prefix_len=32, question_len=8, output_len=16, seed=10), 11, 4000)
    warm = tenant_warm_up(reqs, prefix_len=32, seed=30)
    first_seen = []
    for r in reqs:
        if r.prompt[:32] not in first_seen:
            first_seen.append(r.prompt[:32])
    assert [w.prompt[:32] for w in warm] == first_seen  # one per tenant, in order of first arrival
    assert all(w.prompt_len == len(w.prompt) == 40 and w.output_len == 2 for w in warm)  # 1 would end on the prefill
    measured_questions = {tuple(r.prompt[32:]) for r in reqs}
    assert not any(tuple(w.prompt[32:]) in measured_questions for w in warm)  # no measured prompt cached whole
    assert tenant_warm_up(reqs, prefix_len=32, seed=30) == warm  # the same for every run of the bench


def test_slos_absolute_and_relative_to_the_unloaded_latency():
    assert split_slos(["ttft:1000", "tpot:100"]) == ({"ttft": 1.0, "tpot": 0.1}, {})
    assert split_slos(["ttft:x2", "tpot:x1.5", "e2el:9000"]) == ({"e2el": 9.0}, {"ttft": 2.0, "tpot": 1.5})
    for bad in (["tpot:x0"], ["e2el:x2"], ["ttft:xfast"], ["ttft:"]):
        with pytest.raises(ValueError, match="bad SLO"):
            split_slos(bad)


def test_decisions_read_from_the_routers_own_exposition():
    m = RouterMetrics()
    m.pd_decisions.labels("decode_local", "short_uncached").inc(20)
    m.pd_decisions.labels("prefill_remote", "long_uncached").inc(18)
    m.pd_decisions.labels("decode_local", "prefill_queue").inc(2)
    m.requests.labels("/v1/completions", "200").inc(40)  # other counters are not decisions
    assert decision_counts(m.render().decode()) == {
        "decode_local/short_uncached": 20.0, "prefill_remote/long_uncached": 18.0, "decode_local/prefill_queue": 2.0}
    assert decision_counts(RouterMetrics().render().decode()) == {}


def test_relative_slos_are_bs_and_refused_for_a(capsys):
    with pytest.raises(SystemExit):
        main(["--parts", "a", "--goodput", "ttft:x2"])
    assert "relative ones are (b)'s, --goodput-b" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--parts", "b", "--goodput-b", "tpot:x0"])
    assert "bad SLO 'tpot:x0'" in capsys.readouterr().err


def test_b_compares_capacities_and_says_when_one_is_only_a_lower_bound():
    results = {"always": {"capacity": 1.25, "bounded": True}, "never": {"capacity": 1.0, "bounded": True},
               "conditional": {"capacity": 1.5625, "bounded": True}}
    line = pd_verdict(results)
    assert line.startswith("pd_conditional_vs_best_goodput_ratio=1.250  (target >= 1.1; capacities: conditional "
                           "1.562, best other always 1.250 req/s)")
    results["conditional"]["bounded"] = False
    assert "conditional's capacity is only a lower bound" in pd_verdict(results)
    # At one rate (--rate-b): requests in SLO per second there.
    at_rate = {k: {"request_goodput": g} for k, g in (("always", 0.9), ("never", 0.8), ("conditional", 0.99))}
    assert pd_verdict(at_rate).startswith("pd_conditional_vs_best_goodput_ratio=1.100")


def test_every_rung_draws_fresh_prompts_of_bs_mix():
    # Rungs, bisections included, never share a prompt (no prefix-cache hits between rungs).
    ks = [0, 1, 2, 1.5, 1.75, -1, -0.5, 3]
    assert len({rung_seed(k) for k in ks}) == len(ks)
    rungs = [mixed_workload(40, rung_seed(k)) for k in (0, 0.5)]
    assert {tuple(r.prompt[:16]) for r in rungs[0]}.isdisjoint({tuple(r.prompt[:16]) for r in rungs[1]})
    assert sorted(len(r.prompt) <= 64 for r in rungs[0]) == [False] * 20 + [True] * 20
    assert all(1024 <= len(r.prompt) <= 2048 for r in rungs[0] if len(r.prompt) > 64)


def test_bad_capacity_search_flags_are_refused(capsys):
    for bad in (["--b-rung-factor", "1"], ["--attainment", "0"], ["--b-refine", "-1"], ["--rate-b", "0"]):
        with pytest.raises(SystemExit):
            main(["--parts", "b", *bad])
        assert "--b-rung-factor > 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--parts", "b", "--goodput-b"])  # no SLO: nothing for goodput to count
    assert "give at least one" in capsys.readouterr().err


def test_the_figure_has_a_panel_for_each_part_run(tmp_path):
    from PIL import Image

    from bench.routing_bench import plot

    run = {"ttfts": [0.1, 0.2, 0.4]}
    widths = {}
    for parts, results in (("b", {"always": run, "never": run, "conditional": run}),
                           ("ab", {"least_load": run, "kv_aware": run, "always": run, "conditional": run})):
        out = tmp_path / parts
        out.mkdir()
        with Image.open(plot(results, str(out))) as image:
            widths[parts] = image.width
    assert widths["ab"] == 2 * widths["b"]  # no empty panel for a part not run
