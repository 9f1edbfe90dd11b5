"""Head routing between tensor-parallel engines: which prefill rank each decode rank pulls which
KV heads from, and which decode ranks end each prefill rank's lease."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kvtransfer.errors import LayoutMismatch, ProtocolError
from kvtransfer.handle import KVHandle, KVShardRef
from kvtransfer.layout import KVLayout, KVShard, shard_heads


@dataclass(frozen=True)
class HeadSource:
    """Global KV heads [head_start, head_end) that a decode rank pulls from prefill rank `prefill_rank`."""
    prefill_rank: int
    head_start: int
    head_end: int


def _holders(total_kv_heads: int, tp_size: int, head: int) -> range:
    """The ranks of a tp_size engine that hold global head `head` (several when replicated)."""
    if total_kv_heads % tp_size == 0:
        rank = head // (total_kv_heads // tp_size)
        return range(rank, rank + 1)
    replicas = tp_size // total_kv_heads
    return range(head * replicas, (head + 1) * replicas)


@lru_cache(maxsize=256)
def plan_sources(total_kv_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int) -> tuple[HeadSource, ...]:
    """Where decode rank `decode_rank` gets each of its heads: exactly one prefill rank per head
    (a replicated head is taken from replica decode_rank % replicas, spreading the reads), runs of
    heads from one rank merged. Raises ValueError when either TP size cannot split the heads."""
    shard_heads(total_kv_heads, prefill_tp, 0)  # validates the prefill's split too
    start, end = shard_heads(total_kv_heads, decode_tp, decode_rank)
    sources: list[HeadSource] = []
    for head in range(start, end):
        holders = _holders(total_kv_heads, prefill_tp, head)
        rank = holders[decode_rank % len(holders)]
        if sources and sources[-1].prefill_rank == rank and sources[-1].head_end == head:
            sources[-1] = HeadSource(rank, sources[-1].head_start, head + 1)
        else:
            sources.append(HeadSource(rank, head, head + 1))
    return tuple(sources)


@lru_cache(maxsize=256)
def release_ranks(total_kv_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int) -> tuple[int, ...]:
    """The prefill ranks whose lease decode rank `decode_rank` ends: those it pulls from, and any
    replica nobody pulls from (it falls to the first decode rank holding its heads), so that no
    prefill rank keeps its blocks until the lease expires."""
    mine = {s.prefill_rank for s in plan_sources(total_kv_heads, prefill_tp, decode_tp, decode_rank)}
    pulled = {s.prefill_rank for k in range(decode_tp)
              for s in plan_sources(total_kv_heads, prefill_tp, decode_tp, k)}
    for rank in set(range(prefill_tp)) - pulled:
        head = shard_heads(total_kv_heads, prefill_tp, rank)[0]
        if min(_holders(total_kv_heads, decode_tp, head)) == decode_rank:
            mine.add(rank)
    return tuple(sorted(mine))


@lru_cache(maxsize=256)
def release_consumers(total_kv_heads: int, prefill_tp: int, decode_tp: int, prefill_rank: int) -> frozenset[int]:
    """The decode ranks that must each release prefill rank `prefill_rank`'s lease before its
    blocks are freed (the inverse of release_ranks)."""
    return frozenset(j for j in range(decode_tp)
                     if prefill_rank in release_ranks(total_kv_heads, prefill_tp, decode_tp, j))


def lease_releasers(layout: KVLayout, decode_rank: int, decode_tp: int) -> frozenset[int]:
    """The decode ranks of a TP=decode_tp decode that must each release prefill rank
    `layout.shard`'s lease; ProtocolError for a decode that cannot split the model's heads."""
    if not 0 <= decode_rank < decode_tp:
        raise ProtocolError(f"decode rank {decode_rank} of {decode_tp} is not a rank")
    try:
        return release_consumers(layout.total_kv_heads, layout.tp_size, decode_tp, layout.tp_rank)
    except ValueError as e:
        raise ProtocolError(f"a TP={decode_tp} decode cannot pull from this prefill: {e}") from None


def local_heads(shard: KVShard, head_start: int, head_end: int) -> tuple[int, int] | None:
    """Global heads [head_start, head_end) as a range of the shard's cache (None: all of it);
    ProtocolError when they are not all in the shard."""
    if not shard.head_start <= head_start < head_end <= shard.head_end:
        raise ProtocolError(f"KV heads [{head_start}, {head_end}) are outside this prefill rank's shard "
                            f"[{shard.head_start}, {shard.head_end}) (rank {shard.tp_rank} of {shard.tp_size})")
    local = (head_start - shard.head_start, head_end - shard.head_start)
    return None if local == (0, shard.num_heads) else local


@dataclass(frozen=True)
class PullSource:
    """One prefill rank a decode rank deals with for a request: it pulls global heads
    [head_start, head_end) from it (`pulls`), or only releases its lease (a replica nobody reads).
    `heads` / `remote_heads` are the same heads in the decode's / the prefill rank's cache
    (None: the whole cache's heads, which keeps today's whole-block path)."""
    ref: KVShardRef
    head_start: int
    head_end: int
    heads: tuple[int, int] | None
    remote_heads: tuple[int, int] | None
    pulls: bool = True

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start


def plan_pull(layout: KVLayout, handle: KVHandle) -> tuple[PullSource, ...]:
    """The prefill ranks decode rank `layout.shard` pulls from (in rank order), then those it only
    releases. Raises ProtocolError for a handle that does not describe a whole TP prefill (a
    rank's own handle, not merged) and LayoutMismatch when the two TP sizes cannot split the
    model's heads. A TP=1 handle (no shards) is one shard holding every head."""
    total = layout.total_kv_heads
    refs = handle.shards or (KVShardRef(0, 1, handle.endpoint, 0, total, handle.engine_id, handle.tag),)
    prefill_tp = refs[0].tp_size
    if [r.rank for r in refs] != list(range(prefill_tp)) or any(r.tp_size != prefill_tp for r in refs):
        raise ProtocolError(f"handle of {handle.request_id!r} names ranks {[r.rank for r in refs]} of a "
                            f"TP={prefill_tp} prefill, not all of them (merge_shard_handles makes the handle)")
    try:
        for ref in refs:
            if (ref.head_start, ref.head_end) != shard_heads(total, prefill_tp, ref.rank):
                raise ProtocolError(f"handle gives prefill rank {ref.rank} of {prefill_tp} heads "
                                    f"[{ref.head_start}, {ref.head_end}), not its shard of {total}")
        sources = plan_sources(total, prefill_tp, layout.tp_size, layout.tp_rank)
        releases = release_ranks(total, prefill_tp, layout.tp_size, layout.tp_rank)
    except ValueError as e:
        raise LayoutMismatch(f"prefill TP={prefill_tp} and decode TP={layout.tp_size} cannot exchange KV: {e}") from None
    first = layout.shard.head_start
    plan = []
    for s in sources:
        ref = refs[s.prefill_rank]
        local = (s.head_start - first, s.head_end - first)
        remote = (s.head_start - ref.head_start, s.head_end - ref.head_start)
        plan.append(PullSource(ref, s.head_start, s.head_end, None if local == (0, layout.num_kv_heads) else local,
                               None if remote == (0, ref.head_end - ref.head_start) else remote))
    pulled = {s.prefill_rank for s in sources}
    plan += [PullSource(refs[r], 0, 0, None, None, pulls=False) for r in releases if r not in pulled]
    return tuple(plan)
