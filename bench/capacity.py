"""Capacity, DistServe's goodput: the highest arrival rate at which a share of the requests (0.9) meet their SLOs.

A fleet's requests-in-SLO per second at one fixed rate cannot tell two fleets apart once both
meet the SLOs there (each then serves the offered rate, and the better one's margin is at most
1 / the other's attainment); the rate at which each stops meeting them can. Rungs are rates
base x factor^k: up from rung 0 while rungs pass, down while they fail, then `refine` bisections
(in the exponent) between the highest passing rung and the lowest failing one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Ladder:
    """One configuration's capacity search: every rung run, and the answer."""
    rungs: list  # each rung's summary (its rate among it), in the order run
    capacity: float  # highest passing rate (0.0: none passed)
    bounded: bool  # a failing rung above it was run (else capacity is only a lower bound)


def rung_size(rate: float, seconds: float, min_prompts: int) -> int:
    """Requests in a rung: `seconds` of arrivals at its rate (an overloaded fleet's queue grows by
    the excess rate, and a short burst is absorbed by the batch), at least `min_prompts`."""
    return max(min_prompts, math.ceil(rate * seconds))


def find_capacity(run_rung, target: float, max_up: int, max_down: int, refine: int = 0) -> Ladder:
    """run_rung(k) -> the summary of rung k (its "rate", base x factor^k, and "slo_attainment");
    k is an integer on the ladder, k + 1/2, k + 1/4, ... while refining."""
    rungs: list[dict] = []
    passed = lambda s: s["slo_attainment"] >= target - 1e-9  # noqa: E731

    def run(k: float) -> dict:
        s = run_rung(k)
        rungs.append(s)
        return s

    k = 0
    s = run(0)
    if passed(s):
        best, lo = s, 0
        while k < max_up:
            k += 1
            s = run(k)
            if not passed(s):
                break
            best, lo = s, k
        else:
            return Ladder(rungs, best["rate"], False)
        hi = k
    else:
        while True:
            if k <= -max_down:
                return Ladder(rungs, 0.0, True)
            k -= 1
            s = run(k)
            if passed(s):
                best, lo, hi = s, k, k + 1
                break
    for _ in range(refine):
        mid = (lo + hi) / 2
        s = run(mid)
        if passed(s):
            best, lo = s, mid
        else:
            hi = mid
    return Ladder(rungs, best["rate"], True)
