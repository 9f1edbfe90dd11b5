"""KV cache events in vLLM's wire format, and the ZMQ publisher the engine core feeds without waiting.

Wire format (as vLLM's `vllm/distributed/kv_events.py`, so its indexers read ours):
- PUB socket, multipart `(topic, seq as 8-byte big-endian, msgpack(KVEventBatch))`;
- KVEventBatch is a msgpack array `[ts, events, data_parallel_rank, epoch]`; each event a map tagged
  `"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"`. `epoch` (trailing, so vLLM's
  decoders ignore it) is random per publisher: it changes when the engine restarts;
- a ROUTER replay socket: a request `(identity, b"", start seq as 8 bytes)` is answered with every
  buffered batch from that seq on, `(identity, b"", topic, seq, payload)`, then the end marker
  `(identity, b"", b"", seq -1, b"")`.
Sequence numbers are taken when the engine hands a batch over: a batch dropped because the queue is
full leaves a hole that subscribers see (and cannot replay), never a silent loss.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import count
from typing import Union

import msgspec

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events (tagged with the class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None  # required, as in vLLM (its decoders need the key)
    # Per block, the extra keys its hash used, untagged as vLLM publishes them: the LoRA adapter's
    # name on every block of an adapter's request, then the cache_salt on a salted request's first
    # block; None for a block with neither; None when no block had any.
    extra_keys: list[tuple | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    epoch: int = 0  # pdserve: changes when the publishing engine restarts


def new_epoch() -> int:
    return int.from_bytes(os.urandom(8), "big") >> 1  # fits msgpack's and protobuf's int64


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's --kv-events-config fields (JSON), with the same defaults."""
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # zmq | null
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # PUB high-water mark (messages ZMQ queues per subscriber before dropping)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread before new ones drop
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv events publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv events {name} must be >= 1")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and "://" not in value:
                raise ValueError(f"kv events {name} must be a ZMQ endpoint like tcp://*:5557, got {value!r}")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


class ZmqEventPublisher:
    """PUB + ROUTER replay over a bounded in-memory buffer, served by one background thread.

    `publish()` is all the engine core's step loop does: number the batch and queue it (never
    blocking; a full queue drops the batch and counts it)."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self.config = config
        self.epoch = new_epoch()
        self.data_parallel_rank = data_parallel_rank
        self.topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self.last_seq = -1
        self.batches_published = 0
        self.batches_dropped = 0
        self.events_dropped = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self.endpoint = self._bind(self._pub, config.endpoint)
        self._replay = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            # A ROUTER drops what exceeds a peer's send queue: room for a whole buffer's replay.
            self._replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 1)
            self.replay_endpoint = self._bind(self._replay, config.replay_endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (replay %s), epoch %d", self.endpoint,
                    self.replay_endpoint or "off", self.epoch)

    @staticmethod
    def _bind(sock, endpoint: str) -> str:
        """Binds; a tcp port 0 becomes the port the OS chose, so it can be advertised."""
        import zmq

        sock.bind(endpoint)
        return sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def publish(self, events: list) -> None:
        seq = next(self._seq)
        self.last_seq = seq
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank,
                             epoch=self.epoch)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.batches_dropped += 1
            self.events_dropped += len(events)

    def stats(self) -> dict:
        return {"kv_events_published": self.batches_published, "kv_events_dropped": self.events_dropped,
                "kv_event_batches_dropped": self.batches_dropped, "kv_events_last_seq": self.last_seq,
                "kv_events_endpoint": self.endpoint, "kv_events_replay_endpoint": self.replay_endpoint or "",
                "kv_events_epoch": self.epoch}

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while self._running or not self._queue.empty():
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=0.01)
            except queue.Empty:
                continue
            seq, batch = item
            payload = encoder.encode(batch)
            seq_bytes = seq.to_bytes(8, "big")
            self._pub.send_multipart((self.topic, seq_bytes, payload))
            self._buffer.append((seq, payload))
            self.batches_published += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: ignoring a malformed replay request (%d frames)", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))

    def shutdown(self) -> None:
        self._running = False  # the thread sends what is queued, then stops
        self._thread.join(timeout=2.0)
        self._ctx.destroy(linger=0)


def make_publisher(config: KVEventsConfig) -> ZmqEventPublisher | None:
    return ZmqEventPublisher(config) if config.active else None
