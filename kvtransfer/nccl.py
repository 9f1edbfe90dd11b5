"""nccl transport: torch.distributed point-to-point send/recv between the prefill (rank 0)
and the decode (rank 1) of one control connection.

Each connection gets its own two-rank process group, rendezvoused through a TCPStore that
the prefill side hosts next to its control socket. The backend is NCCL for CUDA caches and
gloo for CPU caches: the same code path, which is how it is tested without GPUs.
"""
from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from kvtransfer.connector import DecodeTransport, PrefillTransport
from kvtransfer.errors import PeerLost, ProtocolError, TransferTimeout
from kvtransfer.layout import KVLayout
from kvtransfer.staging import DEFAULT_CHUNK_BYTES, Staging

PREFILL_RANK, DECODE_RANK = 0, 1


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class _Pair:
    """One connection's process group, created on its first transfer (both sides then join)."""

    def __init__(self, store: Any, key: str, rank: int, backend: str, staging: Staging):
        self.store, self.key, self.rank, self.backend, self.staging = store, key, rank, backend, staging
        self.group: Any = None

    def join(self, deadline: float) -> Any:
        if self.group is None:
            timeout = timedelta(seconds=max(deadline - time.monotonic(), 1.0))
            prefixed = dist.PrefixStore(f"pdserve-kv/{self.key}", self.store)
            if self.backend == "nccl":
                self.group = dist.ProcessGroupNCCL(prefixed, self.rank, 2)
            else:
                self.group = dist.ProcessGroupGloo(prefixed, self.rank, 2, timeout)
        return self.group

    def start(self, buf: torch.Tensor, send: bool, chunk: int, deadline: float) -> Callable[[], None]:
        """Post one send/recv; returns the wait for it (gloo and NCCL report a dead peer, a lost
        store and a timeout all as RuntimeError)."""
        if buf.element_size() == 1 and buf.dtype != torch.uint8:  # an fp8 cache: moved as its bytes (not
            buf = buf.view(torch.uint8)                           # every NCCL build takes fp8 dtypes)
        try:
            group = self.join(deadline)
            work = group.send([buf], 1 - self.rank, chunk) if send else group.recv([buf], 1 - self.rank, chunk)
        except RuntimeError as e:
            raise self._error(e, deadline) from None

        def wait() -> None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeout(f"{self.backend} transfer passed its deadline")
            try:
                work.wait(timedelta(seconds=remaining))
            except RuntimeError as e:
                raise self._error(e, deadline) from None

        return wait

    def close(self) -> None:
        """Tear the group down now: left to the garbage collector, gloo's threads can abort the process."""
        if self.group is not None:
            try:
                self.group.abort()
            except RuntimeError:
                pass
            self.group = None

    def _error(self, e: RuntimeError, deadline: float) -> Exception:
        if time.monotonic() >= deadline or "timed out" in str(e).lower():
            return TransferTimeout(f"{self.backend} transfer passed its deadline")
        return PeerLost(f"{self.backend} peer lost: {e}")


class NcclPrefillTransport(PrefillTransport):
    name = "nccl"

    def __init__(self, layout: KVLayout, kernel_backend: Any = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        super().__init__(layout, kernel_backend)
        self.backend = backend_for(layout.device)
        self.chunk_bytes = chunk_bytes
        self._store: Any = None

    def listen(self, host: str, port: int, advertise_host: str) -> tuple[socket.socket, str]:
        sock, endpoint = super().listen(host, port, advertise_host)
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        return sock, endpoint

    def open_peer(self, sock: socket.socket, client_info: dict) -> tuple[Any, dict, list[int]]:
        key = os.urandom(8).hex()
        pair = _Pair(self._store, key, PREFILL_RANK, self.backend, Staging(self.layout, self.layout.device, self.chunk_bytes))
        return pair, {"store_port": self._store.port, "pair": key, "backend": self.backend}, []

    def send_blocks(self, peer: _Pair, sock: socket.socket, block_ids: list[int],
                    transfer_id: int, timeout_s: float, heads: tuple[int, int] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        chunks = iter(range(1 << 20))
        peer.staging.send(self.kernels, self.kv_caches, block_ids,
                          lambda buf: peer.start(buf, True, next(chunks), deadline), heads)

    def close_peer(self, peer: Any) -> None:
        if peer is not None:
            peer.close()

    def close(self) -> None:
        self._store = None


class NcclDecodeTransport(DecodeTransport):
    name = "nccl"

    def __init__(self, layout: KVLayout, kernel_backend: Any = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        super().__init__(layout, kernel_backend)
        self.backend = backend_for(layout.device)
        self.chunk_bytes = chunk_bytes

    def open_peer(self, sock: socket.socket, server_info: dict, fds: list[int]) -> Any:
        if server_info.get("backend") != self.backend:
            raise ProtocolError(f"peer uses {server_info.get('backend')}, this side {self.backend}")
        port, key = server_info.get("store_port"), server_info.get("pair")
        if not isinstance(port, int) or not isinstance(key, str) or not 0 < port < 65536:
            raise ProtocolError("bad process-group rendezvous in handshake")
        host = sock.getpeername()[0]
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        return _Pair(store, key, DECODE_RANK, self.backend, Staging(self.layout, self.layout.device, self.chunk_bytes))

    def recv_blocks(self, peer: _Pair, sock: socket.socket, local_block_ids: list[int],
                    remote_block_ids: list[int], transfer_id: int, deadline: float,
                    heads: tuple[int, int] | None = None, remote_heads: tuple[int, int] | None = None) -> None:
        chunks = iter(range(1 << 20))
        peer.staging.recv(self.kernels, self.kv_caches, local_block_ids,
                          lambda buf: peer.start(buf, False, next(chunks), deadline), heads)

    def close_peer(self, peer: Any) -> None:
        if peer is not None:
            peer.close()
