"""bench/routing_bench.py's workloads: what each configuration is sent, before and during its run."""
from __future__ import annotations

import pytest

from bench.routing_bench import decision_counts, main, split_slos, tenant_warm_up, tenants_workload
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
