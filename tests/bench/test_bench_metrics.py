"""Load-generator arithmetic on synthetic timestamps, seeded workloads, the result schema."""
from __future__ import annotations

import json

import pytest

from bench.metrics import RequestResult, parse_slos, summarize
from bench.workloads import parse_dist, poisson_arrivals, relabel, shared_prefix, synthetic


def test_ttft_tpot_itl_and_percentiles():
    # Two requests: tokens at known times (seconds after send).
    a = RequestResult(prompt_len=10, output_len=5, ttft=0.1, itl=[0.02, 0.02, 0.02, 0.04], latency=0.2, success=True)
    b = RequestResult(prompt_len=20, output_len=3, ttft=0.3, itl=[0.05, 0.05], latency=0.4, success=True)
    assert a.tpot == pytest.approx((0.2 - 0.1) / 4)
    assert b.tpot == pytest.approx((0.4 - 0.3) / 2)
    s = summarize([a, b], duration=2.0)
    assert s["completed"] == 2 and s["total_input_tokens"] == 30 and s["total_output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_itl_ms"] == pytest.approx(1000 * (0.1 + 0.1) / 6)
    assert s["p99_itl_ms"] == pytest.approx(1000 * 0.0499, rel=0.01)
    assert s["mean_tpot_ms"] == pytest.approx(1000 * (0.025 + 0.05) / 2)


def test_single_token_requests_have_no_tpot():
    r = RequestResult(prompt_len=4, output_len=1, ttft=0.1, latency=0.1, success=True)
    assert r.tpot is None
    assert summarize([r], 1.0)["mean_tpot_ms"] == 0.0


def test_goodput_counts_requests_meeting_every_slo():
    fast = RequestResult(prompt_len=1, output_len=11, ttft=0.2, latency=0.7, success=True)  # tpot 50 ms
    slow_first = RequestResult(prompt_len=1, output_len=11, ttft=0.9, latency=1.2, success=True)
    slow_tokens = RequestResult(prompt_len=1, output_len=11, ttft=0.2, latency=1.2, success=True)  # tpot 100
    failed = RequestResult(prompt_len=1, error="HTTP 500")
    slos = parse_slos(["ttft:500", "tpot:60"])
    s = summarize([fast, slow_first, slow_tokens, failed], duration=4.0, slos=slos)
    assert s["request_goodput"] == pytest.approx(0.25)
    assert s["slo_attainment"] == pytest.approx(0.25)
    assert s["failed"] == 1
    with pytest.raises(ValueError):
        parse_slos(["latency:5"])


def test_workloads_are_seeded_and_follow_their_distributions():
    a = synthetic(50, "uniform:32:64", "fixed:7", seed=3)
    assert a == synthetic(50, "uniform:32:64", "fixed:7", seed=3)
    assert a != synthetic(50, "uniform:32:64", "fixed:7", seed=4)
    assert all(32 <= r.prompt_len <= 64 and len(r.prompt) == r.prompt_len and r.output_len == 7 for r in a)
    groups = shared_prefix(3, 4, 100, "fixed:5", "fixed:2", seed=1)
    assert len(groups) == 12 and len({tuple(r.prompt[:100]) for r in groups}) == 3
    with pytest.raises(ValueError):
        parse_dist("gaussian:1")
    # Relabelled: the same lengths, order and prefix groups, no prompt (or prefix block) in common.
    other = relabel(groups, seed=7)
    assert [(r.prompt_len, r.output_len) for r in other] == [(r.prompt_len, r.output_len) for r in groups]
    same = lambda reqs: [[a.prompt[:100] == b.prompt[:100] for b in reqs] for a in reqs]  # noqa: E731
    assert same(other) == same(groups)
    assert all(x.prompt[:16] != y.prompt[:16] for x in other for y in groups)
    assert relabel(groups, seed=7) == other and relabel(groups, seed=8) != other
    offsets = poisson_arrivals(2000, rate=10.0, seed=0)
    assert offsets == poisson_arrivals(2000, rate=10.0, seed=0)
    assert offsets[-1] / len(offsets) == pytest.approx(0.1, rel=0.1)


def test_result_json_has_vllm_compatible_fields():
    r = RequestResult(prompt_len=3, output_len=2, ttft=0.1, itl=[0.01], latency=0.11, success=True)
    s = json.loads(json.dumps(summarize([r], 1.0, parse_slos(["ttft:200"]))))
    for key in ("duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms", "input_lens",
                "output_lens", "ttfts", "itls", "errors"):
        assert key in s, key


def test_a_chunk_with_a_held_back_token_times_the_first_token():
    from bench.serve import carries_tokens
    # A token whose text is not out yet (one byte of a UTF-8 character) streams with empty text:
    # it is the first token all the same, as vLLM's benchmark times it.
    assert carries_tokens({"index": 0, "text": "", "finish_reason": None})
    assert carries_tokens({"index": 0, "text": "\u00e9t\u00e9", "finish_reason": None})
    assert carries_tokens({"index": 0, "text": "end", "finish_reason": "length"})
    # A closing chunk that only says why it ended, and a chat role chunk, bring no token.
    assert not carries_tokens({"index": 0, "text": "", "finish_reason": "stop"})
    assert not carries_tokens({"index": 0, "delta": {"role": "assistant"}})
