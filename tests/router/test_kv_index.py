"""The router's KV index against real ZMQ publishers: history on subscribe, live updates, gaps
replayed or lost (lower confidence), epochs, departures, and, after a randomised workload on real
engine cores goes quiet, an index equal to what the engines actually cache."""
from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import pytest

from engine.block_hash import hash_request_tokens
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventsConfig, ZmqEventPublisher
from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.launcher import free_port
from services.router.kv_index import KvIndex, resolve_endpoint

BS = 4


def publisher(port: int = 0, replay_port: int = 0, **kw) -> ZmqEventPublisher:
    fields = dict(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}",
                  replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    fields.update(kw)
    return ZmqEventPublisher(KVEventsConfig(**fields))


def instance(address: str, pub: ZmqEventPublisher, block_size: int = BS):
    """What the index reads of a pool instance: its address and last GetLoad report."""
    report = pb.LoadReport(kv_events_endpoint=pub.endpoint, kv_events_replay_endpoint=pub.replay_endpoint,
                           kv_events_epoch=pub.epoch, block_size=block_size)
    return SimpleNamespace(address=address, draining=False, load=report)


def store(pub: ZmqEventPublisher, tokens: list[int], salt: str | None = None) -> list[bytes]:
    hashes = hash_request_tokens(tokens, BS, salt)
    pub.publish([BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens[:len(hashes) * BS],
                             block_size=BS, lora_id=None, medium="GPU", lora_name=None)])
    return hashes


async def until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def held(index: KvIndex, address: str) -> set[bytes]:
    return set(index.streams[address].blocks) if address in index.streams else set()


@pytest.mark.asyncio
async def test_history_then_live_updates_then_departure():
    pub = publisher()
    index = KvIndex(resync_interval_s=0.2)
    try:
        before = store(pub, list(range(16)))  # published before anyone subscribed: replay brings it
        index.sync([instance("10.0.0.1:1", pub)])
        await until(lambda: held(index, "10.0.0.1:1") == set(before), "history")
        after = store(pub, list(range(100, 108)))
        await until(lambda: held(index, "10.0.0.1:1") == set(before) | set(after), "a live batch")
        assert index.matched_tokens("10.0.0.1:1", hash_request_tokens(list(range(16)) + [9] * 8, BS)) == 16
        pub.publish([BlockRemoved(block_hashes=before[2:], medium="GPU")])
        await until(lambda: held(index, "10.0.0.1:1") == set(before[:2]) | set(after), "a removal")
        assert index.matched_tokens("10.0.0.1:1", hash_request_tokens(list(range(16)), BS)) == 8
        assert index.holders[before[0]] == {"10.0.0.1:1"}
        index.sync([])  # discovery removed it
        assert "10.0.0.1:1" not in index.streams and not index.holders
    finally:
        await index.close()
        pub.shutdown()


@pytest.mark.asyncio
async def test_a_gap_the_subscriber_missed_is_replayed():
    """The loop stalls while 3,000 batches go out: SUB's queue overflows and drops some (PUB's high-
    water mark is 1); the replay buffer has them all, so the index ends complete and certain."""
    pub = publisher(hwm=1, buffer_steps=10_000)
    index = KvIndex(resync_interval_s=0.2)
    try:
        index.sync([instance("a:1", pub)])
        expected = set(store(pub, [1, 2, 3, 4]))
        await until(lambda: held(index, "a:1") == expected, "a first batch")
        for i in range(3000):
            expected.update(store(pub, [i, i + 1, i + 2, i + 3]))
        time.sleep(1.0)  # the event loop stalls: nothing reads the SUB socket meanwhile
        await until(lambda: held(index, "a:1") == expected, "the replayed gap")
        s = index.streams["a:1"]
        assert s.gaps_replayed >= 1 and s.gaps_lost == 0 and s.gap_seq is None
    finally:
        await index.close()
        pub.shutdown()


@pytest.mark.asyncio
async def test_an_unreplayable_gap_lowers_the_confidence_of_older_entries():
    pub = publisher(buffer_steps=2)
    index = KvIndex(resync_interval_s=0.2, low_confidence_weight=0.25)
    try:
        index.sync([instance("a:1", pub)])
        old = store(pub, list(range(8)))
        await until(lambda: held(index, "a:1") == set(old), "the first blocks")
        index.streams["a:1"].task.cancel()  # the router stops listening for a while...
        await asyncio.sleep(0.05)
        for i in range(5):  # ...while more batches go out than the engine's buffer keeps
            store(pub, [50 + i] * 4)
        new = store(pub, list(range(200, 208)))
        await until(lambda: pub.batches_published == pub.last_seq + 1, "the publisher")
        stream = index.streams["a:1"]
        stream.task = asyncio.get_running_loop().create_task(index._follow(stream))
        await until(lambda: set(new) <= held(index, "a:1"), "the blocks after the gap")
        assert stream.gaps_lost == 1 and stream.gap_seq is not None
        # Stored before the lost batches: maybe evicted since, so they count a quarter.
        assert index.matched_tokens("a:1", hash_request_tokens(list(range(8)), BS)) == pytest.approx(8 * 0.25)
        assert index.matched_tokens("a:1", hash_request_tokens(list(range(200, 208)), BS)) == 8
        store(pub, list(range(8)))  # stored again after the gap: certain again
        await until(lambda: index.matched_tokens("a:1", hash_request_tokens(list(range(8)), BS)) == 8, "re-store")
    finally:
        await index.close()
        pub.shutdown()


@pytest.mark.asyncio
async def test_a_restarted_engine_has_a_new_epoch_and_its_old_entries_go():
    port, replay_port = free_port(), free_port()
    first = publisher(port, replay_port)
    index = KvIndex(resync_interval_s=0.2)
    try:
        index.sync([instance("a:1", first)])
        old = store(first, list(range(8)))
        await until(lambda: held(index, "a:1") == set(old), "the first epoch's blocks")
        first.shutdown()
        second = publisher(port, replay_port)  # the same ports, a new process: a new epoch, cache empty
        try:
            second.publish([AllBlocksCleared()])
            new = store(second, list(range(300, 304)))
            await until(lambda: held(index, "a:1") == set(new), "the new epoch")
            assert index.streams["a:1"].epoch == second.epoch and index.streams["a:1"].epoch_changes == 1
            assert not set(old) & set(index.holders)
        finally:
            second.shutdown()
    finally:
        await index.close()


@pytest.mark.asyncio
async def test_a_new_epoch_in_getload_drops_entries_before_any_event():
    pub = publisher()
    index = KvIndex(resync_interval_s=0.2)
    try:
        inst = instance("a:1", pub)
        index.sync([inst])
        old = store(pub, list(range(8)))
        await until(lambda: held(index, "a:1") == set(old), "blocks")
        inst.load.kv_events_epoch = pub.epoch + 1  # restarted, nothing published yet
        index.sync([inst])
        assert held(index, "a:1") == set() and index.streams["a:1"].epoch_changes == 1
    finally:
        await index.close()
        pub.shutdown()


def test_wildcard_endpoints_name_the_instance_host():
    assert resolve_endpoint("tcp://*:5557", "10.1.2.3:50051") == "tcp://10.1.2.3:5557"
    assert resolve_endpoint("tcp://0.0.0.0:5557", "decode-0.svc:50051") == "tcp://decode-0.svc:5557"
    assert resolve_endpoint("tcp://10.9.9.9:5557", "10.1.2.3:50051") == "tcp://10.9.9.9:5557"


@pytest.mark.asyncio
async def test_after_a_random_workload_goes_quiet_the_index_equals_the_engines_caches(tiny_llama):
    """Two real engine cores with small caches (evictions), shared prefixes and tenant salts."""
    from engine.config import EngineConfig
    from engine.engine_core import EngineCore
    from engine.request import Request, SamplingParams

    cores = [EngineCore(EngineConfig.create(tiny_llama, device="cpu", block_size=BS, num_blocks=40,
                                            kv_events=dict(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0",
                                                           replay_endpoint="tcp://127.0.0.1:0", buffer_steps=64)))
             for _ in range(2)]
    index = KvIndex(resync_interval_s=0.2)
    rng = random.Random(7)
    prefixes = [[rng.randrange(6, 900) for _ in range(rng.choice([8, 12, 20]))] for _ in range(5)]
    try:
        index.sync([instance(f"engine-{i}:1", c.kv_event_publisher) for i, c in enumerate(cores)])

        def run_workload() -> None:
            for n in range(40):
                core = rng.choice(cores)
                prompt = rng.choice(prefixes) + [rng.randrange(6, 900) for _ in range(rng.randrange(1, 14))]
                salt = rng.choice([None, "tenant-a", "tenant-b"])
                core.add_request(Request(f"r{n}", prompt, SamplingParams(max_tokens=rng.randrange(1, 6),
                                                                         temperature=0, ignore_eos=True,
                                                                         cache_salt=salt)))
                if rng.random() < 0.5:
                    while core.has_work():
                        core.step()
            for core in cores:
                while core.has_work():
                    core.step()

        await asyncio.to_thread(run_workload)
        for i, core in enumerate(cores):
            cached = set(core.kv_cache_manager.block_pool.cached)
            assert cached, "the workload cached nothing"
            await until(lambda: held(index, f"engine-{i}:1") == cached, f"engine {i}'s cache in the index")
        assert any(c.kv_cache_manager.take_events() == [] for c in cores)
        assert set(index.holders) == set().union(*(c.kv_cache_manager.block_pool.cached for c in cores))
    finally:
        await index.close()
        for core in cores:
            core.shutdown()
