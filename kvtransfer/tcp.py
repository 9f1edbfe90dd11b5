"""tcp transport: the KV bytes follow `PullReady` on the control socket itself.

On CPU the blocks go straight from the prefill's cache to the decode's cache with vectored
I/O (sendmsg / recvmsg_into over the blocks' own memory: no staging copy on either side).
For GPU caches, or with direct_io=False, blocks are gathered into a staging buffer by the
kernel interface and streamed chunk by chunk through pinned host buffers, the copies of one
chunk on a side stream while the previous one is on the wire (kvtransfer.staging.HostStaging).
The wire carries the same bytes either way, so a CPU engine pulls from a GPU one and back.
"""
from __future__ import annotations

import socket
import struct
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from kvtransfer.connector import DecodeTransport, PrefillTransport
from kvtransfer.errors import PeerLost, TransferTimeout
from kvtransfer.layout import KVLayout
from kvtransfer.staging import DEFAULT_CHUNK_BYTES, HostStaging, as_bytes, block_views, cache_views

IOV_MAX = 1024
BATCH_BYTES = 4 << 20  # bytes of iovecs handed to one sendmsg / recvmsg_into call


def _kernel_timeout(sock: socket.socket, deadline: float) -> None:
    """Bound the next blocking call by the deadline (SO_RCVTIMEO / SO_SNDTIMEO)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransferTimeout("transfer deadline passed")
    timeval = struct.pack("ll", int(remaining), int(remaining % 1 * 1e6) or 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


@contextmanager
def _blocking(sock: socket.socket, deadline: float) -> Iterator[None]:
    """The bulk phase runs the socket in blocking mode: one sendmsg then queues a whole batch
    and one recvmsg_into(MSG_WAITALL) fills one, a few calls per transfer instead of one per
    wakeup (Python's own timeouts make sockets non-blocking). The kernel enforces the deadline."""
    previous = sock.gettimeout()
    sock.settimeout(None)
    try:
        _kernel_timeout(sock, deadline)
        yield
    except BlockingIOError:  # EAGAIN from SO_*TIMEO with nothing moved
        raise TransferTimeout("KV transfer passed its deadline") from None
    finally:
        zero = struct.pack("ll", 0, 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, zero)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, zero)
        sock.settimeout(previous)


def _advance(views: list[memoryview], i: int, n: int) -> int:
    """Consume n bytes from views[i:], shortening a partly done view in place; returns the new i."""
    while n > 0:
        size = len(views[i])
        if n >= size:
            n -= size
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i


def _batch(views: list[memoryview], i: int) -> list[memoryview]:
    j, size = i, 0
    while j < len(views) and j - i < IOV_MAX and size < BATCH_BYTES:
        size += len(views[j])
        j += 1
    return views[i:j]


def send_views(sock: socket.socket, views: list[memoryview], deadline: float) -> None:
    i = 0
    try:
        with _blocking(sock, deadline):
            while i < len(views):
                _kernel_timeout(sock, deadline)
                i = _advance(views, i, sock.sendmsg(_batch(views, i)))
    except OSError as e:
        raise PeerLost(f"connection lost while sending KV blocks: {e}") from None


def recv_views(sock: socket.socket, views: list[memoryview], deadline: float) -> None:
    i, total = 0, 0
    try:
        with _blocking(sock, deadline):
            while i < len(views):
                _kernel_timeout(sock, deadline)
                n = sock.recvmsg_into(_batch(views, i), 0, socket.MSG_WAITALL)[0]
                if n == 0:
                    raise PeerLost(f"stream truncated: peer closed after {total} bytes")
                total += n
                i = _advance(views, i, n)
    except ConnectionError as e:
        raise PeerLost(f"connection lost after {total} bytes: {e}") from None


class _Mode:
    """One side's choice between direct vectored I/O over the cache and staged chunks."""

    def __init__(self, layout: KVLayout, direct_io: bool | None, chunk_bytes: int):
        self.layout = layout
        self.requested = direct_io
        self.chunk_bytes = chunk_bytes
        self.direct = False
        self.flat: list[memoryview] = []

    def register(self, kv_caches: Sequence[torch.Tensor]) -> None:
        on_cpu = kv_caches[0].device.type == "cpu"
        if self.requested and not on_cpu:
            raise ValueError("direct_io needs CPU KV caches")
        self.direct = on_cpu if self.requested is None else self.requested
        self.flat = cache_views(kv_caches) if self.direct else []

    def peer_state(self) -> HostStaging:
        """Staging for GPU caches, and for head ranges (strided in the cache) on any device; its
        buffers grow on first use, so a direct-I/O connection that never needs them costs nothing."""
        return HostStaging(self.layout, self.layout.device, self.chunk_bytes)


class TcpPrefillTransport(PrefillTransport):
    name = "tcp"

    def __init__(self, layout: KVLayout, kernel_backend: Any = None, direct_io: bool | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        super().__init__(layout, kernel_backend)
        self.mode = _Mode(layout, direct_io, chunk_bytes)

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self.mode.register(kv_caches)

    def open_peer(self, sock: socket.socket, client_info: dict) -> tuple[Any, dict, list[int]]:
        return self.mode.peer_state(), {}, []

    def send_blocks(self, peer: Any, sock: socket.socket, block_ids: list[int],
                    transfer_id: int, timeout_s: float, heads: tuple[int, int] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        if self.mode.direct and heads is None:
            send_views(sock, block_views(self.mode.flat, self.layout, self.num_blocks, block_ids), deadline)
        else:
            peer.send_host(self.kernels, self.kv_caches, block_ids,
                           lambda host: send_views(sock, [as_bytes(host)], deadline), heads)


class TcpDecodeTransport(DecodeTransport):
    name = "tcp"

    def __init__(self, layout: KVLayout, kernel_backend: Any = None, direct_io: bool | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        super().__init__(layout, kernel_backend)
        self.mode = _Mode(layout, direct_io, chunk_bytes)

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self.mode.register(kv_caches)

    def open_peer(self, sock: socket.socket, server_info: dict, fds: list[int]) -> Any:
        return self.mode.peer_state()

    def recv_blocks(self, peer: Any, sock: socket.socket, local_block_ids: list[int],
                    remote_block_ids: list[int], transfer_id: int, deadline: float,
                    heads: tuple[int, int] | None = None, remote_heads: tuple[int, int] | None = None) -> None:
        if self.mode.direct and heads is None:
            recv_views(sock, block_views(self.mode.flat, self.layout, self.num_blocks, local_block_ids), deadline)
            return
        peer.recv_host(self.kernels, self.kv_caches, local_block_ids,
                       lambda host: recv_views(sock, [as_bytes(host)], deadline), heads)
