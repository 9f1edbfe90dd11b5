"""A small discrete-event model of a disaggregated deployment, driven by the planner's policy.

Arrivals are Poisson per phase. A prefill replica serves prompts one after another at a fixed
token rate (TTFT = queueing + compute). A decode replica runs a continuous batch whose step time
grows with the batch (memory-bound decoding), admits a request only when it has a sequence slot
and KV room, and queues it otherwise. New replicas serve after a start-up delay (model load); a
removed replica stops taking work and is paid for until it has drained. Every `interval_s` the
planner's RolePolicy sees what the real metrics would show over the last `window_s`.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

from services.planner.config import PlannerConfig
from services.planner.policy import RoleLoad, make_policies


@dataclass(frozen=True)
class Phase:
    duration_s: float
    rate: float  # requests/s (linearly ramped to `rate_end` when set)
    prompt_tokens: int
    output_tokens: int
    rate_end: float | None = None


@dataclass(frozen=True)
class Hardware:
    prefill_tokens_per_s: float = 8000.0
    prefill_overhead_s: float = 0.02
    decode_step_s: float = 0.015  # step time of an empty batch ...
    decode_step_per_seq_s: float = 0.00025  # ... plus this per sequence in the batch
    decode_max_seqs: int = 128
    kv_tokens_per_replica: int = 400_000
    startup_s: float = 60.0


@dataclass
class Replica:
    created: float
    ready_at: float
    draining: bool = False
    gone_at: float | None = None  # when it stopped costing (drained after removal)
    # prefill
    busy_until: float = 0.0
    queued_tokens: int = 0
    # decode (steps advance as a fluid between batch changes)
    running: list = field(default_factory=list)  # heap of (finish_step, request id, kv tokens)
    waiting: list = field(default_factory=list)
    steps: float = 0.0
    updated: float = 0.0
    kv_used: int = 0
    version: int = 0

    def step_s(self, hw: Hardware) -> float:
        return hw.decode_step_s + hw.decode_step_per_seq_s * len(self.running)


@dataclass
class Result:
    ttft: list[tuple[float, float]]  # (time, seconds)
    itl: list[tuple[float, float, float]]  # (time, seconds, weight in tokens)
    replica_seconds: dict[str, float]
    replicas: dict[str, list[tuple[float, int]]]  # role -> (time, desired count) after each change

    def p90_ttft(self, since: float = 0.0) -> float:
        return weighted_quantile([(x, 1.0) for t, x in self.ttft if t >= since], 0.9)

    def p90_itl(self, since: float = 0.0) -> float:
        return weighted_quantile([(x, w) for t, x, w in self.itl if t >= since], 0.9)

    def peak(self, role: str) -> int:
        return max(n for _, n in self.replicas[role])

    def changes(self, role: str, after: float = 0.0) -> list[tuple[float, int]]:
        return [(t, n) for t, n in self.replicas[role][1:] if t >= after]


def weighted_quantile(samples: list[tuple[float, float]], q: float) -> float:
    if not samples:
        return math.nan
    samples = sorted(samples)
    total = sum(w for _, w in samples)
    acc = 0.0
    for value, w in samples:
        acc += w
        if acc >= q * total:
            return value
    return samples[-1][0]


class Simulation:
    def __init__(self, phases: list[Phase], config: PlannerConfig | None, hw: Hardware = Hardware(),
                 prefill: int = 1, decode: int = 1, seed: int = 0) -> None:
        self.phases, self.config, self.hw = phases, config, hw
        self.rng = random.Random(seed)
        self.now = 0.0
        self.events: list = []
        self.seq = itertools.count()
        self.pools: dict[str, list[Replica]] = {"prefill": [Replica(0.0, 0.0) for _ in range(prefill)],
                                                 "decode": [Replica(0.0, 0.0) for _ in range(decode)]}
        self.requests: dict[int, tuple[float, int, int]] = {}  # id -> (arrival, prompt, output)
        self.ttft: list[tuple[float, float]] = []  # (time, ttft)
        self.prompt_done: list[tuple[float, int]] = []  # (time, prompt tokens) at prefill completion
        self.itl: list[tuple[float, float, float]] = []  # (time, itl, weight)
        self.decode_samples: list[tuple[float, int, int, float]] = []  # (time, running, waiting, kv usage)
        self.prefill_queue: list[tuple[float, int]] = []  # (time, queued prompt tokens)
        self.policies = make_policies(config) if config else {}
        self.replicas = {role: [(0.0, len(pool))] for role, pool in self.pools.items()}

    # -- events
    def at(self, t: float, kind: str, *payload) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def run(self) -> Result:
        t, rid = 0.0, 0
        for ph in self.phases:  # pre-draw every arrival (a Poisson process with a ramped rate)
            end = t + ph.duration_s
            while True:
                frac = 0.0 if ph.rate_end is None else (t - (end - ph.duration_s)) / ph.duration_s
                rate = ph.rate + frac * ((ph.rate_end or ph.rate) - ph.rate)
                t += self.rng.expovariate(max(rate, 1e-6))
                if t >= end:
                    t = end
                    break
                spread = lambda n: max(1, int(n * self.rng.uniform(0.5, 1.5)))  # noqa: E731
                self.requests[rid] = (t, spread(ph.prompt_tokens), spread(ph.output_tokens))
                self.at(t, "arrive", rid)
                rid += 1
        horizon = t
        if self.config:
            for k in range(1, int(horizon // self.config.interval_s)):
                self.at(k * self.config.interval_s, "plan")
        for k in range(1, int(horizon)):
            self.at(float(k), "sample")
        while self.events:
            self.now, _, kind, payload = heapq.heappop(self.events)
            getattr(self, f"on_{kind}")(*payload)
        end = self.now
        cost = {role: sum((r.gone_at if r.gone_at is not None else end) - r.created for r in pool)
                for role, pool in self.pools.items()}
        return Result(self.ttft, self.itl, cost, self.replicas)

    def serving(self, role: str) -> list[Replica]:
        return [r for r in self.pools[role] if r.ready_at <= self.now and not r.draining]

    def on_arrive(self, rid: int) -> None:
        replica = min(self.serving("prefill"), key=lambda r: r.queued_tokens)
        _, prompt, _ = self.requests[rid]
        start = max(self.now, replica.busy_until)
        replica.busy_until = start + self.hw.prefill_overhead_s + prompt / self.hw.prefill_tokens_per_s
        replica.queued_tokens += prompt
        self.at(replica.busy_until, "prefilled", rid, replica)

    def on_prefilled(self, rid: int, replica: Replica) -> None:
        arrival, prompt, _ = self.requests[rid]
        replica.queued_tokens -= prompt
        self.ttft.append((self.now, self.now - arrival))
        self.prompt_done.append((self.now, prompt))
        self._retire_if_drained(replica, replica.queued_tokens == 0)
        target = min(self.serving("decode"), key=lambda r: len(r.running) + len(r.waiting))
        target.waiting.append((rid, self.now))
        self._decode_update(target)

    def _advance(self, r: Replica) -> None:
        if r.running:
            dt = self.now - r.updated
            step = r.step_s(self.hw)
            r.steps += dt / step
            self.itl.append((self.now, step, dt / step * len(r.running)))
        r.updated = self.now

    def _decode_update(self, r: Replica) -> None:
        self._advance(r)
        while r.running and r.running[0][0] <= r.steps + 1e-9:
            _, _, kv = heapq.heappop(r.running)
            r.kv_used -= kv
        while r.waiting:
            rid, since = r.waiting[0]
            _, prompt, output = self.requests[rid]
            if len(r.running) >= self.hw.decode_max_seqs or r.kv_used + prompt + output > self.hw.kv_tokens_per_replica:
                break
            r.waiting.pop(0)
            heapq.heappush(r.running, (r.steps + output, rid, prompt + output))
            r.kv_used += prompt + output
            self.itl.append((self.now, self.now - since + r.step_s(self.hw), 1.0))  # the gap after token 1
        r.version += 1
        if r.running:
            self.at(r.updated + (r.running[0][0] - r.steps) * r.step_s(self.hw), "decoded", r, r.version)
        self._retire_if_drained(r, not r.running and not r.waiting)

    def on_decoded(self, r: Replica, version: int) -> None:
        if version == r.version:
            self._decode_update(r)

    def _retire_if_drained(self, r: Replica, idle: bool) -> None:
        if r.draining and idle and r.gone_at is None:
            r.gone_at = self.now

    def on_sample(self) -> None:
        self.prefill_queue.append((self.now, sum(r.queued_tokens for r in self.serving("prefill"))))
        pool = self.serving("decode")
        usage = sum(r.kv_used for r in pool) / (len(pool) * self.hw.kv_tokens_per_replica)
        self.decode_samples.append((self.now, sum(len(r.running) for r in pool), sum(len(r.waiting) for r in pool),
                                    usage))

    # -- the planner
    @staticmethod
    def _since(samples: list, t: float) -> list:
        """The samples (time-ordered, time first) from t on."""
        return samples[bisect.bisect_left(samples, t, key=lambda x: x[0]):]

    def observe(self, role: str) -> RoleLoad:
        since = self.now - self.config.window_s
        pods = len(self.serving(role))
        if role == "prefill":  # as the metrics show it: tokens processed + the queue's growth
            ttft = sorted(x for _, x in self._since(self.ttft, since))
            queue = [q for _, q in self._since(self.prefill_queue, since)] or [0]
            processed = sum(p for _, p in self._since(self.prompt_done, since))
            rate = (processed + queue[-1] - queue[0]) / self.config.window_s
            return RoleLoad(pods=pods, prompt_tokens_per_s=rate,
                            ttft_p90_s=ttft[int(0.9 * (len(ttft) - 1))] if ttft else None)
        recent = [x[1:] for x in self._since(self.decode_samples, since)]  # gauges: avg_over_time
        recent = recent or [(0.0, 0.0, 0.0)]
        itl = [(x, w) for _, x, w in self._since(self.itl, since)]
        mean = lambda i: sum(x[i] for x in recent) / len(recent)  # noqa: E731
        return RoleLoad(pods=pods, generation_tokens_per_s=sum(w for _, w in itl) / self.config.window_s,
                        running=mean(0), waiting=mean(1), kv_cache_usage=mean(2),
                        itl_p90_s=weighted_quantile(itl, 0.9) if itl else None)

    def on_plan(self) -> None:
        for role, policy in self.policies.items():
            pool = [r for r in self.pools[role] if not r.draining]
            decision = policy.decide(self.observe(role), len(pool), self.now)
            if decision.direction == "hold":
                continue
            policy.changed(self.now)
            if decision.direction == "up":
                self.pools[role] += [Replica(self.now, self.now + self.hw.startup_s)
                                     for _ in range(decision.desired - decision.current)]
            else:
                # not-yet-ready replicas go first, then the least loaded
                by_cost = sorted(pool, key=lambda r: (r.ready_at <= self.now, self._load(r)))
                for r in by_cost[:decision.current - decision.desired]:
                    r.draining = True
                    self._retire_if_drained(r, self._load(r) == 0 or r.ready_at > self.now)
            self.replicas[role].append((self.now, decision.desired))

    @staticmethod
    def _load(r: Replica) -> int:
        return r.queued_tokens + len(r.running) + len(r.waiting)
