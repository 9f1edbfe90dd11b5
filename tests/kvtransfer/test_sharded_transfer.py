"""KV transfer between engines of different tensor-parallel sizes: every decode rank pulls exactly
its KV heads from the prefill ranks that hold them, over every transport, bit for bit.

In-process connectors: prefill ranks hold head shards of one random reference KV cache; after
every decode rank pulled, the decode shards put together are the reference's blocks."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from kvtransfer import KVHandle, KVLayout, LayoutMismatch, PeerLost, ProtocolError, create_connector
from kvtransfer.handle import merge_shard_handles
from kvtransfer.shards import plan_pull, plan_sources

from kv_peers import SECRET, blocks_bytes, fill, wait_events

PREFILL_BLOCKS, DECODE_BLOCKS = 64, 80
MODEL = dict(num_layers=2, head_dim=16, block_size=4, dtype="float16")

# (transport, transport options): the options take the staged paths GPU caches take.
VARIANTS = [("tcp", {}), ("tcp", {"direct_io": False}), ("shm", {}), ("shm", {"host_staging": True}),
            ("ucx", {}), ("nccl", {})]
VARIANT_IDS = [t + ("-staged" if o else "") for t, o in VARIANTS]
# (total KV heads, prefill TP, decode TP)
SPLITS = [(4, 1, 1), (4, 1, 2), (4, 2, 1), (4, 2, 2), (4, 1, 4), (4, 4, 1), (4, 2, 4), (4, 4, 2)]
REPLICATED = [(2, 1, 4), (2, 4, 1), (2, 4, 4), (1, 2, 1), (1, 1, 2), (1, 4, 2), (2, 4, 2)]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)")


def layout(total: int, tp: int, rank: int, **model) -> KVLayout:
    return KVLayout.for_rank(total_kv_heads=total, tp_size=tp, tp_rank=rank, **{**MODEL, **model})


def reference(total: int, seed: int = 1) -> list[torch.Tensor]:
    """The unsharded model's KV cache, random bit patterns (NaNs included): only bytes can compare."""
    caches = [torch.empty(KVLayout(num_kv_heads=total, **MODEL).cache_shape(PREFILL_BLOCKS), dtype=torch.float16)
              for _ in range(MODEL["num_layers"])]
    fill(caches, seed)
    return caches


class TPEngines:
    """One connector per rank of a TP engine, each with its shard of the KV cache."""

    def __init__(self, role: str, transport: str, options: dict, total: int, tp: int, device: str = "cpu", **kw):
        self.layouts = [layout(total, tp, r, device=device) for r in range(tp)]
        self.connectors = [create_connector(transport, role, lo, secret=SECRET, engine_id=f"{role}-rank{r}",
                                            timeout_s=20.0, **options, **kw) for r, lo in enumerate(self.layouts)]
        blocks = PREFILL_BLOCKS if role == "prefill" else DECODE_BLOCKS
        self.caches = [c.worker.allocate_kv_caches(blocks) for c in self.connectors]
        self.freed: list[list] = [[] for _ in self.connectors]  # prefill: leases freed, not yet looked at

    def load(self, ref: list[torch.Tensor]) -> None:
        for lo, caches in zip(self.layouts, self.caches):
            shard = lo.shard
            for cache, full in zip(caches, ref):
                cache.copy_(full[:, :, :, shard.head_start:shard.head_end].to(cache.device))

    def poison(self) -> None:
        for caches in self.caches:
            for cache in caches:
                cache.view(torch.uint8).fill_(0xA5)

    def close(self) -> None:
        for c in self.connectors:
            c.close()


@pytest.fixture
def engines():
    made = []

    def make(*args, **kw) -> TPEngines:
        made.append(TPEngines(*args, **kw))
        return made[-1]

    yield make
    for e in reversed(made):
        e.close()


def publish(prefill: TPEngines, rid: str, block_ids: list[int]) -> KVHandle:
    """What the TP prefill's driver does: every rank publishes the same blocks, one handle merged."""
    return merge_shard_handles([c.publish(rid, block_ids, len(block_ids) * MODEL["block_size"])
                                for c in prefill.connectors], SECRET)


def wait_freed(engines: TPEngines, rank: int, rid: str, timeout: float = 10.0) -> list:
    """Rank `rank`'s freed leases of `rid`, once there is one (others stay for later calls)."""
    deadline, kept = time.monotonic() + timeout, engines.freed[rank]
    while not any(f.request_id == rid for f in kept):
        kept += engines.connectors[rank].get_finished().freed
        assert time.monotonic() < deadline, f"rank {rank} never freed {rid}"
        time.sleep(0.005)
    freed = [f for f in kept if f.request_id == rid]
    kept[:] = [f for f in kept if f.request_id != rid]
    return freed


def heads_bytes(caches: list[torch.Tensor], block_ids: list[int], h0: int, h1: int) -> list[bytes]:
    ids = torch.tensor(block_ids)
    return [c.cpu()[:, ids, :, h0:h1].contiguous().view(torch.uint8).numpy().tobytes() for c in caches]


def check_transfer(engines, transport: str, options: dict, total: int, a: int, b: int,
                   devices: tuple[str, str] = ("cpu", "cpu")) -> None:
    ref = reference(total)
    prefill = engines("prefill", transport, options, total, a, devices[0])
    prefill.load(ref)
    decode = engines("decode", transport, options, total, b, devices[1])
    decode.poison()
    rng = random.Random(f"{total}-{a}-{b}")
    remote = rng.sample(range(PREFILL_BLOCKS), 12)
    local = rng.sample(range(DECODE_BLOCKS), 12)
    untouched = [x for x in range(DECODE_BLOCKS) if x not in local][:20]
    handle = publish(prefill, "req", remote)

    for connector in decode.connectors:
        connector.start_pull("req", handle, local)
    for connector in decode.connectors:
        events = wait_events(connector, ["req"])
        assert events.finished == ["req"], events.failed

    bs, hd, layers = MODEL["block_size"], MODEL["head_dim"], MODEL["num_layers"]
    for h in range(total):  # every head, from each decode rank holding it (replicas included)
        for lo, caches in zip(decode.layouts, decode.caches):
            shard = lo.shard
            if shard.head_start <= h < shard.head_end:
                got = heads_bytes(caches, local, h - shard.head_start, h - shard.head_start + 1)
                assert got == heads_bytes(ref, remote, h, h + 1), f"head {h} on decode rank {lo.tp_rank}"
    for caches in decode.caches:
        assert all(set(x) == {0xA5} for x in blocks_bytes([c.cpu() for c in caches], untouched))  # nothing else
    for lo, connector in zip(decode.layouts, decode.connectors):
        assert connector.stats()["bytes_received"] == lo.num_kv_heads * hd * bs * 2 * layers * len(local) * 2
    for rank, connector in enumerate(prefill.connectors):  # every rank's lease released (none left to expire)
        assert [(f.block_ids, f.reason) for f in wait_freed(prefill, rank, "req")] == [(tuple(remote), "released")]
        assert connector.num_published_blocks == 0
    # each prefill rank sent exactly the heads decode ranks took from it, and nothing twice (the
    # release comes after the pull on its connection, so the counters are final by now)
    sent = [c.stats().get("bytes_sent", 0) for c in prefill.connectors]
    needed = [0] * a
    for j in range(b):
        for s in plan_sources(total, a, b, j):
            needed[s.prefill_rank] += (s.head_end - s.head_start) * hd * bs * 2 * layers * len(local) * 2
    assert sent == needed
    assert sum(sent) == sum(c.stats()["bytes_received"] for c in decode.connectors)


@pytest.mark.parametrize("total,a,b", SPLITS, ids=[f"h{t}-p{a}-d{b}" for t, a, b in SPLITS])
@pytest.mark.parametrize("transport,options", VARIANTS, ids=VARIANT_IDS)
def test_decode_ranks_pull_their_heads_bit_exact(engines, transport, options, total, a, b):
    check_transfer(engines, transport, options, total, a, b)


@pytest.mark.parametrize("total,a,b", REPLICATED, ids=[f"h{t}-p{a}-d{b}" for t, a, b in REPLICATED])
@pytest.mark.parametrize("transport,options", [VARIANTS[0], VARIANTS[2], VARIANTS[4], VARIANTS[5]],
                         ids=["tcp", "shm", "ucx", "nccl"])
def test_replicated_heads_pulled_once_per_decode_rank(engines, transport, options, total, a, b):
    check_transfer(engines, transport, options, total, a, b)


@needs_cuda
@pytest.mark.parametrize("devices", [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
@pytest.mark.parametrize("total,a,b", [(4, 2, 1), (4, 1, 2), (4, 2, 4), (2, 4, 1)],
                         ids=["h4-p2-d1", "h4-p1-d2", "h4-p2-d4", "h2-p4-d1"])
@pytest.mark.parametrize("transport", ["tcp", "shm", "ucx"])  # NCCL: one GPU cannot be two ranks of a pair
def test_gpu_caches_pull_their_heads_bit_exact(engines, transport, total, a, b, devices):
    check_transfer(engines, transport, {}, total, a, b, devices)


def test_partial_and_concurrent_pulls_across_ranks(engines):
    """Blocks already cached on the decode are not moved; several requests pull at once, each
    decode rank reading two prefill ranks in parallel."""
    ref = reference(4, seed=3)
    prefill = engines("prefill", "tcp", {}, 4, 2)
    prefill.load(ref)
    decode = engines("decode", "tcp", {}, 4, 1)
    decode.poison()
    handles = {f"r{i}": publish(prefill, f"r{i}", list(range(6 * i, 6 * i + 6))) for i in range(8)}
    for i, (rid, handle) in enumerate(handles.items()):
        decode.connectors[0].start_pull(rid, handle, list(range(6 * i + 2, 6 * i + 6)), first_block=2)
    events = wait_events(decode.connectors[0], handles)
    assert sorted(events.finished) == sorted(handles), events.failed
    for i in range(8):
        assert heads_bytes(decode.caches[0], list(range(6 * i + 2, 6 * i + 6)), 0, 4) == \
            heads_bytes(ref, list(range(6 * i + 2, 6 * i + 6)), 0, 4)
        assert set(blocks_bytes(decode.caches[0], [6 * i, 6 * i + 1])[0]) == {0xA5}
    moved = 8 * 4 * MODEL["num_layers"] * KVLayout(num_kv_heads=4, **MODEL).block_bytes_per_layer
    assert decode.connectors[0].stats()["bytes_received"] == moved
    for rank, connector in enumerate(prefill.connectors):
        freed = [f for rid in handles for f in wait_freed(prefill, rank, rid)]
        assert sorted(f.request_id for f in freed) == sorted(handles)
        assert {f.reason for f in freed} == {"released"}
        assert connector.stats()["bytes_sent"] == moved // 2


def test_a_lost_prefill_rank_fails_the_pull_and_frees_the_others(engines):
    prefill = engines("prefill", "tcp", {}, 4, 2)
    decode = engines("decode", "tcp", {}, 4, 1)
    decode.poison()
    handle = publish(prefill, "half-gone", [1, 2, 3])
    prefill.connectors[1].close()  # rank 1 died: its heads cannot be had
    decode.connectors[0].start_pull("half-gone", handle, [4, 5, 6])
    error = wait_events(decode.connectors[0], ["half-gone"]).failed["half-gone"]
    assert isinstance(error, PeerLost)
    # The request is recomputed: rank 0 gets its blocks back now, not at lease expiry, and counts
    # no finished transfer, whether the failure stopped its part or came after it.
    assert [f.reason for f in wait_freed(prefill, 0, "half-gone")] == ["aborted"]


def test_a_part_that_landed_is_not_released_when_another_rank_fails(engines, monkeypatch):
    """Rank 0's part completes first, then rank 1's fails: the decode recomputes the request, so
    rank 0 must not count a finished transfer (its lease is aborted, not released)."""
    prefill = engines("prefill", "tcp", {}, 4, 2)
    decode = engines("decode", "tcp", {}, 4, 1)
    connector = decode.connectors[0]
    first_done = threading.Event()
    pull_on = connector._pull_on

    def ordered(conn, pull, source):
        if source.ref.rank == 1:
            assert first_done.wait(10)
            raise PeerLost("rank 1 lost after rank 0's part landed")
        nbytes = pull_on(conn, pull, source)
        first_done.set()
        return nbytes

    monkeypatch.setattr(connector, "_pull_on", ordered)
    handle = publish(prefill, "late-failure", [1, 2, 3])
    connector.start_pull("late-failure", handle, [4, 5, 6])
    assert isinstance(wait_events(connector, ["late-failure"]).failed["late-failure"], PeerLost)
    for rank in range(2):
        assert [f.reason for f in wait_freed(prefill, rank, "late-failure")] == ["aborted"]
        assert prefill.connectors[rank].num_published_blocks == 0
    assert prefill.connectors[0].stats()["pulls_served"] == 1  # its part was sent, and not counted as kept


def test_a_pull_from_several_ranks_releases_each_once_every_part_is_in(engines):
    prefill = engines("prefill", "tcp", {}, 4, 2)
    prefill.load(reference(4))
    decode = engines("decode", "tcp", {}, 4, 1)
    handle = publish(prefill, "whole", [7, 8])
    decode.connectors[0].start_pull("whole", handle, [0, 1])
    assert wait_events(decode.connectors[0], ["whole"]).finished == ["whole"]
    for rank in range(2):
        assert [f.reason for f in wait_freed(prefill, rank, "whole")] == ["released"]
    assert "releases_failed" not in decode.connectors[0].stats()


def test_whole_shard_pull_keeps_the_zero_copy_path(engines):
    """a == b: rank j pulls prefill rank j's whole blocks, with no head range on the wire."""
    prefill = engines("prefill", "tcp", {}, 4, 2)
    handle = publish(prefill, "same-tp", [1, 2])
    for rank in range(2):
        (source,) = plan_pull(layout(4, 2, rank), handle)
        assert (source.ref.rank, source.heads, source.remote_heads) == (rank, None, None)
    halves = plan_pull(layout(4, 4, 3), handle)
    assert [(s.ref.rank, s.heads, s.remote_heads) for s in halves] == [(1, None, (1, 2))]


def test_lease_waits_for_every_decode_rank(engines):
    """a < b: both decode ranks read prefill rank 0; its blocks stay until the second has pulled."""
    prefill = engines("prefill", "tcp", {}, 4, 1)
    prefill.load(reference(4))
    decode = engines("decode", "tcp", {}, 4, 2)
    handle = publish(prefill, "shared", [5, 6, 7])
    decode.connectors[0].start_pull("shared", handle, [0, 1, 2])
    assert wait_events(decode.connectors[0], ["shared"]).finished == ["shared"]
    # a round trip on the connection the one-way Finish took: the prefill has read the release
    # by now, and must not free what decode rank 1 still needs
    decode.connectors[0].extend_lease(handle, 1.0).result(timeout=20)
    assert prefill.connectors[0].get_finished().freed == []
    assert prefill.connectors[0].num_published_blocks == 3
    decode.connectors[1].start_pull("shared", handle, [0, 1, 2])
    assert wait_events(decode.connectors[1], ["shared"]).finished == ["shared"]
    assert [f.reason for f in wait_freed(prefill, 0, "shared")] == ["released"]


def test_release_without_pull_frees_every_rank(engines):
    """Every block cached on the decode: each decode rank releases its part of every prefill rank's lease."""
    prefill = engines("prefill", "tcp", {}, 2, 4)  # replicated: ranks 1 and 3 are nobody's source
    decode = engines("decode", "tcp", {}, 2, 1)
    handle = publish(prefill, "cached", [3])
    decode.connectors[0].release(handle).result(timeout=20)
    for rank in range(4):
        assert [f.reason for f in wait_freed(prefill, rank, "cached")] == ["released"]


def test_prefill_refuses_heads_outside_its_shard(engines):
    from kvtransfer import wire
    from test_kv_faults import _session

    prefill = engines("prefill", "tcp", {}, 4, 2)
    handle = publish(prefill, "outside", [1, 2])
    fingerprint = handle.layout_fingerprint
    with _session(prefill.connectors[1].endpoint) as sock:  # rank 1 holds heads [2, 4)
        for h0, h1 in [(0, 2), (1, 3), (3, 5), (3, 3)]:
            wire.send_msg(sock, wire.Pull(1, handle.to_bytes(), 0, 2, fingerprint, 5.0, h0, h1, 0, 2))
            with pytest.raises(ProtocolError, match="outside this prefill rank's shard"):
                wire.recv_msg(sock)
        wire.send_msg(sock, wire.Pull(2, handle.to_bytes(), 0, 2, fingerprint, 5.0, 2, 3, 0, 5))  # TP 5 cannot split 4
        with pytest.raises(ProtocolError, match="TP=5"):
            wire.recv_msg(sock)
    assert prefill.connectors[1].stats().get("bytes_sent", 0) == 0
    assert prefill.connectors[1].num_published_blocks == 2


@pytest.mark.parametrize("other,named", [
    (dict(block_size=8), "block size 8"), (dict(dtype="bfloat16"), "bfloat16"),
    (dict(num_layers=3), "3 layers"), (dict(head_dim=32), "dim 32")])
def test_layout_mismatch_names_both_sides(engines, other, named):
    prefill = engines("prefill", "tcp", {}, 4, 2)
    handle = publish(prefill, "other-model", [1])
    decode = create_connector("tcp", "decode", layout(4, 2, 0, **other), secret=SECRET, engine_id="d")
    try:
        decode.worker.allocate_kv_caches(8)
        with pytest.raises(LayoutMismatch) as e:
            decode.start_pull("other-model", handle, [0])
        assert named in str(e.value) and str(handle.layout) in str(e.value)  # theirs and ours
    finally:
        decode.close()


def test_prefill_names_both_layouts_when_a_pull_disagrees(engines):
    from kvtransfer import wire
    from test_kv_faults import _session

    prefill = engines("prefill", "tcp", {}, 4, 1)
    handle = publish(prefill, "mismatch", [1])
    theirs = layout(4, 1, 0, block_size=8)
    with _session(prefill.connectors[0].endpoint) as sock:
        wire.send_msg(sock, wire.Pull(1, handle.to_bytes(), 0, 1, theirs.fingerprint, 5.0, layout=theirs.describe()))
        with pytest.raises(LayoutMismatch) as e:
            wire.recv_msg(sock)
    assert "block size 8" in str(e.value) and "block size 4" in str(e.value)


def test_total_heads_decide_compatibility_not_tp():
    """Same model, any TP: one fingerprint; another head count is another model."""
    assert len({layout(4, tp, 0).fingerprint for tp in (1, 2, 4)}) == 1
    assert layout(2, 4, 3).fingerprint == KVLayout(num_kv_heads=2, **MODEL).fingerprint
    assert layout(4, 2, 0).fingerprint != layout(2, 1, 0).fingerprint  # 2 local heads, but of another model


def test_tp1_handles_and_fingerprints_are_unchanged():
    """Pinned from before sharding existed: TP=1 handles keep their bytes and signatures."""
    assert KVLayout(2, 4, 32, 16, "float32").fingerprint == "aef5b6e5cd180951"
    assert KVLayout(28, 8, 128, 16, "bfloat16").fingerprint == "425d94e825cd7d3b"
    old = bytes.fromhex(
        "8aaa726571756573745f6964a27231a9656e67696e655f6964a27030a97472616e73706f7274a3746370a8656e64706f696e74"
        "b37463703a2f2f31302e302e302e313a35303030a9626c6f636b5f69647393030104aa6e756d5f746f6b656e7328b26c6179"
        "6f75745f66696e6765727072696e74b061656635623665356364313830393531ac6c656173655f657870697279cb41d954fc"
        "40200000a3746167c4200a81a991f66593efc152d0bb5d9796ae6da61644183ab5e174f1064abb9abe23a776657273696f6e01")
    handle = KVHandle.from_bytes(old)
    handle.verify(SECRET)
    assert handle.shards == () and handle.layout == ""
    assert handle.to_bytes() == old
    made = KVHandle(request_id="r1", engine_id="p0", transport="tcp", endpoint="tcp://10.0.0.1:5000",
                    block_ids=(3, 1, 4), num_tokens=40, layout_fingerprint="aef5b6e5cd180951",
                    lease_expiry=1700000000.5).signed(SECRET)
    assert made.to_bytes() == old
    assert merge_shard_handles([made], SECRET) is made


def test_merge_refuses_handles_that_do_not_make_one_prefill(engines):
    from kvtransfer import AuthError
    import msgspec

    prefill = engines("prefill", "tcp", {}, 4, 2)
    h0 = prefill.connectors[0].publish("m", [1, 2], 8)
    h1 = prefill.connectors[1].publish("m", [1, 2], 8)
    merged = merge_shard_handles([h1, h0], SECRET)
    assert [s.rank for s in merged.shards] == [0, 1] and merged.endpoint == prefill.connectors[0].endpoint
    assert KVHandle.from_bytes(merged.to_bytes()) == merged
    with pytest.raises(ProtocolError, match="ranks"):
        merge_shard_handles([h0], SECRET)
    with pytest.raises(ProtocolError, match="disagree on block_ids"):
        other = prefill.connectors[1].publish("n", [1, 3], 8)
        merge_shard_handles([h0, msgspec.structs.replace(other, request_id="m", tag=b"").signed(SECRET)], SECRET)
    with pytest.raises(AuthError):
        merge_shard_handles([h0, msgspec.structs.replace(h1, block_ids=(1, 3))], SECRET)
    with pytest.raises(ProtocolError, match="not one rank's handle"):
        merge_shard_handles([merged, h1], SECRET)
    twin = msgspec.structs.replace(h1, shards=(msgspec.structs.replace(h1.shards[0], engine_id=h0.engine_id),))
    with pytest.raises(ProtocolError, match="do not make one TP=2 prefill"):  # two ranks, one engine id
        merge_shard_handles([h0, msgspec.structs.replace(twin, tag=b"").signed(SECRET)], SECRET)
    decode = create_connector("tcp", "decode", layout(4, 2, 0), secret=SECRET, engine_id="d")
    try:
        decode.worker.allocate_kv_caches(8)
        with pytest.raises(ProtocolError, match="merge_shard_handles"):
            decode.start_pull("m", h0, [0, 1])  # one rank's handle, not the request's
    finally:
        decode.close()


@pytest.mark.parametrize("total,tp,heads", [
    (8, 2, [(0, 4), (4, 8)]), (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]), (1, 2, [(0, 1), (0, 1)])])
def test_shard_heads(total, tp, heads):
    shards = [layout(total, tp, r).shard for r in range(tp)]
    assert [(s.head_start, s.head_end) for s in shards] == heads


def test_sharded_layouts_are_validated():
    assert KVLayout.for_rank(total_kv_heads=8, tp_size=4, tp_rank=3, **MODEL) == \
        KVLayout(num_kv_heads=2, tp_size=4, tp_rank=3, total_kv_heads=8, **MODEL)
    with pytest.raises(ValueError, match="cannot be split"):
        KVLayout(num_kv_heads=1, tp_size=3, total_kv_heads=4, **MODEL)
    with pytest.raises(ValueError, match="not num_kv_heads"):
        KVLayout(num_kv_heads=4, tp_size=2, total_kv_heads=4, **MODEL)
    with pytest.raises(ValueError, match="total_kv_heads"):
        KVLayout(num_kv_heads=2, tp_size=2, **MODEL)
    with pytest.raises(ValueError, match="not a rank"):
        KVLayout(num_kv_heads=2, tp_size=2, tp_rank=2, total_kv_heads=4, **MODEL)


def test_lease_ends_when_every_releaser_released():
    from kvtransfer.lease import LeaseTable

    now = [0.0]
    table = LeaseTable(10.0, clock=lambda: now[0])
    table.add("r", (1, 2), b"t")
    assert not table.release("r", b"t", 0, frozenset({0, 1}))
    assert not table.release("r", b"t", 0, frozenset({0, 1}))  # again: still waiting for rank 1
    with pytest.raises(ProtocolError, match="waits for"):
        table.release("r", b"t", 2, frozenset({2, 3}))  # a decode of another TP size
    assert table.drain_freed() == []
    assert table.release("r", b"t", 1, frozenset({0, 1}))
    assert [(f.request_id, f.reason) for f in table.drain_freed()] == [("r", "released")]
    table.add("s", (3,), b"u")  # half released, then nobody comes: it expires as any lease does
    table.release("s", b"u", 1, frozenset({0, 1}))
    now[0] = 11.0
    assert table.expire() == 1
    assert [(f.request_id, f.reason) for f in table.drain_freed()] == [("s", "expired")]


@pytest.mark.parametrize("transport", ["tcp", "shm", "ucx", "nccl"])
def test_prefill_ranks_in_another_process(transport):
    """The prefill's two ranks in a second process (as in a deployment): a TP=1 and a TP=4 decode
    here each pull their heads of one request, bit for bit, and both ranks get their blocks back."""
    from kv_peers import PrefillPeer, reference_caches

    ranks = [dict(MODEL, num_kv_heads=2, tp_size=2, tp_rank=r, total_kv_heads=4) for r in range(2)]
    peer = PrefillPeer(transport)
    decodes = []
    try:
        for r, kwargs in enumerate(ranks):
            peer.open(f"rank{r}", kwargs, PREFILL_BLOCKS, seed=10 + r)
        refs = [reference_caches(kwargs, PREFILL_BLOCKS, 10 + r) for r, kwargs in enumerate(ranks)]
        remote, local = [7, 3, 40, 41, 42], [60, 2, 9, 10, 11]
        for b in (1, 4):
            handle = merge_shard_handles([peer.publish(f"rank{r}", f"x{b}", remote, 20) for r in range(2)], SECRET)
            for j in range(b):
                # Deadlines for a loaded two-core box: the full suite once ran a gloo pull past 20 s.
                decode = create_connector(transport, "decode", layout(4, b, j), secret=SECRET,
                                          engine_id=f"decode{b}-{j}", timeout_s=60.0)
                decodes.append(decode)
                caches = decode.worker.allocate_kv_caches(DECODE_BLOCKS)
                decode.start_pull(f"x{b}", handle, local)
                events = wait_events(decode, [f"x{b}"], timeout=90.0)
                assert events.finished == [f"x{b}"], events.failed  # the failure's reason, if any
                start = decode.worker.layout.shard.head_start
                for h in range(start, start + decode.worker.layout.num_kv_heads):
                    ref = refs[h // 2]  # prefill rank h // 2 holds global head h as its local h % 2
                    assert heads_bytes(caches, local, h - start, h - start + 1) == \
                        heads_bytes(ref, remote, h % 2, h % 2 + 1), f"TP={b} rank {j} head {h}"
            for r in range(2):
                peer.wait_for(f"rank{r}", lambda s, freed: any(f["request_id"] == f"x{b}" and f["reason"] == "released"
                                                               for f in freed))
        shard_bytes = len(remote) * KVLayout(**ranks[0]).block_bytes
        for r in range(2):  # each rank sent its shard's heads once per decode (TP=1, TP=4), nothing more
            assert peer.call("stats", f"rank{r}")["bytes_sent"] == 2 * shard_bytes
    finally:
        for decode in decodes:
            decode.close()
        peer.close()
