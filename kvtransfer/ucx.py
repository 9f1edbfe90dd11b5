"""ucx transport (ucxx): staged chunks sent with UCX tag messages between endpoints created
from exchanged worker addresses (shared memory / CMA on one host, RDMA or NVLink on a cluster).

The control connection carries the addresses; chunks are tagged with the transfer id, so
concurrent pulls never match each other's messages. CUDA caches take the same path (UCX reads
`__cuda_array_interface__`); the progress thread then gets a CUDA context.
"""
from __future__ import annotations

import os
import select
import socket
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets variables this UCX build ignores
import ucxx._lib.libucxx as ucx_api  # noqa: E402 - a missing ucxx fails here, loudly
from ucxx._lib.arr import Array  # noqa: E402
from ucxx.exceptions import UCXError  # noqa: E402

from kvtransfer.connector import DecodeTransport, PrefillTransport
from kvtransfer.errors import PeerLost, ProtocolError, TransferTimeout
from kvtransfer.layout import KVLayout
from kvtransfer.staging import DEFAULT_CHUNK_BYTES, Staging

PROGRESS_EPOLL_TIMEOUT_MS = 1  # a blocking progress thread that still wakes every ms: low idle CPU


class UcxWorker:
    """One UCX context + worker per transport, progressed by its own thread."""

    def __init__(self, device: str):
        self.context = ucx_api.UCXContext({})
        self.worker = ucx_api.UCXWorker(self.context)
        if torch.device(device).type == "cuda":
            from ucxx._cuda_context import ensure_cuda_context

            self.worker.set_progress_thread_start_callback(ensure_cuda_context, cb_args=(torch.device(device).index or 0,))
        self.worker.start_progress_thread(polling_mode=False, epoll_timeout=PROGRESS_EPOLL_TIMEOUT_MS)
        self.address = bytes(self.worker.address.tobytes())
        self.lock = threading.Lock()  # request submission from several connection threads

    def endpoint(self, address: Any) -> Any:
        if not isinstance(address, bytes) or not 0 < len(address) <= 65536:
            raise ProtocolError("bad UCX worker address in handshake")
        with self.lock:
            addr = ucx_api.UCXAddress.create_from_buffer(np.frombuffer(address, dtype=np.uint8))
            return ucx_api.UCXEndpoint.create_from_worker_address(self.worker, addr, False)

    def start(self, ep: Any, buf: torch.Tensor, tag: int, send: bool, sock: socket.socket,
              deadline: float) -> tuple[Any, Callable[[], None]]:
        """Post a send or receive of one buffer; returns the request and the wait for it. The
        wait watches the control socket too, so a dead peer fails fast without UCX error handling."""
        if send and buf.is_cuda:
            torch.cuda.current_stream(buf.device).synchronize()  # the gather must land before UCX reads
        flat = buf.reshape(-1).view(torch.uint8)  # the memory stays alive in the Staging buffers
        arr = Array(flat if flat.is_cuda else flat.numpy())
        with self.lock:
            try:
                req = (ep.tag_send if send else ep.tag_recv)(arr, ucx_api.UCXXTag(tag))
            except UCXError as e:
                raise PeerLost(f"UCX could not post the transfer: {e}") from None

        def wait() -> None:
            while not req.completed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeout("UCX transfer passed its deadline")
                readable, _, _ = select.select([sock], [], [], min(remaining, 0.0005))
                if readable and not sock.recv(1, socket.MSG_PEEK):
                    raise PeerLost("peer closed the control connection during a UCX transfer")
            try:
                req.check_error()
            except UCXError as e:
                raise PeerLost(f"UCX transfer failed: {e}") from None

        return req, wait

    def close(self) -> None:
        self.worker.stop_progress_thread()


class _Peer:
    def __init__(self, ep: Any, staging: Staging):
        self.ep, self.staging = ep, staging
        self.requests: list[Any] = []  # posted on this endpoint and maybe not completed

    def track(self, req: Any) -> None:
        self.requests = [r for r in self.requests if not r.completed] + [req]

    @property
    def idle(self) -> bool:
        return all(r.completed for r in self.requests)


def _tag(transfer_id: int, chunk: int) -> int:
    return (transfer_id * 4096 + chunk) % (1 << 64)


class _UcxSide:
    """What both ends share: the worker, and retiring endpoints safely."""

    def __init__(self, layout: KVLayout, chunk_bytes: int):
        self.ucx = UcxWorker(layout.device)
        self.chunk_bytes = chunk_bytes
        # Closing an endpoint cancels what was posted on it, but until those requests have
        # completed UCX may still touch their staging buffers: keep such peers referenced.
        self.retired: list[_Peer] = []

    def start(self, peer: _Peer, buf: torch.Tensor, tag: int, send: bool, sock: socket.socket,
              deadline: float) -> Callable[[], None]:
        req, wait = self.ucx.start(peer.ep, buf, tag, send, sock, deadline)
        peer.track(req)
        return wait

    def close_peer(self, peer: _Peer | None) -> None:
        if peer is not None:
            peer.ep.close()
            self.retired.append(peer)
        self.retired = [p for p in self.retired if not p.idle]

    def close(self) -> None:
        self.ucx.close()
        self.retired.clear()


class UcxPrefillTransport(PrefillTransport):
    name = "ucx"

    def __init__(self, layout: KVLayout, kernel_backend: Any = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        super().__init__(layout, kernel_backend)
        self.side = _UcxSide(layout, chunk_bytes)

    def open_peer(self, sock: socket.socket, client_info: dict) -> tuple[Any, dict, list[int]]:
        ep = self.side.ucx.endpoint(client_info.get("ucx_address"))
        return _Peer(ep, Staging(self.layout, self.layout.device, self.side.chunk_bytes)), \
            {"ucx_address": self.side.ucx.address}, []

    def send_blocks(self, peer: _Peer, sock: socket.socket, block_ids: list[int],
                    transfer_id: int, timeout_s: float, heads: tuple[int, int] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        chunks = iter(range(1 << 12))

        def start(buf: torch.Tensor) -> Callable[[], None]:
            return self.side.start(peer, buf, _tag(transfer_id, next(chunks)), True, sock, deadline)

        peer.staging.send(self.kernels, self.kv_caches, block_ids, start, heads)

    def close_peer(self, peer: Any) -> None:
        self.side.close_peer(peer)

    def close(self) -> None:
        self.side.close()


class UcxDecodeTransport(DecodeTransport):
    name = "ucx"

    def __init__(self, layout: KVLayout, kernel_backend: Any = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        super().__init__(layout, kernel_backend)
        self.side = _UcxSide(layout, chunk_bytes)

    def client_info(self) -> dict:
        return {"ucx_address": self.side.ucx.address}

    def open_peer(self, sock: socket.socket, server_info: dict, fds: list[int]) -> Any:
        ep = self.side.ucx.endpoint(server_info.get("ucx_address"))
        return _Peer(ep, Staging(self.layout, self.layout.device, self.side.chunk_bytes))

    def recv_blocks(self, peer: _Peer, sock: socket.socket, local_block_ids: list[int],
                    remote_block_ids: list[int], transfer_id: int, deadline: float,
                    heads: tuple[int, int] | None = None, remote_heads: tuple[int, int] | None = None) -> None:
        chunks = iter(range(1 << 12))

        def start(buf: torch.Tensor) -> Callable[[], None]:
            return self.side.start(peer, buf, _tag(transfer_id, next(chunks)), False, sock, deadline)

        peer.staging.recv(self.kernels, self.kv_caches, local_block_ids, start, heads)

    def close_peer(self, peer: Any) -> None:
        self.side.close_peer(peer)

    def close(self) -> None:
        self.side.close()


