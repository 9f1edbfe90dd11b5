"""Every transport, two processes on 127.0.0.1: pulled blocks are bit-identical to the prefill's."""
from __future__ import annotations

import random
import time

import pytest

from kv_peers import LAYOUTS, PREFILL_BLOCKS, blocks_bytes, reference_caches, wait_events


def _pick(n: int, total: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(total), n)


@pytest.mark.parametrize("num_blocks", [1, 300])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pull_is_bit_identical(prefill, make_decode, layout, num_blocks):
    decode, caches = make_decode(prefill.transport, layout)
    remote_ids = _pick(num_blocks, PREFILL_BLOCKS, seed=num_blocks)
    local_ids = _pick(num_blocks, len(caches[0][0]), seed=num_blocks + 7)
    rid = f"bits-{layout}-{num_blocks}"
    handle = prefill.publish(layout, rid, remote_ids, num_tokens=num_blocks * LAYOUTS[layout]["block_size"])
    untouched = [b for b in range(len(caches[0][0])) if b not in set(local_ids)][:50]
    before = blocks_bytes(caches, untouched)

    decode.start_pull(rid, handle, local_ids)
    events = wait_events(decode, [rid])

    assert events.finished == [rid], events.failed
    expected = reference_caches(LAYOUTS[layout], PREFILL_BLOCKS, prefill.seeds[layout])
    assert blocks_bytes(caches, local_ids) == blocks_bytes(expected, remote_ids)
    assert blocks_bytes(caches, untouched) == before  # nothing outside the reserved blocks changed
    assert decode.stats()["bytes_received"] == num_blocks * decode.worker.layout.block_bytes
    # the decode side released the lease, so the prefill side got its blocks back
    prefill.wait_for(layout, lambda stats, freed: any(f["request_id"] == rid and f["reason"] == "released"
                                                      for f in freed))


def test_partial_pull_moves_only_missing_blocks(prefill, make_decode):
    layout, k = "f16-bs8-gqa", 5
    decode, caches = make_decode(prefill.transport, layout)
    remote_ids = _pick(12, PREFILL_BLOCKS, seed=3)
    local_ids = _pick(12, len(caches[0][0]), seed=4)
    handle = prefill.publish(layout, "partial", remote_ids, num_tokens=12 * 8)
    sent_before = prefill.call("stats", layout).get("bytes_sent", 0)
    cached_before = blocks_bytes(caches, local_ids[:k])  # the first k blocks are already here

    decode.start_pull("partial", handle, local_ids[k:], first_block=k)
    assert wait_events(decode, ["partial"]).finished == ["partial"]

    expected = reference_caches(LAYOUTS[layout], PREFILL_BLOCKS, prefill.seeds[layout])
    assert blocks_bytes(caches, local_ids[k:]) == blocks_bytes(expected, remote_ids[k:])
    assert blocks_bytes(caches, local_ids[:k]) == cached_before
    moved = (12 - k) * decode.worker.layout.block_bytes
    assert decode.stats()["bytes_received"] == moved
    assert prefill.call("stats", layout)["bytes_sent"] - sent_before == moved


def test_32_concurrent_pulls_interleave(prefill, make_decode):
    layout = "bf16-bs32-mqa"
    decode, caches = make_decode(prefill.transport, layout)
    remote = _pick(32 * 4, PREFILL_BLOCKS, seed=11)
    local = _pick(32 * 4, len(caches[0][0]), seed=12)
    handles = {f"c{i}": prefill.publish(layout, f"c{i}", remote[4 * i:4 * i + 4], 4 * 32) for i in range(32)}

    for i, (rid, handle) in enumerate(handles.items()):
        decode.start_pull(rid, handle, local[4 * i:4 * i + 4])
    events = wait_events(decode, handles)

    assert sorted(events.finished) == sorted(handles) and not events.failed
    expected = reference_caches(LAYOUTS[layout], PREFILL_BLOCKS, prefill.seeds[layout])
    assert blocks_bytes(caches, local) == blocks_bytes(expected, remote)
    prefill.wait_for(layout, lambda stats, freed: {f["request_id"] for f in freed} >= set(handles))
    if prefill.transport == "shm":
        # however many connections the pulls opened, the prefill's cache is mapped here once
        # (mapping it per connection cost seconds of page faults under the GIL, per connection)
        with open("/proc/self/maps") as f:
            mapped = {line.split()[0] for line in f if "memfd:pdserve-kv" in line}
        assert len(mapped) == 1, mapped


def test_release_without_pull_and_lease_extension(prefill, make_decode):
    layout = "f32-bs16"
    decode, _ = make_decode(prefill.transport, layout)
    cached = prefill.publish(layout, "all-cached", [1, 2], 32)
    decode.release(cached).result(timeout=20)  # every block was in the decode's prefix cache
    prefill.wait_for(layout, lambda s, freed: any(f["request_id"] == "all-cached" and f["reason"] == "released"
                                                  for f in freed))

    waiting = prefill.publish(layout, "waits-for-room", [3], 16, 1.5)
    expiry = decode.extend_lease(waiting, 60).result(timeout=20)
    assert expiry > waiting.lease_expiry + 30
    deadline = time.monotonic() + 1.6  # past the original lease: the blocks must still be there
    prefill.wait_for(layout, lambda s, freed: time.monotonic() > deadline, timeout=5)
    assert not any(f["request_id"] == "waits-for-room" for f in prefill.call("poll", layout))
    decode.release(waiting).result(timeout=20)
