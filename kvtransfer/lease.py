"""Lease table: which blocks the prefill side keeps pinned for whom, and until when."""
from __future__ import annotations

import hmac
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvtransfer.errors import AuthError, LeaseExpired, ProtocolError, UnknownRequest

RELEASED, EXPIRED, ABORTED = "released", "expired", "aborted"


@dataclass
class Lease:
    request_id: str
    block_ids: tuple[int, ...]
    tag: bytes
    expiry: float  # on the table's monotonic clock; publish and extend set it
    pins: dict[int, float] = field(default_factory=dict)  # transfer id -> its deadline
    ending: str | None = None  # released or aborted while a transfer was still reading the blocks
    releasers: frozenset[int] | None = None  # who must release (decode ranks); set by the first release
    released_by: set[int] = field(default_factory=set)

    def ends_at(self) -> float:
        """A transfer in progress keeps the blocks until it ends or its deadline passes, not longer."""
        pinned = max(self.pins.values(), default=0.0)
        return pinned if self.ending else max(self.expiry, pinned)


@dataclass(frozen=True)
class FreedBlocks:
    """Blocks the owner may return to its pool; `reason` is released, expired or aborted."""
    request_id: str
    block_ids: tuple[int, ...]
    reason: str


class LeaseTable:
    """Thread-safe: network threads pull/release, the engine thread publishes/aborts/drains.

    Freed blocks are queued, never handed back from a network thread: the owner drains them
    on its own loop (`drain_freed`), so its block pool needs no lock. Blocks being read by a
    transfer (pinned) are never freed under it: a release or abort then takes effect when the
    transfer ends, or at its deadline. So a transfer that completes in time read valid blocks,
    and no extra round trip is needed to confirm it.
    """

    def __init__(self, default_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        if default_ttl_s <= 0:
            raise ValueError("lease ttl must be positive")
        self.default_ttl_s = default_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._freed: list[FreedBlocks] = []
        self.counters = {"published": 0, RELEASED: 0, EXPIRED: 0, ABORTED: 0}

    def add(self, request_id: str, block_ids: tuple[int, ...], tag: bytes,
            ttl_s: float | None = None) -> Lease:
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        if ttl <= 0:
            raise ValueError("lease ttl must be positive")
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already has published blocks")
            lease = Lease(request_id, tuple(block_ids), tag, self._clock() + ttl)
            self._leases[request_id] = lease
            self.counters["published"] += 1
            return lease

    def _live(self, request_id: str, tag: bytes) -> Lease:
        """The caller holds the lock. An expired lease is freed here, on first touch."""
        lease = self._leases.get(request_id)
        if lease is None:
            raise UnknownRequest(f"no published blocks for request {request_id!r} (freed or never published)")
        if not hmac.compare_digest(lease.tag, tag):
            raise AuthError(f"handle for request {request_id!r} is not the one this lease was issued with")
        if lease.ending:
            raise UnknownRequest(f"blocks of request {request_id!r} were {lease.ending}")
        if self._clock() >= lease.ends_at():
            self._free(lease, EXPIRED)
            raise LeaseExpired(f"lease of request {request_id!r} expired")
        return lease

    def _end(self, lease: Lease, reason: str) -> None:
        now = self._clock()
        lease.pins = {t: deadline for t, deadline in lease.pins.items() if deadline > now}
        if lease.pins:
            lease.ending = lease.ending or reason
        else:
            self._free(lease, lease.ending or reason)

    def _free(self, lease: Lease, reason: str) -> None:
        del self._leases[lease.request_id]
        self.counters[reason] += 1
        self._freed.append(FreedBlocks(lease.request_id, lease.block_ids, reason))

    def pin(self, request_id: str, tag: bytes, transfer_id: int, seconds: float) -> Lease:
        """Validate for a transfer and keep the blocks at least `seconds` (the transfer's deadline)."""
        with self._lock:
            lease = self._live(request_id, tag)
            lease.pins[transfer_id] = self._clock() + seconds
            return lease

    def unpin(self, request_id: str, transfer_id: int) -> None:
        """The transfer ended (done or failed): the lease is back to its own expiry."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.pins.pop(transfer_id, None)
                if lease.ending:
                    self._end(lease, lease.ending)

    def check(self, request_id: str, tag: bytes) -> Lease:
        with self._lock:
            return self._live(request_id, tag)

    def extend(self, request_id: str, tag: bytes, seconds: float) -> float:
        """Push the expiry to now + seconds; returns the remaining lifetime in seconds."""
        with self._lock:
            lease = self._live(request_id, tag)
            lease.expiry = max(lease.expiry, self._clock() + seconds)
            return lease.expiry - self._clock()

    def release(self, request_id: str, tag: bytes, releaser: int = 0,
                releasers: frozenset[int] = frozenset({0})) -> bool:
        """`releaser` is done with the blocks; they are freed once every one of `releasers` is
        (several decode ranks may each pull a piece of them). Returns whether the lease ended."""
        with self._lock:
            lease = self._live(request_id, tag)
            if lease.releasers is None:
                lease.releasers = frozenset(releasers)
            if releaser not in lease.releasers or lease.releasers != releasers:
                raise ProtocolError(f"request {request_id!r}: release by {releaser} of {sorted(releasers)}, "
                                    f"but the lease waits for {sorted(lease.releasers)}")
            lease.released_by.add(releaser)
            if lease.released_by < lease.releasers:
                return False
            self._end(lease, RELEASED)
            return True

    def abort(self, request_id: str) -> bool:
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None and not lease.ending:
                self._end(lease, ABORTED)
            return lease is not None

    def expire(self) -> int:
        now = self._clock()
        with self._lock:
            expired = [lease for lease in self._leases.values() if now >= lease.ends_at()]
            for lease in expired:
                self._free(lease, lease.ending or EXPIRED)
            return len(expired)

    def drain_freed(self) -> list[FreedBlocks]:
        with self._lock:
            freed, self._freed = self._freed, []
            return freed

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_published_blocks(self) -> int:
        with self._lock:
            return sum(len(lease.block_ids) for lease in self._leases.values())
