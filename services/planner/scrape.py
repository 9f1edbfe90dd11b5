"""Load per role by scraping the instances' /metrics directly, for clusters without Prometheus.

Counters become rates and histograms quantiles by differencing scrapes across the window, the
way PromQL's rate() and histogram_quantile() would.
"""
from __future__ import annotations

import logging
import math
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

from services.planner.policy import RoleLoad

logger = logging.getLogger("pdserve.planner")

_GAUGES = {"pdserve:num_requests_running": "running", "pdserve:num_requests_waiting": "waiting",
           "pdserve:kv_cache_usage_perc": "kv_cache_usage", "pdserve:outstanding_tokens": "outstanding"}
_COUNTERS = {"pdserve:prompt_tokens_total": "prompt_tokens",
             "pdserve:inter_token_latency_seconds_count": "itl_count",
             "pdserve:time_to_first_token_seconds_count": "ttft_count"}
_HISTOGRAMS = {"pdserve:time_to_first_token_seconds_bucket": "ttft",
               "pdserve:inter_token_latency_seconds_bucket": "itl"}


@dataclass
class Sample:
    """One instance's metrics at one scrape (values summed over label sets)."""
    values: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # name -> le -> cumulative count


def parse_metrics(text: str) -> Sample:
    sample = Sample()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.replace("pdserve_", "pdserve:", 1)  # as an OpenMetrics exposition escapes it
            if name in _GAUGES or name in _COUNTERS:
                key = _GAUGES.get(name) or _COUNTERS[name]
                sample.values[key] = sample.values.get(key, 0.0) + s.value
            elif name in _HISTOGRAMS:
                le = float(s.labels["le"])
                b = sample.buckets.setdefault(_HISTOGRAMS[name], {})
                b[le] = b.get(le, 0.0) + s.value
    return sample


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """PromQL's histogram_quantile over cumulative bucket counts (linear within a bucket)."""
    les = sorted(buckets)
    if not les or buckets[les[-1]] <= 0:
        return None
    rank = q * buckets[les[-1]]
    prev_le, prev_count = 0.0, 0.0
    for le in les:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return prev_le  # the quantile is beyond the highest finite bucket
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return les[-1]


def _delta(now: float, then: float) -> float:
    return now if now < then else now - then  # a counter that went down was reset (a restart)


class ScrapeSource:
    """`targets(role)` lists the host:port of each instance's metrics endpoint right now."""

    def __init__(self, targets: Callable[[str], list[str]], window_s: float, timeout_s: float = 3.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.targets, self.window_s, self.timeout_s, self.clock = targets, window_s, timeout_s, clock
        self.history: dict[str, deque[tuple[float, dict[str, Sample]]]] = {}

    def scrape(self, target: str) -> Sample | None:
        try:
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=self.timeout_s) as r:
                return parse_metrics(r.read().decode())
        except (OSError, ValueError) as e:
            logger.warning("cannot scrape %s: %s", target, e)
            return None

    def read(self, roles) -> dict[str, RoleLoad | None]:
        now = self.clock()
        out: dict[str, RoleLoad | None] = {}
        for role in roles:
            samples = {t: s for t in self.targets(role) if (s := self.scrape(t)) is not None}
            history = self.history.setdefault(role, deque())
            history.append((now, samples))
            while len(history) > 2 and history[1][0] <= now - self.window_s:
                history.popleft()  # keep one scrape at or before the window's start
            out[role] = self.load(role, history) if samples else None
        return out

    def load(self, role: str, history) -> RoleLoad:
        (t0, first), (t1, last) = history[0], history[-1]
        dt = t1 - t0
        both = [t for t in last if t in first]  # instances seen across the whole window

        def rate(key: str) -> float | None:
            if dt <= 0 or not both:
                return None
            return sum(_delta(last[t].values.get(key, 0.0), first[t].values.get(key, 0.0)) for t in both) / dt

        def p90(key: str) -> float | None:
            if not both:
                return None
            merged: dict[float, float] = {}
            for t in both:
                old = first[t].buckets.get(key, {})
                for le, count in last[t].buckets.get(key, {}).items():
                    merged[le] = merged.get(le, 0.0) + _delta(count, old.get(le, 0.0))
            return histogram_quantile(0.9, merged)

        def mean_sum(key: str) -> float:  # avg over the scrapes in the window of the sum over instances
            scrapes = [sum(s.values.get(key, 0.0) for s in snap.values()) for _, snap in history if snap]
            return sum(scrapes) / len(scrapes)

        usage = [s.values.get("kv_cache_usage", 0.0) for _, snap in history for s in snap.values()]
        load = dict(pods=len(last), running=mean_sum("running"), waiting=mean_sum("waiting"),
                    kv_cache_usage=sum(usage) / len(usage) if usage else None)
        if role == "prefill":
            processed = rate("prompt_tokens")
            growth = (sum(last[t].values.get("outstanding", 0.0) - first[t].values.get("outstanding", 0.0)
                          for t in both) / dt) if dt > 0 else 0.0
            load.update(prompt_tokens_per_s=None if processed is None else max(0.0, processed + growth),
                        ttft_p90_s=p90("ttft"), requests_per_s=rate("ttft_count"))
        else:
            load.update(generation_tokens_per_s=rate("itl_count"), itl_p90_s=p90("itl"))
        return RoleLoad(**load)
