"""The planner's SLA mode: size the prefill and decode pools from the observed load, the profile and the simulator.

As Dynamo's SLA planner: from the observed request rate, ISL and OSL, predict with the profile
(here: simulate) the TTFT and ITL each candidate pool size would give, and take the smallest
that meets the SLOs; the predictions are corrected by what the current fleet measures against
what the simulator predicts for it (a factor per latency), so that the model's bias on this
deployment does not become the planner's.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.planner.config import SlaTargets
from services.planner.policy import RoleLoad
from services.planner.profile_data import Profile
from services.planner.simulator import Fleet, RequestTrace, simulate
from services.planner.workload import poisson

CORRECTION_LIMITS = (0.5, 4.0)  # a factor beyond these says the profile is for another deployment
NUM_REQUESTS = 300  # simulated per candidate


@dataclass(frozen=True)
class Observation:
    """The load, from the metrics: requests/s, mean prompt and output lengths, measured latencies."""
    rate: float
    isl: float
    osl: float
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None

    @classmethod
    def from_loads(cls, prefill: RoleLoad | None, decode: RoleLoad | None) -> "Observation | None":
        """None when the metrics cannot say the rate and lengths (no traffic, a role unseen)."""
        if prefill is None or decode is None or not prefill.requests_per_s or not prefill.prompt_tokens_per_s:
            return None
        rate = prefill.requests_per_s
        # One ITL observation per token after the first.
        osl = 1.0 + (decode.generation_tokens_per_s or 0.0) / rate
        return cls(rate, prefill.prompt_tokens_per_s / rate, osl, prefill.ttft_p90_s, decode.itl_p90_s)


@dataclass(frozen=True)
class SlaPlan:
    prefill: int
    decode: int
    ttft_correction: float
    itl_correction: float
    reason: str


def correction_factor(measured: float | None, predicted: float) -> float:
    """measured / predicted within CORRECTION_LIMITS; 1.0 where nothing was measured or predicted."""
    lo, hi = CORRECTION_LIMITS
    return 1.0 if not measured or predicted <= 0 else min(hi, max(lo, measured / predicted))


def _p90(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.9 * len(values)))] if values else 0.0


def _within(traces: list[RequestTrace], key, limit: float) -> float:
    return sum(1 for t in traces if key(t) <= limit) / len(traces)


class SlaSizer:
    def __init__(self, profile: Profile, targets: SlaTargets, max_prefill: int, max_decode: int) -> None:
        profile.transfer(targets.transport)  # refuse a profile without the transport now, not mid-loop
        self.profile, self.targets = profile, targets
        self.max_prefill, self.max_decode = max_prefill, max_decode

    def _simulate(self, obs: Observation, prefill: int, decode: int) -> list[RequestTrace]:
        w = poisson(obs.rate, NUM_REQUESTS, f"fixed:{max(1, round(obs.isl))}", f"fixed:{max(1, round(obs.osl))}")
        fleet = Fleet(num_prefill=prefill, num_decode=decode, transport=self.targets.transport)
        return simulate(self.profile, fleet, list(w.requests))

    def predict(self, obs: Observation, prefill: int, decode: int) -> tuple[float, float]:
        """TTFT p90 and ITL p90 (the decode's own gaps, after the handoff) of that fleet."""
        traces = self._simulate(obs, prefill, decode)
        return _p90([t.ttft for t in traces]), _p90([x for t in traces for x in t.itls[1:]])

    def corrections(self, obs: Observation, prefill: int, decode: int) -> tuple[float, float]:
        """measured / predicted for the current fleet: TTFT p90 and ITL p90 (1 where unmeasured)."""
        if prefill < 1 or decode < 1 or (obs.ttft_p90_s is None and obs.itl_p90_s is None):
            return 1.0, 1.0
        ttft, itl = self.predict(obs, prefill, decode)
        return correction_factor(obs.ttft_p90_s, ttft), correction_factor(obs.itl_p90_s, itl)

    def size(self, obs: Observation, current_prefill: int, current_decode: int) -> SlaPlan:
        """The fewest prefills whose (corrected) TTFT meets the SLO for `attainment` of the requests
        (beside the most decodes), then the fewest decodes whose corrected TPOT does (beside them)."""
        t = self.targets
        c_ttft, c_itl = self.corrections(obs, current_prefill, current_decode)
        ttft_limit, tpot_limit = t.ttft_s / c_ttft, t.tpot_s / c_itl
        prefill = next((p for p in range(1, self.max_prefill + 1)
                        if _within(self._simulate(obs, p, self.max_decode), lambda r: r.ttft, ttft_limit)
                        >= t.attainment), self.max_prefill)
        decode = next((d for d in range(1, self.max_decode + 1)
                       if _within(self._simulate(obs, prefill, d), lambda r: r.tpot or 0.0, tpot_limit)
                       >= t.attainment), self.max_decode)
        reason = (f"SLA: {obs.rate:.3g} req/s, ISL {obs.isl:.0f}, OSL {obs.osl:.0f} -> {prefill}P+{decode}D meet "
                  f"TTFT {t.ttft_s:.3g}s / TPOT {t.tpot_s:.3g}s for {t.attainment:.0%} (corrections TTFT x{c_ttft:.2f}, "
                  f"ITL x{c_itl:.2f})")
        return SlaPlan(prefill, decode, c_ttft, c_itl, reason)
