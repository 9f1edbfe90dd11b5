"""KV events through real ZMQ sockets: vLLM's wire shape, sequence numbers, replay, bounded buffer,
drops counted as gaps, epochs, and an engine publishing what its prefix cache holds."""
from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from engine.block_hash import hash_request_tokens
from engine.kv_events import (END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventsConfig,
                              ZmqEventPublisher)

DECODER = msgspec.msgpack.Decoder(KVEventBatch)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def make_publisher(**kw) -> ZmqEventPublisher:
    fields = dict(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                  topic="kv")
    fields.update(kw)
    return ZmqEventPublisher(KVEventsConfig(**fields))


def subscribe(ctx, pub: ZmqEventPublisher) -> zmq.Socket:
    """A SUB socket that is surely connected: publishes probes until one arrives (PUB drops what it
    sends before a subscriber has joined; that is what replay is for)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    deadline = time.monotonic() + 10
    while not sub.poll(50):
        assert time.monotonic() < deadline, "SUB never connected"
        pub.publish([AllBlocksCleared()])
    while sub.poll(100):
        sub.recv_multipart()
    return sub


def recv(sub: zmq.Socket, timeout_ms: int = 5000) -> tuple[bytes, int, KVEventBatch]:
    assert sub.poll(timeout_ms), "no batch arrived"
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big"), DECODER.decode(payload)


def replay(ctx, pub: ZmqEventPublisher, start: int) -> list[tuple[int, KVEventBatch]]:
    sock = ctx.socket(zmq.DEALER)
    sock.connect(pub.replay_endpoint)
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    while True:
        assert sock.poll(5000), "replay did not answer"
        _, topic, seq, payload = sock.recv_multipart()
        if seq == END_SEQ:
            sock.close(linger=0)
            return out
        assert topic == pub.topic
        out.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))


def stored(hashes: list[bytes], tokens: list[int]) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=4, lora_id=None,
                       medium="GPU", lora_name=None)


def test_wire_format_is_vllms(ctx):
    pub = make_publisher()
    try:
        sub = subscribe(ctx, pub)
        pub.publish([stored([b"\x01" * 32], [1, 2, 3, 4]), BlockRemoved(block_hashes=[b"\x02" * 32], medium="GPU")])
        assert sub.poll(5000)
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        raw = msgspec.msgpack.decode(payload)  # no types: the shape an outside indexer sees
        ts, events, rank, epoch = raw
        assert isinstance(ts, float) and rank == 0 and epoch == pub.epoch
        assert events[0] == {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
                             "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None, "medium": "GPU",
                             "lora_name": None}
        assert events[1] == {"type": "BlockRemoved", "block_hashes": [b"\x02" * 32], "medium": "GPU"}

        class VllmBatch(msgspec.Struct, array_like=True):  # vLLM's own decoder ignores the epoch
            ts: float
            events: list
            data_parallel_rank: int | None = None
        assert msgspec.msgpack.decode(payload, type=VllmBatch).data_parallel_rank == 0
    finally:
        pub.shutdown()


def test_sequence_numbers_increase_and_replay_serves_from_a_start(ctx):
    pub = make_publisher()
    try:
        sub = subscribe(ctx, pub)
        first = pub.last_seq + 1
        for i in range(5):
            pub.publish([stored([bytes([i]) * 32], [i] * 4)])
        seqs = [recv(sub)[1] for _ in range(5)]
        assert seqs == list(range(first, first + 5))
        got = replay(ctx, pub, first + 2)
        assert [s for s, _ in got] == [first + 2, first + 3, first + 4]
        assert [b.events[0].token_ids for _, b in got] == [[2] * 4, [3] * 4, [4] * 4]
        assert replay(ctx, pub, first + 100) == []  # nothing that new: only the end marker
    finally:
        pub.shutdown()


def test_replay_buffer_is_bounded(ctx):
    pub = make_publisher(buffer_steps=3)
    try:
        for i in range(10):
            pub.publish([stored([bytes([i]) * 32], [i] * 4)])
        deadline = time.monotonic() + 5
        while pub.batches_published < 10:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert [s for s, _ in replay(ctx, pub, 0)] == [7, 8, 9]
    finally:
        pub.shutdown()


def test_a_full_queue_drops_batches_and_leaves_a_visible_gap(ctx):
    pub = make_publisher(max_queue_size=1, buffer_steps=100_000)
    try:
        sub = subscribe(ctx, pub)
        start = pub.last_seq + 1
        total = 5000
        for i in range(total):
            pub.publish([stored([i.to_bytes(32, "big")], [i % 7] * 4)])
        assert pub.batches_dropped > 0 and pub.events_dropped == pub.batches_dropped
        deadline = time.monotonic() + 10
        while pub.batches_published + pub.batches_dropped < total + start:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        seqs = []
        while sub.poll(200):
            seqs.append(int.from_bytes(sub.recv_multipart()[1], "big"))
        assert len(seqs) == total - pub.batches_dropped
        # Every dropped batch is a hole in the sequence a subscriber sees (however the publisher's
        # thread was scheduled: on a busy machine nearly all of them may drop).
        assert seqs == sorted(seqs) and set(seqs) <= set(range(start, start + total))
        assert len(set(range(start, start + total)) - set(seqs)) == pub.batches_dropped
        assert pub.stats()["kv_events_dropped"] == pub.events_dropped
    finally:
        pub.shutdown()


def test_each_publisher_has_its_own_epoch():
    a, b = make_publisher(), make_publisher()
    try:
        assert a.epoch != b.epoch and a.epoch > 0
    finally:
        a.shutdown()
        b.shutdown()


def test_config_is_checked():
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig(publisher="kafka")
    with pytest.raises(ValueError, match="buffer_steps"):
        KVEventsConfig(buffer_steps=0)
    with pytest.raises(ValueError, match="endpoint"):
        KVEventsConfig(endpoint="localhost:5557")
    assert not KVEventsConfig().active and KVEventsConfig(enable_kv_cache_events=True).active


def test_engine_publishes_what_its_prefix_cache_holds(ctx, tiny_llama):
    """A real engine core: its epoch opens with AllBlocksCleared; the blocks of a prompt arrive as
    BlockStored with the hashes anyone computes from the token ids; eviction sends BlockRemoved."""
    from engine.engine_core import EngineCore
    from engine.config import EngineConfig
    from engine.request import Request, SamplingParams

    config = EngineConfig.create(tiny_llama, device="cpu", block_size=4, num_blocks=12,
                                 kv_events=dict(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0",
                                                replay_endpoint="tcp://127.0.0.1:0"))
    core = EngineCore(config)
    try:
        pub = core.kv_event_publisher
        assert replay(ctx, pub, 0)[0][1].events == [AllBlocksCleared()]

        def run(rid: str, prompt: list[int], salt: str | None = None) -> None:
            core.add_request(Request(rid, prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                                 cache_salt=salt)))
            while core.has_work():
                core.step()

        held: set[bytes] = set()

        def apply_all() -> None:
            deadline = time.monotonic() + 5
            while pub.batches_published < pub.last_seq + 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            held.clear()
            for _, batch in replay(ctx, pub, 0):
                for e in batch.events:
                    if isinstance(e, BlockStored):
                        held.update(e.block_hashes)
                    elif isinstance(e, BlockRemoved):
                        held.difference_update(e.block_hashes)
                    else:
                        held.clear()

        prompt = list(range(10, 30))
        run("a", prompt, salt="t1")
        apply_all()
        assert set(hash_request_tokens(prompt, 4, "t1")) <= held
        assert held == set(core.kv_cache_manager.block_pool.cached)
        run("b", list(range(500, 540)))  # 10+ blocks of a 12-block cache: evicts the first prompt's
        apply_all()
        assert held == set(core.kv_cache_manager.block_pool.cached)
        assert not set(hash_request_tokens(prompt, 4, "t1")) <= held
        assert core.stats()["kv_events_epoch"] == pub.epoch and core.stats()["kv_events_dropped"] == 0
    finally:
        core.shutdown()
