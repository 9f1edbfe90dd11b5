"""Serving metrics of simulated requests, named and defined as bench/metrics.py names and defines the measured ones."""
from __future__ import annotations

import numpy as np

from services.planner.simulator import RequestTrace


def parse_slo(spec: str) -> dict[str, float]:
    """'ttft:4000,tpot:100' (milliseconds) -> {'ttft': 4.0, 'tpot': 0.1} seconds."""
    slos: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if key not in ("ttft", "tpot") or ms <= 0:
            raise ValueError(f"bad SLO {item!r}: use ttft:MS,tpot:MS with MS > 0")
        slos[key] = ms / 1000.0
    if not slos:
        raise ValueError("no SLO given: use ttft:MS,tpot:MS")
    return slos


def meets(trace: RequestTrace, slos: dict[str, float]) -> bool:
    if "ttft" in slos and trace.ttft > slos["ttft"]:
        return False
    return not ("tpot" in slos and (trace.tpot or 0.0) > slos["tpot"])


def _stats(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    arr = np.asarray(values_s, dtype=float) * 1000.0 if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr))}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def summarize(traces: list[RequestTrace], slos: dict[str, float] | None = None,
              percentiles: tuple[float, ...] = (50, 90, 99)) -> dict:
    """TTFT, TPOT and ITL percentiles, the longest inter-token stall, and goodput at the SLOs
    (requests meeting all of them per second of the run, from the first arrival to the last token)."""
    if not traces:
        raise ValueError("no requests to summarize")
    start = min(t.request.arrival for t in traces)
    duration = max(t.token_times[-1] for t in traces) - start
    itls = [x for t in traces for x in t.itls]
    out = {"completed": len(traces), "duration": duration,
           "request_throughput": len(traces) / duration if duration > 0 else 0.0,
           "output_throughput": sum(len(t.token_times) for t in traces) / duration if duration > 0 else 0.0,
           "max_itl_ms": 1000.0 * max(itls, default=0.0)}
    out.update(_stats("ttft", [t.ttft for t in traces], percentiles))
    out.update(_stats("tpot", [t.tpot for t in traces if t.tpot is not None], percentiles))
    out.update(_stats("itl", itls, percentiles))
    # The longest gap each request saw: p99 of the ITLs hides a stall of a few tokens.
    out.update(_stats("max_stall", [max(t.itls, default=0.0) for t in traces], percentiles))
    if slos:
        good = sum(meets(t, slos) for t in traces)
        out["request_goodput"] = good / duration if duration > 0 else 0.0
        out["slo_attainment"] = good / len(traces)
        out["slos_ms"] = {k: v * 1000.0 for k, v in slos.items()}
    return out
