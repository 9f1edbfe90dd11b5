"""tcp transport: the KV bytes follow `PullReady` on the control socket itself.

On CPU the blocks go straight from the prefill's cache to the decode's cache with vectored
I/O (sendmsg / recvmsg_into over the blocks' own memory: no staging copy on either side).
For GPU caches, or with direct_io=False, blocks are gathered into a staging buffer by the
kernel interface and streamed chunk by chunk.
"""
from __future__ import annotations

import socket
import time
from typing import Any, Callable, Sequence

import torch

from kvtransfer.connector import DecodeTransport, PrefillTransport
from kvtransfer.errors import PeerLost, TransferTimeout
from kvtransfer.layout import KVLayout
from kvtransfer.staging import DEFAULT_CHUNK_BYTES, Staging, as_bytes, block_views, cache_views

IOV_MAX = 1024
MIN_BATCH, MAX_BATCH = 256 << 10, 16 << 20  # bytes of iovecs handed to one sendmsg/recvmsg_into


def _done() -> None:
    pass


def _set_deadline(sock: socket.socket, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransferTimeout("transfer deadline passed")
    sock.settimeout(remaining)


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


def _batch(views: list[memoryview], i: int, nbytes: int) -> list[memoryview]:
    """The next views worth about `nbytes`: Python re-exports (and the kernel re-imports) every
    view on each call, so a call is offered about what the socket moved last time, not more."""
    j, size = i, 0
    while j < len(views) and j - i < IOV_MAX and size < nbytes:
        size += len(views[j])
        j += 1
    return views[i:j]


def _next_batch(moved: int) -> int:
    return min(max(2 * moved, MIN_BATCH), MAX_BATCH)


def send_views(sock: socket.socket, views: list[memoryview], deadline: float) -> None:
    i, want = 0, MIN_BATCH
    try:
        while i < len(views):
            _set_deadline(sock, deadline)
            n = sock.sendmsg(_batch(views, i, want))
            i, want = _advance(views, i, n), _next_batch(n)
    except socket.timeout:
        raise TransferTimeout("timed out sending KV blocks") from None
    except OSError as e:
        raise PeerLost(f"connection lost while sending KV blocks: {e}") from None


def recv_views(sock: socket.socket, views: list[memoryview], deadline: float) -> None:
    i, total, want = 0, 0, MIN_BATCH
    try:
        while i < len(views):
            _set_deadline(sock, deadline)
            n = sock.recvmsg_into(_batch(views, i, want))[0]
            if n == 0:
                raise PeerLost(f"stream truncated: peer closed after {total} bytes")
            total += n
            i, want = _advance(views, i, n), _next_batch(n)
    except socket.timeout:
        raise TransferTimeout(f"timed out receiving KV blocks after {total} bytes") from None
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

    def peer_state(self) -> Staging | None:
        return None if self.direct else Staging(self.layout, self.layout.device, self.chunk_bytes)


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
                    transfer_id: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        if self.mode.direct:
            send_views(sock, block_views(self.mode.flat, self.layout, self.num_blocks, block_ids), deadline)
        else:
            def start(buf: torch.Tensor) -> Callable[[], None]:
                send_views(sock, [as_bytes(buf.cpu())], deadline)  # a socket send is done when it returns
                return _done

            peer.send(self.kernels, self.kv_caches, block_ids, start)


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
                    remote_block_ids: list[int], transfer_id: int, deadline: float) -> None:
        if self.mode.direct:
            recv_views(sock, block_views(self.mode.flat, self.layout, self.num_blocks, local_block_ids), deadline)
            return

        def start(buf: torch.Tensor) -> Callable[[], None]:
            host = buf if buf.device.type == "cpu" else torch.empty_like(buf, device="cpu")
            recv_views(sock, [as_bytes(host)], deadline)
            if host is not buf:
                buf.copy_(host)
            return _done

        peer.recv(self.kernels, self.kv_caches, local_block_ids, start)
