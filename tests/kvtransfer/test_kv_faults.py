"""Failure scenarios: the decode side gets a clear error in time, nothing else changes, and
the prefill side's published-block count always returns to zero."""
from __future__ import annotations

import os
import socket
import time

import msgspec
import pytest

from kvtransfer import (TRANSPORTS, AuthError, BlockRangeError, KVHandle, LayoutMismatch, LeaseExpired, PeerLost,
                        TransferAborted, TransferTimeout, wire)
from kv_peers import LAYOUTS, PREFILL_BLOCKS, SECRET, PrefillPeer, blocks_bytes, reference_caches, wait_events

LAYOUT = "f16-bs8-gqa"


@pytest.fixture(scope="module")
def tcp_prefill():
    peer = PrefillPeer("tcp")
    peer.endpoint = peer.open(LAYOUT, LAYOUTS[LAYOUT], PREFILL_BLOCKS, seed=5, lease_ttl_s=30.0)
    yield peer
    peer.close()


def _drained(stats, freed) -> bool:
    return stats["published_blocks"] == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefill_killed_mid_transfer(transport, make_decode):
    peer = PrefillPeer(transport, stall="hang")  # stops right after granting the pull
    try:
        peer.open(LAYOUT, LAYOUTS[LAYOUT], PREFILL_BLOCKS, seed=5)
        decode, caches = make_decode(transport, LAYOUT, timeout_s=15.0)
        handle = peer.publish(LAYOUT, "doomed", list(range(40)), 320)
        others = blocks_bytes(caches, list(range(100, 140)))
        start = time.monotonic()
        decode.start_pull("doomed", handle, list(range(40, 80)))
        assert peer.stalled.wait(15), "the prefill never granted the pull"
        peer.kill()
        events = wait_events(decode, ["doomed"], timeout=20)
    finally:
        peer.kill()
    assert time.monotonic() - start < 15.0  # within the pull's deadline
    assert decode.num_inflight == 0  # the reserved blocks are the engine's again
    assert blocks_bytes(caches, list(range(100, 140))) == others
    if transport == "shm":
        # the decode side reads the granted (pinned) blocks itself, from a mapping that
        # outlives the prefill process: the pull completes, with the right bytes
        assert events.finished == ["doomed"]
        expected = reference_caches(LAYOUTS[LAYOUT], PREFILL_BLOCKS, 5)
        assert blocks_bytes(caches, list(range(40, 80))) == blocks_bytes(expected, list(range(40)))
    else:
        assert isinstance(events.failed["doomed"], (PeerLost, TransferTimeout)), events.failed
        assert decode.stats()["failed"] == 1


def test_lease_expiry_frees_blocks_when_decode_never_pulls(tcp_prefill):
    tcp_prefill.publish(LAYOUT, "never-pulled", [7, 8, 9], 24, 0.2)
    stats = tcp_prefill.wait_for(LAYOUT, lambda s, freed: any(
        f["request_id"] == "never-pulled" and f["reason"] == "expired" for f in freed))
    assert stats["expired"] >= 1 and stats["published_blocks"] == 0


def test_expired_lease_is_refused(tcp_prefill, make_decode):
    decode, caches = make_decode("tcp", LAYOUT)
    handle = tcp_prefill.publish(LAYOUT, "late", [10, 11], 16, 0.2)
    tcp_prefill.wait_for(LAYOUT, lambda s, freed: any(f["request_id"] == "late" for f in freed))
    before = blocks_bytes(caches, [0, 1])
    decode.start_pull("late", handle, [0, 1])
    assert isinstance(wait_events(decode, ["late"]).failed["late"], LeaseExpired)
    assert blocks_bytes(caches, [0, 1]) == before


def test_bad_tag_and_layout_mismatch_refused_locally(tcp_prefill, make_decode):
    decode, caches = make_decode("tcp", LAYOUT)
    handle = tcp_prefill.publish(LAYOUT, "guarded", [20, 21, 22], 24)
    forged = msgspec.structs.replace(handle, block_ids=(0, 1, 2))  # someone else's blocks, same tag
    with pytest.raises(AuthError):
        decode.start_pull("guarded", forged, [0, 1, 2])
    other, _ = make_decode("tcp", "f32-bs16")
    with pytest.raises(LayoutMismatch):
        other.start_pull("guarded", handle, [0, 1, 2])
    with pytest.raises(BlockRangeError):
        decode.start_pull("guarded", handle, [0, 1, 10_000])  # not a local block
    with pytest.raises(BlockRangeError):
        decode.start_pull("guarded", handle, [0, 1, 2, 3])  # more than published
    # nothing changed: the lease is intact and a correct pull still works
    decode.start_pull("guarded", handle, [0, 1, 2])
    assert wait_events(decode, ["guarded"]).finished == ["guarded"]
    expected = reference_caches(LAYOUTS[LAYOUT], PREFILL_BLOCKS, 5)
    assert blocks_bytes(caches, [0, 1, 2]) == blocks_bytes(expected, [20, 21, 22])


def _resigned(handle: KVHandle, secret: bytes) -> KVHandle:
    return msgspec.structs.replace(handle, tag=b"").signed(secret)


def _session(endpoint: str, secret: bytes = SECRET) -> socket.socket:
    """A hand-rolled client: authenticates, then sends whatever a test wants."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    nonce = os.urandom(32)
    wire.send_msg(sock, wire.Hello("raw-client", nonce))
    challenge = wire.expect(sock, wire.Challenge)
    wire.send_msg(sock, wire.Auth(wire.proof(secret, b"client", nonce, challenge.nonce)))
    wire.expect(sock, wire.Welcome)
    return sock


def test_prefill_refuses_forged_handles_and_bad_requests(tcp_prefill):
    handle = tcp_prefill.publish(LAYOUT, "target", [30, 31], 16)
    fingerprint = handle.layout_fingerprint
    before = tcp_prefill.call("stats", LAYOUT)
    forged = msgspec.structs.replace(handle, block_ids=(0, 1))
    wrong_secret = _resigned(handle, b"x")
    cases = [
        (wire.Pull(1, forged.to_bytes(), 0, 2, fingerprint, 5.0), AuthError),
        (wire.Pull(2, wrong_secret.to_bytes(), 0, 2, fingerprint, 5.0), AuthError),
        (wire.Pull(3, handle.to_bytes(), 0, 2, "0" * 16, 5.0), LayoutMismatch),
        (wire.Pull(4, handle.to_bytes(), 1, 2, fingerprint, 5.0), BlockRangeError),
        (wire.Pull(5, handle.to_bytes(), 0, -1, fingerprint, 5.0), BlockRangeError),
        (wire.Release(forged.to_bytes()), AuthError),
    ]
    with _session(tcp_prefill.endpoint) as sock:
        for msg, error in cases:
            wire.send_msg(sock, msg)
            with pytest.raises(error):
                wire.recv_msg(sock)
    after = tcp_prefill.call("stats", LAYOUT)
    assert after["refused"] - before.get("refused", 0) == len(cases)
    assert after["published_blocks"] == before["published_blocks"]  # the lease is untouched
    assert after.get("bytes_sent", 0) == before.get("bytes_sent", 0)
    assert tcp_prefill.call("abort", LAYOUT, "target")
    tcp_prefill.wait_for(LAYOUT, _drained)


def _hung_up(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_unknown_peers_are_dropped(tcp_prefill, make_decode):
    before = tcp_prefill.call("stats", LAYOUT).get("rejected_peers", 0)
    with pytest.raises(PeerLost):  # wrong secret: the server hangs up without answering
        _session(tcp_prefill.endpoint, secret=b"not-the-deployment-secret")
    host, port = tcp_prefill.endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # not our protocol at all
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert _hung_up(sock)
    tcp_prefill.wait_for(LAYOUT, lambda s, f: s.get("rejected_peers", 0) >= before + 2)
    # a decode instance of another deployment cannot authenticate the prefill either
    stranger, _ = make_decode("tcp", LAYOUT, secret=b"other-deployment")
    handle = _resigned(tcp_prefill.publish(LAYOUT, "foreign", [1], 8), b"other-deployment")
    stranger.start_pull("foreign", handle, [0])
    assert isinstance(wait_events(stranger, ["foreign"]).failed["foreign"], AuthError)
    tcp_prefill.call("abort", LAYOUT, "foreign")
    tcp_prefill.wait_for(LAYOUT, _drained)


def test_truncated_stream_is_an_error_and_frees_the_blocks(make_decode):
    peer = PrefillPeer("tcp", stall="truncate", truncate_bytes=1000)
    try:
        # A long lease: only the decode side's abort can free the blocks within the wait below.
        peer.open(LAYOUT, LAYOUTS[LAYOUT], PREFILL_BLOCKS, seed=5, lease_ttl_s=300.0)
        decode, caches = make_decode("tcp", LAYOUT)
        handle = peer.publish(LAYOUT, "cut", [1, 2, 3], 24)
        untouched = blocks_bytes(caches, list(range(10, 50)))
        decode.start_pull("cut", handle, [5, 6, 7])
        error = wait_events(decode, ["cut"]).failed["cut"]
        assert isinstance(error, PeerLost) and "truncated" in str(error)
        assert blocks_bytes(caches, list(range(10, 50))) == untouched
        # The failed pull spent the handle: the prefill gets its blocks back now, not at expiry.
        stats = peer.wait_for(LAYOUT, _drained)
        assert stats["failed"] == 1 and stats["aborted"] == 1 and stats["expired"] == 0
    finally:
        peer.close()


def test_abort_on_either_side_frees_the_blocks(make_decode):
    peer = PrefillPeer("tcp", stall="hang")
    try:
        peer.open(LAYOUT, LAYOUTS[LAYOUT], PREFILL_BLOCKS, seed=5)
        decode, _ = make_decode("tcp", LAYOUT, timeout_s=2.0)  # the hung transfer pins its blocks until then
        # prefill side: the client went away before decode pulled
        gone = peer.publish(LAYOUT, "client-gone", [1, 2], 16)
        assert peer.call("abort", LAYOUT, "client-gone")
        decode.start_pull("client-gone", gone, [0, 1])
        assert isinstance(wait_events(decode, ["client-gone"]).failed["client-gone"], LeaseExpired)
        # decode side: abort stops an in-flight pull at once and frees the prefill's blocks
        stuck = peer.publish(LAYOUT, "stuck", [3, 4], 16)
        decode.start_pull("stuck", stuck, [2, 3])
        assert peer.stalled.wait(10)
        assert decode.abort("stuck")
        assert isinstance(wait_events(decode, ["stuck"], timeout=5).failed["stuck"], TransferAborted)
        stats = peer.wait_for(LAYOUT, _drained)
        assert stats["aborted"] == 2
    finally:
        peer.kill()
