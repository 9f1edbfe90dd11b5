"""Conditional disaggregation: per request, a prefill instance computes the prompt, or the decode does.

`--pd-policy`:
- auto (the default when both pools exist): conditional where the router knows the decode
  instances' caches (they publish KV events, --kv-events-config), else always;
- always: every prompt goes to a prefill instance (the decode pulls its KV);
- never: every decode instance computes its prompts itself (colocated serving on the decode pool);
- conditional, as Dynamo's conditional disaggregation and
  llm-d's P/D decider: the decode instance the routing policy picks computes the prompt itself when
    * the prompt tokens it would still compute (after its own prefix cache, as the KV index knows
      it) are at most `max_local_prefill_tokens` (a short or mostly cached prompt: a transfer and a
      second hop cost more than the compute), or
    * the prefill pool is queueing: its least queued instance has more than
      `max_prefill_queue_tokens` tokens surely waiting behind the step it may be running (its
      outstanding tokens beyond one step's budget, `Instance.queued_tokens`: a prompt in the
      running step is computing, not queueing), while that decode has room (no request waiting
      and KV cache usage under `decode_room_usage`), or no healthy prefill instance pairs with it.
      By default the bound is the prompt's uncached tokens times (1 + the requests decoding
      there: the more of its last load report's count and this router's open streams there).
      Computing the prompt on the decode stalls each of them for about as long as the prompt
      takes (the decode's compute being the same model on the same kind of device), so the
      wait it saves at the prefill must exceed the prompt's own compute once for every stream
      it holds up; on an idle decode, the prompt's own tokens (it would wait longer than
      computing it takes). The requests now computing at the prefill pool that will finish
      before the local prompt does reach a decode meanwhile and stall too, each for the rest of
      the prompt's compute (counted in tokens: the prompt's uncached tokens less the prefill
      tokens ahead of and in that request, this router's own in the order it sent them, shared
      among the decodes that prefill pairs with). (Until 2026-12-04 the running streams were
      not counted, until 2026-12-05 the arriving ones: a long prompt computed on a busy decode
      made the streams there miss a tight TPOT, docs/routing.md);
  else the prompt goes to a prefill instance.
Each decision is counted in pdserve:router_pd_decisions_total{decision, reason}.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from services.router.instances import InstancePool
from services.router.policy import RouteRequest, RoutingPolicy

logger = logging.getLogger(__name__)

PD_POLICIES = ("auto", "always", "never", "conditional")


@dataclass(frozen=True)
class PdDecision:
    disaggregate: bool
    reason: str  # always | never | no_kv_events | short_uncached | prefill_queue | no_prefill | long_uncached
    route: RouteRequest  # the decode route, preferring the instance the decision was made for


class PdPolicy:
    def __init__(self, mode: str, routing: RoutingPolicy, pool: InstancePool, metrics, *,
                 max_local_prefill_tokens: int = 512, max_prefill_queue_tokens: int | None = None,
                 decode_room_usage: float = 0.9) -> None:
        if mode not in PD_POLICIES:
            raise ValueError(f"unknown pd policy {mode!r}; choose one of {', '.join(PD_POLICIES)}")
        self.mode = mode
        self.routing = routing
        self.pool = pool
        self.metrics = metrics
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.max_prefill_queue_tokens = max_prefill_queue_tokens
        self.decode_room_usage = decode_room_usage

    def serves_without_prefill(self) -> bool:
        """Whether requests can be served while no prefill instance is healthy: the decode
        instances compute their prompts themselves (never; conditional, and auto where it acts
        as conditional)."""
        if self.mode == "auto":
            return self.routing.knows_caches(self.pool.healthy("decode"))
        return self.mode in ("never", "conditional")

    def decide(self, route: RouteRequest, exclude=()) -> PdDecision:
        decision = self._decide(route, exclude)
        self.metrics.pd_decisions.labels("prefill_remote" if decision.disaggregate else "decode_local",
                                         decision.reason).inc()
        return decision

    def _decide(self, route: RouteRequest, exclude) -> PdDecision:
        if self.mode in ("always", "never"):
            return PdDecision(self.mode == "always", self.mode, route)
        decodes = [i for i in self.pool.healthy("decode") if i not in exclude]
        if not decodes:
            return PdDecision(True, "always", route)  # the dispatcher answers for the missing decode
        if self.mode == "auto" and not self.routing.knows_caches(decodes):
            return PdDecision(True, "no_kv_events", route)
        decode = self.routing.select(decodes, route)
        local = replace(route, prefer=decode.address)
        uncached = self.routing.uncached_tokens(decode, route)
        if uncached is None:
            uncached = len(route.prompt_token_ids)
        if uncached <= self.max_local_prefill_tokens:
            return PdDecision(False, "short_uncached", local)
        prefills = [p for p in self.pool.healthy("prefill") if self.pool.pairs.can_pair(p, decode)]
        if not prefills:  # none healthy, or none this decode can pull from
            return PdDecision(False, "no_prefill", local)
        queue = min(i.queued_tokens for i in prefills)
        running = self._running(decode)
        if self.max_prefill_queue_tokens is None:
            arriving = self._arriving_stall(prefills, decodes, uncached)
            bound = uncached * (1 + running) + arriving
        else:  # a fixed bound: the arriving requests are not weighed
            arriving = 0
            bound = self.max_prefill_queue_tokens
        here = queue > bound and self._has_room(decode)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%d prompt tokens, %d uncached on %s (%d running, %d waiting, %d tokens of stall for "
                         "requests arriving from the prefill pool): prefill queue %d against a bound of %d: %s",
                         len(route.prompt_token_ids), uncached, decode.address, running,
                         decode.load.num_waiting if decode.load is not None else 0, arriving, queue, bound,
                         "computed on the decode" if here else "sent to a prefill")
        if here:
            return PdDecision(False, "prefill_queue", local)
        return PdDecision(True, "long_uncached", route)

    @staticmethod
    def _running(decode) -> int:
        """Requests a prompt computed on `decode` would stall: the more of its last load report's
        running requests (every router's, up to a poll old) and the decode streams this router
        has open there now (the request it sent since the report included)."""
        reported = decode.load.num_running if decode.load is not None else 0
        return max(reported, decode.streams)

    def _arriving_stall(self, prefills, decodes, uncached: int) -> int:
        """Stream-time, in prompt tokens, that a prompt of `uncached` tokens computed on a decode
        costs the requests that this router has computing at `prefills` and that finish before it:
        each reaches a decode while the prompt computes and waits out the rest of it. A prefill
        computes its requests in the order they came (this router's, as it sent them), at about
        the decode's token rate (the same model on the same kind of device), and what its load
        report no longer counts was computed from the head; a finished request goes to one of
        `decodes` (healthy, less those this request lost) that prefill pairs with, this one as
        likely as another."""
        stall = 0.0
        for p in prefills:
            tokens = list(p.prefilling.values())
            if not tokens:
                continue
            share = 1 / max(1, sum(1 for d in decodes if self.pool.pairs.can_pair(p, d)))
            finished_at = -max(0, sum(tokens) - p.load_score)  # computed already, as its load shows
            for t in tokens:
                finished_at += t
                if finished_at >= uncached:
                    break
                stall += (uncached - max(0, finished_at)) * share
        return round(stall)

    def _has_room(self, decode) -> bool:
        report = decode.load
        return report is None or (report.num_waiting == 0 and report.kv_cache_usage < self.decode_room_usage)
