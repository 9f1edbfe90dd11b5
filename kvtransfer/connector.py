"""Connector interfaces: the scheduler-facing connector (request ids, block ids, events) and the
worker-facing transports (KV cache tensors, bytes).

The engine scheduler talks to a `KVConnector` (PrefillConnector or DecodeConnector); the model
runner hands its KV caches to `connector.worker`. Transports only move bytes; leases,
authentication and bookkeeping live in the connectors, identical for every transport.
"""
from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvtransfer.errors import BlockRangeError, KVTransferError
from kvtransfer.layout import KVLayout
from kvtransfer.lease import FreedBlocks


@dataclass
class TransferEvents:
    """What happened since the last `get_finished()`; collected without blocking.

    decode: `finished` pulls have their blocks in place and the lease released (a pull from several
    prefill ranks releases each right after it is reported, once every part is in); `failed` pulls
    (error, deadline, abort) no longer touch their reserved blocks, which the engine may reuse.
    A failure is a KVTransferError, unless the pull hit a bug (any other exception, as raised).
    prefill: `finished` requests were pulled and released by a decode instance; `freed` lists
    every lease whose blocks went back to the owner (released, expired or aborted).
    """
    finished: list[str] = field(default_factory=list)
    failed: dict[str, Exception] = field(default_factory=dict)
    freed: list[FreedBlocks] = field(default_factory=list)


class KVConnector(ABC):
    """Scheduler-facing part, common to both roles. Never blocks on the network."""
    role: str

    @property
    @abstractmethod
    def worker(self) -> "Transport":
        """The worker-facing part: register (or allocate) the KV caches through it."""

    @abstractmethod
    def get_finished(self) -> TransferEvents:
        """Drain completions and failures since the last call."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters (published, released, expired, aborted, failed, bytes, ...)."""

    @abstractmethod
    def close(self) -> None:
        """Stop threads and close connections; idempotent."""

    def __enter__(self) -> "KVConnector":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def no_delay(sock: socket.socket) -> socket.socket:
    """Control messages are small and come in pairs (Finish, then the next Pull): Nagle plus
    delayed ACKs would hold the second one for 40 ms. Buffer sizes stay the kernel's: setting
    SO_RCVBUF would switch off receive-window autotuning, which goes further on loopback."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Transport(ABC):
    """Worker-facing part: owns references to the registered KV caches and moves their bytes."""
    name: str

    def __init__(self, layout: KVLayout, kernel_backend: Any = None):
        self.layout = layout
        self._kernel_backend = kernel_backend
        self.kv_caches: list[torch.Tensor] | None = None
        self.num_blocks = 0

    @property
    def kernels(self) -> Any:
        if self._kernel_backend is None:
            from kernels import get_backend

            self._kernel_backend = get_backend("auto", self.layout.device)
        return self._kernel_backend

    def allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """Allocate caches this transport can serve (shm needs shared memory) and register them."""
        caches = [torch.zeros(self.layout.cache_shape(num_blocks), dtype=self.layout.torch_dtype,
                              device=self.layout.device) for _ in range(self.layout.num_layers)]
        self.register_kv_caches(caches)
        return caches

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self.num_blocks = self.layout.check_kv_caches(kv_caches)
        self.kv_caches = list(kv_caches)

    def check_block_ids(self, block_ids: Sequence[int]) -> None:
        if self.kv_caches is None:
            raise KVTransferError("no KV caches registered")
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise BlockRangeError(f"block ids {bad[:8]} outside [0, {self.num_blocks})")

    def close(self) -> None:
        pass


class PrefillTransport(Transport):
    """Serves pulls. One `peer` object per authenticated control connection."""

    def listen(self, host: str, port: int, advertise_host: str) -> tuple[socket.socket, str]:
        """Bind the control socket; returns it and the endpoint string written into handles
        (`advertise_host`: the address peers reach, when binding 0.0.0.0)."""
        sock = socket.create_server((host, port), backlog=64)
        return sock, f"tcp://{advertise_host}:{sock.getsockname()[1]}"

    def open_peer(self, sock: socket.socket, client_info: dict) -> tuple[Any, dict, list[int]]:
        """Per-connection setup; returns (peer state, info for the client, fds to pass)."""
        return None, {}, []

    @abstractmethod
    def send_blocks(self, peer: Any, sock: socket.socket, block_ids: list[int],
                    transfer_id: int, timeout_s: float, heads: tuple[int, int] | None = None) -> None:
        """Move the blocks to the puller after `PullReady`; raise on any failure. `heads`: only
        that local head range [h0, h1) of each block (a decode of another TP size), in the wire
        order (layer, K/V, block, token, head) of a contiguous [.., h1 - h0, head_dim] buffer."""

    def close_peer(self, peer: Any) -> None:
        pass


class DecodeTransport(Transport):
    """Runs pulls. One `peer` object per control connection to a prefill endpoint."""

    def client_info(self) -> dict:
        return {}

    def connect(self, endpoint: str, timeout_s: float) -> socket.socket:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        return no_delay(socket.create_connection((host, int(port)), timeout=timeout_s))

    def open_peer(self, sock: socket.socket, server_info: dict, fds: list[int]) -> Any:
        return None

    @property
    def max_fds(self) -> int:
        return 0

    @abstractmethod
    def recv_blocks(self, peer: Any, sock: socket.socket, local_block_ids: list[int],
                    remote_block_ids: list[int], transfer_id: int, deadline: float,
                    heads: tuple[int, int] | None = None, remote_heads: tuple[int, int] | None = None) -> None:
        """Fill the local blocks; only ever writes into `local_block_ids` (only their local head
        range `heads`, when given; `remote_heads` is the same heads in the prefill rank's cache)."""

    def close_peer(self, peer: Any) -> None:
        pass
