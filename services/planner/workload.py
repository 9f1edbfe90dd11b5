"""Workload files for the simulator and `pdserve plan`: an arrival process with ISL/OSL distributions, or a trace.

JSON, one of:
  {"rate": 0.3, "num_requests": 200, "isl": "uniform:1024:2048", "osl": "uniform:64:128", "seed": 1}
  {"trace": [[arrival_s, isl, osl], ...]}
  {"trace_file": "requests.jsonl"}   (one {"arrival": s, "isl": n, "osl": n} object a line;
                                      a relative path is taken from the workload file's folder)
Distributions are bench's: fixed:N, uniform:LO:HI, normal:MEAN:STD[:MIN]; arrivals are Poisson
(rate in requests/s), drawn as `pdserve bench` draws them.
"""
from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass

from bench.workloads import parse_dist, poisson_arrivals
from services.planner.simulator import SimRequest


@dataclass(frozen=True)
class Workload:
    requests: tuple[SimRequest, ...]
    description: str

    @property
    def rate(self) -> float:
        """Mean arrival rate over the trace (requests/s)."""
        span = self.requests[-1].arrival - self.requests[0].arrival
        return (len(self.requests) - 1) / span if span > 0 else float("inf")

    @property
    def mean_isl(self) -> float:
        return sum(r.isl for r in self.requests) / len(self.requests)

    @property
    def mean_osl(self) -> float:
        return sum(r.osl for r in self.requests) / len(self.requests)

    def scaled(self, factor: float, min_requests: int = 0, min_seconds: float = 0.0,
               max_requests: int | None = None) -> "Workload":
        """The same requests arriving `factor` times as fast, repeated one copy after another until
        there are `min_requests` and their arrivals span `min_seconds` (at most `max_requests`,
        but never fewer copies than `min_requests` needs): a short trace at a high rate is one
        burst, which a fleet may absorb whatever its steady-state capacity."""
        reqs = [SimRequest(r.arrival / factor, r.isl, r.osl) for r in self.requests]
        start = reqs[0].arrival
        period = (reqs[-1].arrival - start) * len(reqs) / max(1, len(reqs) - 1) or 1.0 / factor
        copies = max(1, -(-min_requests // len(reqs)))
        by_time = max(1, math.ceil(min_seconds / period)) if min_seconds > 0 else 1
        if max_requests is not None:
            by_time = min(by_time, max(1, max_requests // len(reqs)))
        copies = max(copies, by_time)
        tiled = [SimRequest(r.arrival + k * period, r.isl, r.osl) for k in range(copies) for r in reqs]
        return Workload(tuple(tiled), f"{self.description} x{factor:g}")


def poisson(rate: float, num_requests: int, isl: str, osl: str, seed: int = 0,
            arrival_seed: int | None = None) -> Workload:
    """Lengths from their distributions, arrivals as bench.serve draws them (poisson_arrivals)."""
    if rate <= 0 or num_requests < 1:
        raise ValueError("a Poisson workload needs rate > 0 and num_requests >= 1")
    rng = random.Random(seed)
    pick_in, pick_out = parse_dist(isl), parse_dist(osl)
    lengths = [(pick_in(rng), pick_out(rng)) for _ in range(num_requests)]
    offsets = poisson_arrivals(num_requests, rate, seed if arrival_seed is None else arrival_seed)
    reqs = tuple(SimRequest(a, i, o) for a, (i, o) in zip(offsets, lengths))
    return Workload(reqs, f"Poisson {rate:g} req/s, {num_requests} requests, ISL {isl}, OSL {osl}")


def from_trace(rows, description: str = "trace") -> Workload:
    try:
        reqs = sorted((SimRequest(float(a), int(i), int(o)) for a, i, o in rows), key=lambda r: r.arrival)
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad trace row: {e} (rows are [arrival_s, isl, osl])") from None
    if not reqs:
        raise ValueError("the trace has no requests")
    return Workload(tuple(reqs), f"{description}: {len(reqs)} requests")


def load(path: str) -> Workload:
    with open(path) as f:
        try:
            spec = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: a workload is a JSON object (see services/planner/workload.py)")
    if "trace" in spec:
        return from_trace(spec["trace"], os.path.basename(path))
    if "trace_file" in spec:
        trace_path = os.path.join(os.path.dirname(os.path.abspath(path)), spec["trace_file"])
        with open(trace_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return from_trace([(r["arrival"], r["isl"], r["osl"]) for r in rows], spec["trace_file"])
    missing = {"rate", "num_requests", "isl", "osl"} - set(spec)
    if missing:
        raise ValueError(f"{path}: a Poisson workload needs {', '.join(sorted(missing))} "
                         "(or give a trace / trace_file)")
    return poisson(float(spec["rate"]), int(spec["num_requests"]), spec["isl"], spec["osl"],
                   int(spec.get("seed", 0)), spec.get("arrival_seed"))
