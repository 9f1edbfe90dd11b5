"""Capacity, DistServe's goodput: the highest arrival rate at which a share of the requests (0.9) meet their SLOs.

A fleet's requests-in-SLO per second at one fixed rate cannot tell two fleets apart once both
meet the SLOs there (each then serves the offered rate, and the better one's margin is at most
1 / the other's attainment); the rate at which each stops meeting them can. Rungs are rates
base x factor^k: up from rung 0 while rungs pass, down while they fail, then `refine` bisections
(in the exponent) between the highest passing rung and the lowest failing one.
"""
from __future__ import annotations

import math
from collections.abc import Generator
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


def search(target: float, max_up: int, max_down: int, refine: int = 0) -> Generator[float, dict, Ladder]:
    """One capacity search as a generator: yields the rung k to run next (an integer on the
    ladder; k + 1/2, k + 1/4, ... while refining) and is sent that rung's summary (its "rate",
    base x factor^k, and "slo_attainment"); returns the Ladder."""
    rungs: list[dict] = []
    passed = lambda s: s["slo_attainment"] >= target - 1e-9  # noqa: E731
    k = 0
    s = yield 0
    rungs.append(s)
    if passed(s):
        best, lo = s, 0
        while k < max_up:
            k += 1
            s = yield k
            rungs.append(s)
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
            s = yield k
            rungs.append(s)
            if passed(s):
                best, lo, hi = s, k, k + 1
                break
    for _ in range(refine):
        mid = (lo + hi) / 2
        s = yield mid
        rungs.append(s)
        if passed(s):
            best, lo = s, mid
        else:
            hi = mid
    return Ladder(rungs, best["rate"], True)


def rotated(names: list, turn: int) -> list:
    """names in turn `turn`'s order: each turn starts one name later than the one before."""
    return names[turn % len(names):] + names[:turn % len(names)] if names else []


def interleave(searches: dict, run_rung, before_round=None) -> dict:
    """Several searches at once: round after round, the next rung of every unfinished search,
    run_rung(name, k) -> its summary; each round starts one search later than the one before,
    so that a machine's drift (a slow minute) falls on every search alike rather than on the
    one measured last. before_round(r), if given, runs before round r (0, 1, ...). Returns
    each search's Ladder."""
    pending = {name: next(g) for name, g in searches.items()}
    done = {}
    turn = 0
    while pending:
        if before_round is not None:
            before_round(turn)
        for name in rotated(list(pending), turn):
            try:
                pending[name] = searches[name].send(run_rung(name, pending[name]))
            except StopIteration as stop:
                done[name] = stop.value
                del pending[name]
        turn += 1
    return {name: done[name] for name in searches}

