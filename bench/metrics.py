"""Serving metrics from per-request timestamps, defined as `vllm bench serve` defines them."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0  # tokens generated (from usage)
    ttft: float = 0.0  # seconds from send to the first token
    itl: list[float] = field(default_factory=list)  # gaps between streamed token chunks
    latency: float = 0.0  # send to last byte
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache (usage.prompt_tokens_details)
    success: bool = False
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_len - 1)."""
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50', 'e2el:3000'] (milliseconds) -> {'ttft': 0.5, ...} seconds."""
    slos = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"bad SLO {item!r}: use ttft:MS, tpot:MS or e2el:MS")
        slos[key] = float(value) / 1000.0
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    if not r.success:
        return False
    if "ttft" in slos and r.ttft > slos["ttft"]:
        return False
    if "tpot" in slos and (r.tpot or 0.0) > slos["tpot"]:
        return False
    if "e2el" in slos and r.latency > slos["e2el"]:
        return False
    return True


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    arr = np.asarray(values_s, dtype=float) * 1000.0 if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float] | None = None,
              percentiles: tuple[float, ...] = (50, 90, 99)) -> dict:
    """One result dict; field names follow vllm bench serve where the quantity is the same."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    pct = list(percentiles)
    summary = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in results)
        summary["request_goodput"] = good / duration if duration > 0 else 0.0
        summary["slo_attainment"] = good / len(results) if results else 0.0
        summary["slos_ms"] = {k: v * 1000.0 for k, v in slos.items()}
    summary.update(_stats("ttft", [r.ttft for r in ok], pct))
    summary.update(_stats("tpot", [r.tpot for r in ok if r.tpot is not None], pct))
    summary.update(_stats("itl", [x for r in ok for x in r.itl], pct))
    summary.update(_stats("e2el", [r.latency for r in ok], pct))
    summary.update({
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
    })
    return summary
