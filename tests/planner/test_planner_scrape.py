"""Scraping the services' own /metrics (no Prometheus): the names match what the services
export, counters become rates and histograms quantiles as PromQL would compute them."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from services.common.metrics import ServiceMetrics
from services.planner.scrape import ScrapeSource, histogram_quantile, parse_metrics


def test_histogram_quantile_interpolates_like_promql():
    buckets = {0.1: 10.0, 0.5: 60.0, 1.0: 100.0, float("inf"): 100.0}
    assert histogram_quantile(0.5, buckets) == 0.1 + 0.4 * (50 - 10) / 50
    assert histogram_quantile(0.9, buckets) == 0.5 + 0.5 * (90 - 60) / 40
    assert histogram_quantile(0.9, {0.1: 0.0, float("inf"): 0.0}) is None
    assert histogram_quantile(0.99, {1.0: 1.0, float("inf"): 10.0}) == 1.0  # beyond the last finite bucket


class Engine:
    """The services' real metrics registry over a fake engine core's stats."""

    def __init__(self, role: str, openmetrics: bool) -> None:
        self.stats = {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25, "outstanding_tokens": 0}
        self.metrics = ServiceMetrics(lambda: self.stats, "m", role, f"{role}-0")
        self.openmetrics = openmetrics

    def text(self) -> str:  # OpenMetrics (what Prometheus asks for) escapes `pdserve:` to `pdserve_`
        return (generate_openmetrics if self.openmetrics else generate_latest)(self.metrics.registry).decode()


@pytest.mark.parametrize("openmetrics", [False, True], ids=["text", "openmetrics"])
def test_scrape_source_reads_the_services_metrics(openmetrics):
    prefill, decode = Engine("prefill", openmetrics), Engine("decode", openmetrics)
    clock = [0.0]
    source = ScrapeSource(lambda role: [role], window_s=60, clock=lambda: clock[0])
    source.scrape = lambda target: parse_metrics({"prefill": prefill, "decode": decode}[target].text())
    first = source.read(["prefill", "decode"])
    assert first["prefill"].pods == 1 and first["prefill"].prompt_tokens_per_s is None

    clock[0] = 10.0
    prefill.metrics.prompt_tokens.inc(5000)
    prefill.stats["outstanding_tokens"] = 1000  # the queue grew by 1000 tokens in 10 s
    for _ in range(9):
        prefill.metrics.ttft.observe(0.3)
    prefill.metrics.ttft.observe(3.0)
    for _ in range(200):
        decode.metrics.itl.observe(0.015)
    loads = source.read(["prefill", "decode"])
    p, d = loads["prefill"], loads["decode"]
    assert p.prompt_tokens_per_s == (5000 + 1000) / 10
    assert 0.25 <= p.ttft_p90_s <= 0.5  # 9 of 10 in the (0.25, 0.5] bucket
    assert d.generation_tokens_per_s == 20.0 and 0.01 <= d.itl_p90_s <= 0.02
    assert (d.running, d.waiting, d.kv_cache_usage) == (2, 1, 0.25)

    source.scrape = lambda target: None  # every pod unreachable: no data, never a guess
    assert source.read(["prefill"]) == {"prefill": None}
