"""Pieces on their own: layout, handle, lease table, wire format, layering, the staged path."""
from __future__ import annotations

import ast
import pathlib
import socket
import struct
import subprocess
import sys
import time

import msgspec
import pytest
import torch

from kvtransfer import (AuthError, KVHandle, KVLayout, LayoutMismatch, LeaseExpired, ProtocolError, UnknownRequest,
                        create_connector, wire)
from kvtransfer.lease import LeaseTable
from kv_peers import SECRET, blocks_bytes, fill, wait_events

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "kvtransfer"


def test_layout_bytes_and_fingerprint():
    layout = KVLayout(32, 8, 128, 16, "float16")
    assert layout.block_bytes_per_layer == 2 * 16 * 8 * 128 * 2
    assert layout.block_bytes == 32 * layout.block_bytes_per_layer
    assert layout.fingerprint == KVLayout(32, 8, 128, 16, "float16", device="cuda:0").fingerprint
    for other in (KVLayout(32, 8, 128, 32, "float16"), KVLayout(32, 8, 128, 16, "bfloat16"),
                  KVLayout(32, 4, 128, 16, "float16"), KVLayout(16, 8, 128, 16, "float16")):
        assert other.fingerprint != layout.fingerprint
        with pytest.raises(LayoutMismatch):
            layout.check_compatible(other.fingerprint)
    caches = [torch.zeros(2, 10, 16, 8, 128, dtype=torch.float16) for _ in range(32)]
    assert KVLayout.from_kv_caches(caches) == layout
    with pytest.raises(LayoutMismatch):
        layout.check_kv_caches(caches[:-1])
    with pytest.raises(ValueError):
        KVLayout(1, 1, 1, 1, "int7")


def _handle(**kw) -> KVHandle:
    fields = dict(request_id="r", engine_id="p", transport="tcp", endpoint="tcp://127.0.0.1:1",
                  block_ids=(1, 2, 3), num_tokens=40, layout_fingerprint="ab", lease_expiry=1.0)
    return KVHandle(**{**fields, **kw}).signed(SECRET)


def test_handle_wire_format_and_tag():
    handle = _handle()
    assert KVHandle.from_bytes(handle.to_bytes()) == handle
    assert isinstance(msgspec.msgpack.decode(handle.to_bytes()), dict)  # plain msgpack map, no pickle
    handle.verify(SECRET)
    with pytest.raises(AuthError):
        handle.verify(b"another secret")
    for tampered in ({"block_ids": (1, 2, 4)}, {"num_tokens": 41}, {"lease_expiry": 99.0}, {"endpoint": "tcp://x:2"}):
        with pytest.raises(AuthError):
            msgspec.structs.replace(handle, **tampered).verify(SECRET)
    raw = msgspec.msgpack.decode(handle.to_bytes())
    for bad in ({**raw, "version": 2}, {**raw, "block_ids": [-1]}, {**raw, "evil": 1}):
        with pytest.raises(ProtocolError):
            KVHandle.from_bytes(msgspec.msgpack.encode(bad))
    with pytest.raises(ProtocolError):
        KVHandle.from_bytes(b"\xc1garbage")


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lease_table_lifecycle():
    clock = Clock()
    table = LeaseTable(default_ttl_s=30, clock=clock)
    table.add("a", (1, 2), b"tag-a")
    table.add("b", (3,), b"tag-b", ttl_s=5)
    table.add("c", (4, 5, 6), b"tag-c")
    with pytest.raises(ValueError):
        table.add("a", (7,), b"x")
    assert table.num_published_blocks == 6
    with pytest.raises(AuthError):
        table.check("a", b"not-the-tag")
    table.pin("b", b"tag-b", transfer_id=1, seconds=20)  # a transfer outlives the lease's own expiry
    clock.now += 10
    assert table.expire() == 0
    table.unpin("b", 1)
    assert table.expire() == 1
    assert table.extend("a", b"tag-a", 60) == pytest.approx(60)
    table.release("a", b"tag-a")
    assert table.abort("c") and not table.abort("c")
    with pytest.raises(UnknownRequest):
        table.pin("a", b"tag-a", 2, 5)
    assert [(f.request_id, f.reason) for f in table.drain_freed()] == [("b", "expired"), ("a", "released"),
                                                                     ("c", "aborted")]
    assert table.drain_freed() == [] and table.num_published_blocks == 0
    assert table.counters == {"published": 3, "released": 1, "expired": 1, "aborted": 1}
    table.add("d", (1,), b"tag-d", ttl_s=1)
    clock.now += 2
    with pytest.raises(LeaseExpired):  # found expired on touch: freed right there
        table.check("d", b"tag-d")
    assert table.num_leases == 0


def test_blocks_being_read_are_never_freed_under_the_reader():
    clock = Clock()
    table = LeaseTable(default_ttl_s=30, clock=clock)
    table.add("a", (1, 2), b"t")
    table.add("b", (3,), b"t")
    table.pin("a", b"t", transfer_id=7, seconds=5)
    table.pin("b", b"t", transfer_id=8, seconds=5)
    assert table.abort("a")  # the client went away mid-transfer
    table.release("b", b"t")
    assert table.drain_freed() == [] and table.num_published_blocks == 3
    with pytest.raises(UnknownRequest):  # but nobody may start reading them again
        table.pin("a", b"t", 9, 5)
    table.unpin("a", 7)  # the transfer ended: now the blocks go back
    clock.now += 6  # the other transfer never ended: its deadline frees them
    table.expire()
    assert [(f.request_id, f.reason) for f in table.drain_freed()] == [("a", "aborted"), ("b", "released")]
    assert table.num_published_blocks == 0


def test_wire_refuses_oversized_and_foreign_frames():
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        a.sendall(struct.pack("!4sB3xI", b"PDKV", 1, 1 << 31))  # 2 GiB claimed: refused before allocating
        with pytest.raises(ProtocolError, match="exceeds"):
            wire.recv_msg(b)
        a.sendall(struct.pack("!4sB3xI", b"HTTP", 1, 4))
        with pytest.raises(ProtocolError, match="bad header"):
            wire.recv_msg(b)
        wire.send_msg(a, wire.Error("layout_mismatch", "no"))
        with pytest.raises(LayoutMismatch):
            wire.recv_msg(b)
        a.sendall(wire.encode(wire.Ok())[:7])
        a.close()
        with pytest.raises(wire.PeerLost, match="truncated"):
            wire.recv_msg(b)


def test_kvtransfer_imports_neither_engine_nor_services():
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] not in ("engine", "services"), f"{path.name} imports {name}"


def test_scheduler_side_stays_torch_free():
    code = "import sys, kvtransfer, kvtransfer.lease, kvtransfer.wire; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


def test_factory_rejects_unknown_names():
    layout = KVLayout(1, 1, 8, 4)
    with pytest.raises(ValueError, match="transport"):
        create_connector("carrier-pigeon", "decode", layout, secret=SECRET, engine_id="d")
    with pytest.raises(ValueError, match="role"):
        create_connector("tcp", "router", layout, secret=SECRET, engine_id="d")


def test_staged_path_through_the_kernel_interface():
    """GPU caches take this path (gather -> staging -> bytes -> staging -> scatter); here on CPU."""
    layout = KVLayout(3, 2, 16, 8, "bfloat16")
    with create_connector("tcp", "prefill", layout, secret=SECRET, engine_id="p", direct_io=False,
                          chunk_bytes=4096) as prefill, \
            create_connector("tcp", "decode", layout, secret=SECRET, engine_id="d", direct_io=False,
                             chunk_bytes=4096) as decode:
        src = prefill.worker.allocate_kv_caches(64)
        fill(src, seed=9)
        dst = decode.worker.allocate_kv_caches(64)
        handle = prefill.publish("staged", [5, 9, 2, 40, 41, 42], 48)
        decode.start_pull("staged", handle, [60, 0, 1, 2, 30, 31])
        assert wait_events(decode, ["staged"]).finished == ["staged"]
        assert blocks_bytes(dst, [60, 0, 1, 2, 30, 31]) == blocks_bytes(src, [5, 9, 2, 40, 41, 42])
        deadline = time.monotonic() + 10
        while prefill.num_published_blocks and time.monotonic() < deadline:  # the release is one way
            time.sleep(0.002)
        assert prefill.get_finished().finished == ["staged"] and prefill.num_published_blocks == 0


def test_allowed_peers_and_nothing_to_pull():
    layout = KVLayout(2, 1, 8, 4, "float32")
    with create_connector("tcp", "prefill", layout, secret=SECRET, engine_id="p",
                          allowed_peers=["192.0.2.1"]) as walled, \
            create_connector("tcp", "prefill", layout, secret=SECRET, engine_id="q") as prefill, \
            create_connector("tcp", "decode", layout, secret=SECRET, engine_id="d", timeout_s=5) as decode:
        for connector in (walled, prefill):
            connector.worker.allocate_kv_caches(8)
        decode.worker.allocate_kv_caches(8)
        refused = walled.publish("r", [1], 4)
        decode.start_pull("r", refused, [0])
        assert isinstance(wait_events(decode, ["r"]).failed["r"], wire.PeerLost)  # 127.0.0.1 is not allowed
        # the pull, and the abort the decode side sends after it fails, are both turned away
        assert walled.stats()["rejected_peers"] >= 1 and walled.num_published_blocks == 1
        # every block already cached on the decode side: an empty pull just releases the lease
        cached = prefill.publish("cached", [1, 2], 8)
        decode.start_pull("cached", cached, [], first_block=2).result(timeout=5)
        assert prefill.get_finished().finished == ["cached"]
        assert decode.stats()["bytes_received"] == 0 and prefill.stats().get("bytes_sent", 0) == 0
