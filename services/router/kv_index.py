"""The router's KV index: which instance caches which prefix block, kept from the engines' KV events.

Every instance whose GetLoad report advertises a KV events endpoint gets a subscription (SUB on its
PUB socket, DEALER on its replay socket); an instance that leaves the pool, or whose endpoint
changes, loses it and its entries. Batches apply in sequence order:
- a sequence number past the next expected one is a gap: the missing batches are replayed;
- what replay cannot give back (dropped at the engine's queue, or aged out of its buffer) is an
  unreplayed gap: the instance's entries stored before it may have been evicted since, so they
  count with `low_confidence_weight` until they are stored again;
- a new epoch (the engine restarted) drops the instance's entries and replays the new epoch;
- when a stream is quiet, a replay from the next sequence number every `resync_interval_s` picks up
  anything the SUB socket missed, so the index converges once the fleet goes quiet.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.kv_events import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


def resolve_endpoint(endpoint: str, instance_address: str) -> str:
    """An advertised endpoint with a wildcard host (what a pod binds) names the instance's own host."""
    scheme, sep, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if not sep or host not in WILDCARD_HOSTS:
        return endpoint
    inst_host = instance_address.rpartition(":")[0]
    return f"{scheme}://{inst_host}:{port}"


@dataclass
class InstanceStream:
    """One instance's event stream as the index has applied it."""
    address: str
    endpoint: str
    replay_endpoint: str
    epoch: int
    report_epoch: int = 0  # the epoch the instance's last GetLoad report gave
    next_seq: int = 0
    gap_seq: int | None = None  # the latest unreplayed gap: entries stored before it are uncertain
    block_size: int = 0
    blocks: dict[bytes, int] = field(default_factory=dict)  # hash -> seq of the batch that stored it
    last_update: float = field(default_factory=time.monotonic)  # last batch applied or replay answered
    gaps_replayed: int = 0
    gaps_lost: int = 0
    epoch_changes: int = 0
    task: asyncio.Task | None = None
    replay_socket: object | None = None  # DEALER to the replay endpoint, while followed

    def weight(self, block_hash: bytes, low_confidence_weight: float) -> float | None:
        seq = self.blocks.get(block_hash)
        if seq is None:
            return None
        return low_confidence_weight if self.gap_seq is not None and seq < self.gap_seq else 1.0


class KvIndex:
    """block hash -> instances, per instance stream state, and the subscriptions that feed them."""

    def __init__(self, *, low_confidence_weight: float = 0.5, resync_interval_s: float = 1.0,
                 replay_timeout_s: float = 2.0) -> None:
        self.low_confidence_weight = low_confidence_weight
        self.resync_interval_s = resync_interval_s
        self.replay_timeout_s = replay_timeout_s
        self.streams: dict[str, InstanceStream] = {}
        self.holders: dict[bytes, set[str]] = {}  # block hash -> addresses of instances caching it
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._ctx = None

    # -- what routing asks -----------------------------------------------------------------
    def matched_tokens(self, address: str, hashes: list[bytes]) -> float:
        """Tokens of the request's leading blocks the instance caches, each weighted by confidence."""
        stream = self.streams.get(address)
        if stream is None or not stream.block_size:
            return 0.0
        total = 0.0
        for block_hash in hashes:
            w = stream.weight(block_hash, self.low_confidence_weight)
            if w is None:
                break
            total += w * stream.block_size
        return total

    def block_size(self, address: str) -> int:
        stream = self.streams.get(address)
        return stream.block_size if stream is not None else 0

    # -- applying batches (pure: the tests drive it directly) --------------------------------
    def add_stream(self, address: str, endpoint: str, replay_endpoint: str, epoch: int,
                   block_size: int = 0) -> InstanceStream:
        self.drop_stream(address)
        stream = self.streams[address] = InstanceStream(address, endpoint, replay_endpoint, epoch, epoch,
                                                        block_size=block_size)
        return stream

    def drop_stream(self, address: str) -> None:
        stream = self.streams.pop(address, None)
        if stream is None:
            return
        self._clear(stream)
        if stream.task is not None:
            stream.task.cancel()

    def apply(self, stream: InstanceStream, seq: int, batch: KVEventBatch) -> bool:
        """Applies a batch in order; False when batches before it are missing (replay them first)."""
        if batch.epoch != stream.epoch:
            self.restart(stream, batch.epoch)
        if seq < stream.next_seq:
            return True  # already applied (live and replayed copies of one batch)
        if seq > stream.next_seq:
            return False
        for event in batch.events:
            if isinstance(event, BlockStored):
                stream.block_size = event.block_size
                for block_hash in event.block_hashes:
                    stream.blocks[block_hash] = seq
                    self.holders.setdefault(block_hash, set()).add(stream.address)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._forget(stream, block_hash)
            elif isinstance(event, AllBlocksCleared):
                self._clear(stream)
        stream.next_seq = seq + 1
        stream.last_update = time.monotonic()
        return True

    def lost_gap(self, stream: InstanceStream, seq: int) -> None:
        """Batches before `seq` are gone for good: what was stored before them is uncertain."""
        logger.warning("KV index: %s lost event batches %d..%d (not in its replay buffer); its older "
                       "entries count with weight %.2f until stored again", stream.address, stream.next_seq,
                       seq - 1, self.low_confidence_weight)
        stream.gap_seq = seq
        stream.next_seq = seq
        stream.gaps_lost += 1

    def restart(self, stream: InstanceStream, epoch: int) -> None:
        logger.info("KV index: %s has a new epoch (%d -> %d): the engine restarted, its entries are dropped",
                    stream.address, stream.epoch, epoch)
        self._clear(stream)
        stream.epoch, stream.next_seq, stream.gap_seq = epoch, 0, None
        stream.epoch_changes += 1

    def _forget(self, stream: InstanceStream, block_hash: bytes) -> None:
        if stream.blocks.pop(block_hash, None) is None:
            return
        holders = self.holders.get(block_hash)
        if holders is not None:
            holders.discard(stream.address)
            if not holders:
                del self.holders[block_hash]

    def _clear(self, stream: InstanceStream) -> None:
        for block_hash in list(stream.blocks):
            self._forget(stream, block_hash)
        stream.gap_seq = None

    # -- subscriptions -------------------------------------------------------------------------
    def sync(self, instances) -> None:
        """Follows the pool: subscribes to instances that advertise events, drops those gone."""
        wanted = {}
        for inst in instances:
            report = inst.load
            if inst.draining or report is None or not report.kv_events_endpoint:
                continue
            wanted[inst.address] = (resolve_endpoint(report.kv_events_endpoint, inst.address),
                                    resolve_endpoint(report.kv_events_replay_endpoint, inst.address)
                                    if report.kv_events_replay_endpoint else "",
                                    report.kv_events_epoch, report.block_size)
        for address in [a for a in self.streams if a not in wanted]:
            logger.info("KV index: %s left the pool; its entries are dropped", address)
            self.drop_stream(address)
        for address, (endpoint, replay, epoch, block_size) in wanted.items():
            stream = self.streams.get(address)
            if stream is not None and (stream.endpoint, stream.replay_endpoint) == (endpoint, replay):
                if epoch != stream.report_epoch:  # a restart GetLoad shows before any batch of it
                    stream.report_epoch = epoch
                    if epoch != stream.epoch:
                        self.restart(stream, epoch)
                continue
            stream = self.add_stream(address, endpoint, replay, epoch, block_size)
            logger.info("KV index: following %s's KV events at %s (replay %s)", address, endpoint, replay or "none")
            stream.task = asyncio.get_running_loop().create_task(self._follow(stream))

    async def close(self) -> None:
        tasks = [s.task for s in self.streams.values() if s.task is not None]
        for address in list(self.streams):
            self.drop_stream(address)
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def _context(self):
        import zmq.asyncio

        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return self._ctx

    async def _follow(self, stream: InstanceStream) -> None:
        import zmq

        sub = self._context().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(stream.endpoint)
        try:
            await self._catch_up(stream)  # the history before this subscription
            while True:
                if not await sub.poll(int(self.resync_interval_s * 1000)):
                    await self._catch_up(stream)  # quiet: anything the SUB socket missed?
                    continue
                _, seq_bytes, payload = await sub.recv_multipart()
                seq, batch = int.from_bytes(seq_bytes, "big"), self._decoder.decode(payload)
                if not self.apply(stream, seq, batch):
                    lost = stream.gaps_lost
                    await self._catch_up(stream)
                    if stream.next_seq < seq and batch.epoch == stream.epoch:
                        self.lost_gap(stream, seq)  # no replay socket, or it did not answer
                    if stream.gaps_lost == lost:
                        stream.gaps_replayed += 1
                    self.apply(stream, seq, batch)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("KV index: following %s failed; its entries are dropped", stream.address)
            self._clear(stream)
        finally:
            sub.close(linger=0)
            self._close_replay(stream)

    def _close_replay(self, stream: InstanceStream) -> None:
        if stream.replay_socket is not None:
            stream.replay_socket.close(linger=0)
            stream.replay_socket = None

    async def _catch_up(self, stream: InstanceStream) -> None:
        """Replays from the next expected seq; a replay that starts past it is a lost gap."""
        import zmq

        if not stream.replay_endpoint:
            return
        if stream.replay_socket is None:
            stream.replay_socket = self._context().socket(zmq.DEALER)
            stream.replay_socket.connect(stream.replay_endpoint)
        for _ in range(2):  # twice when the replay shows a new epoch: then from its start
            try:
                batches = await self._replay(stream.replay_socket, stream.next_seq)
            except asyncio.TimeoutError:
                # What it still sends belongs to this request: a new socket leaves it behind.
                logger.warning("KV index: %s's replay stalled for %.1fs", stream.address, self.replay_timeout_s)
                self._close_replay(stream)
                return
            stream.last_update = time.monotonic()
            for seq, batch in batches:
                if batch.epoch != stream.epoch:
                    self.restart(stream, batch.epoch)
                    break
                if not self.apply(stream, seq, batch):
                    self.lost_gap(stream, seq)
                    self.apply(stream, seq, batch)
            else:
                return

    async def _replay(self, sock, start: int) -> list[tuple[int, KVEventBatch]]:
        await sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            _, _, seq_bytes, payload = await asyncio.wait_for(sock.recv_multipart(), self.replay_timeout_s)
            if seq_bytes == END_SEQ:
                return out
            out.append((int.from_bytes(seq_bytes, "big"), self._decoder.decode(payload)))

    # -- metrics ---------------------------------------------------------------------------------
    def collect(self):
        """Prometheus collector: size, staleness and stream health per instance."""
        now = time.monotonic()
        blocks = GaugeMetricFamily("pdserve:router_kv_index_blocks", "Blocks the KV index holds per instance.",
                                   labels=["instance"])
        stale = GaugeMetricFamily("pdserve:router_kv_index_staleness_seconds",
                                  "Seconds since the instance's events were last applied or checked by replay.",
                                  labels=["instance"])
        uncertain = GaugeMetricFamily("pdserve:router_kv_index_unreplayed_gap",
                                      "1 while the instance has an unreplayed gap (older entries count less).",
                                      labels=["instance"])
        gaps = CounterMetricFamily("pdserve:router_kv_index_gaps", "Sequence gaps, by outcome.",
                                   labels=["instance", "outcome"])
        epochs = CounterMetricFamily("pdserve:router_kv_index_epoch_changes",
                                     "Engine restarts seen through a new epoch.", labels=["instance"])
        for address, s in self.streams.items():
            blocks.add_metric([address], len(s.blocks))
            stale.add_metric([address], now - s.last_update)
            uncertain.add_metric([address], 1 if s.gap_seq is not None else 0)
            gaps.add_metric([address, "replayed"], s.gaps_replayed)
            gaps.add_metric([address, "lost"], s.gaps_lost)
            epochs.add_metric([address], s.epoch_changes)
        total = GaugeMetricFamily("pdserve:router_kv_index_size", "Distinct block hashes in the KV index.")
        total.add_metric([], len(self.holders))
        yield from (blocks, stale, uncertain, gaps, epochs, total)

    async def run_sync(self, pool, interval_s: float) -> None:
        """Keeps the subscriptions in step with the pool (its load reports carry the endpoints)."""
        while True:
            try:
                self.sync(pool.instances("prefill") + pool.instances("decode"))
            except Exception:  # the loop must live on; say why once per failure
                logger.exception("KV index: syncing subscriptions failed")
            await asyncio.sleep(interval_s)
