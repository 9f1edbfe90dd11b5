"""Routing policies: which prefill or decode instance serves a request."""
from __future__ import annotations

import abc
import itertools
from dataclasses import dataclass
from typing import Sequence

from services.router.instances import Instance


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may look at. Prefix-aware routing will hash `prompt_token_ids` into blocks."""
    request_id: str
    role: str
    prompt_token_ids: Sequence[int]


class RoutingPolicy(abc.ABC):
    """Chooses one of `candidates` (the healthy instances of the request's role, never empty)."""

    name: str = ""
    # True: the pool polls every instance's GetLoad report for this policy.
    needs_load_reports: bool = False

    @abc.abstractmethod
    def select(self, candidates: Sequence[Instance], request: RouteRequest) -> Instance:
        ...


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counters = {"prefill": itertools.count(), "decode": itertools.count()}

    def select(self, candidates: Sequence[Instance], request: RouteRequest) -> Instance:
        return candidates[next(self._counters[request.role]) % len(candidates)]


class LeastLoad(RoutingPolicy):
    """Fewest outstanding tokens: the last GetLoad report plus what was routed since it.

    Ties (an idle fleet) rotate, so equal instances share the work.
    """

    name = "least_load"
    needs_load_reports = True

    def __init__(self) -> None:
        self._tiebreak = RoundRobin()

    def select(self, candidates: Sequence[Instance], request: RouteRequest) -> Instance:
        lowest = min(i.load_score for i in candidates)
        best = [i for i in candidates if i.load_score == lowest]
        return best[0] if len(best) == 1 else self._tiebreak.select(best, request)


POLICIES = {p.name: p for p in (RoundRobin, LeastLoad)}


def make_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}") from None
