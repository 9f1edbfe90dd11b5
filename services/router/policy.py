"""Routing policies: which prefill or decode instance serves a request."""
from __future__ import annotations

import abc
import itertools
import math
import random
from dataclasses import dataclass
from typing import Sequence

from engine.block_hash import hash_request_tokens
from services.router.instances import Instance
from services.router.kv_index import KvIndex


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may look at: the prompt (hashed into blocks by kv_aware, with the request's
    cache salt), and an instance to prefer when it is a candidate (conditional disaggregation
    decided for that decode instance)."""
    request_id: str
    role: str
    prompt_token_ids: Sequence[int]
    cache_salt: str | None = None
    prefer: str | None = None  # an instance address
    lora: tuple | None = None  # the LoRA adapter's prefix-cache key (engine.block_hash.lora_key)
    # Tokens the request may generate on the instance (max_tokens; one on a prefill instance):
    # an engine's outstanding tokens count them, so the load added until its next report does.
    max_new_tokens: int = 0


class RoutingPolicy(abc.ABC):
    """Chooses one of `candidates` (the healthy instances of the request's role, never empty)."""

    name: str = ""
    # True: the pool polls every instance's GetLoad report for this policy.
    needs_load_reports: bool = False

    def select(self, candidates: Sequence[Instance], request: RouteRequest) -> Instance:
        if request.prefer is not None:
            for inst in candidates:
                if inst.address == request.prefer:
                    return inst
        return self.choose(candidates, request)

    @abc.abstractmethod
    def choose(self, candidates: Sequence[Instance], request: RouteRequest) -> Instance:
        ...

    def uncached_tokens(self, inst: Instance, request: RouteRequest) -> int | None:
        """Prompt tokens the instance would still compute, if the policy knows its cache."""
        return None

    def knows_caches(self, instances: Sequence[Instance]) -> bool:
        """True when the policy sees the prefix cache of one of `instances` at least."""
        return False

    def added_load(self, inst: Instance, request: RouteRequest) -> int:
        """Tokens of work routing the request adds to the instance until a load report shows it,
        counted as the engine counts its outstanding tokens: prompt plus tokens to generate."""
        return len(request.prompt_token_ids) + request.max_new_tokens


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counters = {"prefill": itertools.count(), "decode": itertools.count()}

    def choose(self, candidates: Sequence[Instance], request: RouteRequest) -> Instance:
        return candidates[next(self._counters[request.role]) % len(candidates)]


class LeastLoad(RoutingPolicy):
    """Fewest outstanding tokens: the last GetLoad report plus what was routed since it.

    Ties (an idle fleet) rotate, so equal instances share the work.
    """

    name = "least_load"
    needs_load_reports = True

    def __init__(self) -> None:
        self._tiebreak = RoundRobin()

    def choose(self, candidates: Sequence[Instance], request: RouteRequest) -> Instance:
        lowest = min(i.load_score for i in candidates)
        best = [i for i in candidates if i.load_score == lowest]
        return best[0] if len(best) == 1 else self._tiebreak.choose(best, request)


# The default weight of a prompt's uncached tokens against load (Dynamo's is 1): a prefix computed
# again costs its tokens twice, as this request's compute and as load ahead of the instance's later
# requests, besides a second cached copy that evicts other prefixes (docs/routing.md, "Why 2").
OVERLAP_WEIGHT = 2.0


class KvAware(RoutingPolicy):
    """The instance of least cost, as NVIDIA Dynamo's KV router, counted in tokens:

        cost(i) = overlap_weight * (prompt tokens - tokens of the prompt's leading blocks i caches)
                  + load(i)   (outstanding tokens i reported, plus tokens routed to it since)

    Cached blocks come from the KV index (the engines' KV events), weighted down where the
    instance's event stream has an unreplayed gap. temperature 0 takes the least cost (ties
    rotate); above 0 samples softmax(-normalised cost / temperature), spreading near-ties.
    """

    name = "kv_aware"
    needs_load_reports = True

    def __init__(self, index: KvIndex, overlap_weight: float = OVERLAP_WEIGHT, temperature: float = 0.0,
                 rng: random.Random | None = None) -> None:
        self.index = index
        self.overlap_weight = overlap_weight
        self.temperature = temperature
        self._rng = rng or random.Random()
        self._tiebreak = RoundRobin()

    def knows_caches(self, instances: Sequence[Instance]) -> bool:
        return any(self.index.block_size(i.address) for i in instances)

    def uncached_tokens(self, inst: Instance, request: RouteRequest) -> int | None:
        n = len(request.prompt_token_ids)
        block_size = self.index.block_size(inst.address)
        if not block_size:
            return None
        hashes = hash_request_tokens(request.prompt_token_ids, block_size, request.cache_salt, lora=request.lora)
        return max(0, round(n - self.index.matched_tokens(inst.address, hashes)))

    def added_load(self, inst: Instance, request: RouteRequest) -> int:
        uncached = self.uncached_tokens(inst, request)  # the cached part is no work for the instance
        return (len(request.prompt_token_ids) if uncached is None else uncached) + request.max_new_tokens

    def costs(self, candidates: Sequence[Instance], request: RouteRequest) -> list[float]:
        hashes_by_size: dict[int, list[bytes]] = {}
        n = len(request.prompt_token_ids)
        out = []
        for inst in candidates:
            block_size = self.index.block_size(inst.address)
            matched = 0.0
            if block_size:
                if block_size not in hashes_by_size:
                    hashes_by_size[block_size] = hash_request_tokens(request.prompt_token_ids, block_size,
                                                                     request.cache_salt, lora=request.lora)
                matched = self.index.matched_tokens(inst.address, hashes_by_size[block_size])
            out.append(self.overlap_weight * (n - matched) + inst.load_score)
        return out

    def choose(self, candidates: Sequence[Instance], request: RouteRequest) -> Instance:
        costs = self.costs(candidates, request)
        lowest, highest = min(costs), max(costs)
        if self.temperature <= 0 or highest == lowest:
            best = [i for i, c in zip(candidates, costs) if c == lowest]
            return best[0] if len(best) == 1 else self._tiebreak.choose(best, request)
        weights = [math.exp(-((c - lowest) / (highest - lowest)) / self.temperature) for c in costs]
        return self._rng.choices(list(candidates), weights)[0]


class Auto(KvAware):
    """kv_aware where the candidates publish KV events, round robin where none does."""

    name = "auto"

    def choose(self, candidates: Sequence[Instance], request: RouteRequest) -> Instance:
        if self.knows_caches(candidates):
            return super().choose(candidates, request)
        return self._tiebreak.choose(candidates, request)


POLICIES = {p.name: p for p in (RoundRobin, LeastLoad, KvAware, Auto)}


def make_policy(name: str, index: KvIndex | None = None, **kv_options) -> RoutingPolicy:
    """kv_aware and auto need the KV index (kv_options: overlap_weight, temperature)."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    if issubclass(POLICIES[name], KvAware):
        return POLICIES[name](index if index is not None else KvIndex(), **kv_options)
    return POLICIES[name]()
