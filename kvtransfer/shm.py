"""shm transport (same host): the prefill's KV cache lives in a sealed memfd that each decode
peer maps read-only; a pull is one copy from the prefill's blocks into the decode's blocks.

A GPU cache cannot live in a memfd: a GPU prefill keeps a host mirror there instead and stages
the pulled blocks into it (pinned buffers, side stream: kvtransfer.staging.HostStaging) before
it tells the puller, with one byte, that they are there; a GPU decode copies the blocks from the
mapping into pinned buffers and up to its cache chunk by chunk.

The memfd travels over the unix control socket (SCM_RIGHTS), so nothing is left in /dev/shm
if either process dies, and the decode side cannot write the prefill's memory (PROT_READ).
"""
from __future__ import annotations

import fcntl
import mmap
import os
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvtransfer.connector import DecodeTransport, PrefillTransport
from kvtransfer.errors import BlockRangeError, PeerLost, ProtocolError, TransferTimeout
from kvtransfer.layout import KVLayout
from kvtransfer.staging import HostStaging, as_bytes, block_views, cache_views, paired_runs, scatter_heads

STAGED = b"\x01"  # a GPU prefill's "the blocks are in the mirror now"


def _tensors(buf: Any, layout: KVLayout, num_blocks: int) -> list[torch.Tensor]:
    """Per-layer cache tensors over one mapping laid out layer after layer."""
    layer_bytes = num_blocks * layout.block_bytes_per_layer
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=layer_bytes * layout.num_layers)
    return [flat[i * layer_bytes:(i + 1) * layer_bytes].view(layout.torch_dtype).view(layout.cache_shape(num_blocks))
            for i in range(layout.num_layers)]


def copy_blocks(src: Sequence[memoryview], src_blocks: int, src_ids: Sequence[int],
                dst: Sequence[memoryview], dst_blocks: int, dst_ids: Sequence[int],
                half_block_bytes: int, deadline: float) -> None:
    """dst block dst_ids[j] = src block src_ids[j], every layer, K and V: one memcpy per piece
    (runs consecutive on both sides merged). Slicing memoryviews costs about a microsecond and
    is bounds-checked, so random block ids still copy near memcpy speed, safely."""
    runs = paired_runs(src_ids, dst_ids)
    h = half_block_bytes
    for src_layer, dst_layer in zip(src, dst):
        if time.monotonic() > deadline:
            raise TransferTimeout("shm copy passed its deadline")
        for src_base, dst_base in ((0, 0), (src_blocks * h, dst_blocks * h)):  # K, then V
            for s, d, n in runs:
                dst_layer[dst_base + d * h:dst_base + (d + n) * h] = src_layer[src_base + s * h:src_base + (s + n) * h]


def _staged(layout: KVLayout, host_staging: bool | None) -> bool:
    """Through pinned host buffers: GPU caches always; CPU caches only when asked (tests)."""
    return torch.device(layout.device).type != "cpu" if host_staging is None else host_staging


class ShmPrefillTransport(PrefillTransport):
    name = "shm"

    def __init__(self, layout: KVLayout, kernel_backend: Any = None, host_staging: bool | None = None):
        super().__init__(layout, kernel_backend)
        self.host_staging = _staged(layout, host_staging)
        self._fd = -1
        self._map: mmap.mmap | None = None
        self._size = 0
        self._mirror: list[torch.Tensor] | None = None  # GPU caches: their host copy in the memfd

    def listen(self, host: str, port: int, advertise_host: str) -> tuple[socket.socket, str]:
        name = f"pdserve-kv-{os.getpid()}-{os.urandom(6).hex()}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("\0" + name)  # abstract namespace: no file to leak
        sock.listen(64)
        return sock, f"unix:@{name}"

    def allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        if self._fd >= 0:
            raise RuntimeError("KV caches already allocated")
        size = num_blocks * self.layout.block_bytes
        fd = os.memfd_create("pdserve-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        self._fd, self._size, self._map = fd, size, mmap.mmap(fd, size)
        caches = _tensors(self._map, self.layout, num_blocks)
        if self.host_staging:
            self._mirror = caches
            caches = [torch.zeros(self.layout.cache_shape(num_blocks), dtype=self.layout.torch_dtype,
                                  device=self.layout.device) for _ in range(self.layout.num_layers)]
        super().register_kv_caches(caches)
        return caches

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if self.kv_caches is None or any(a.data_ptr() != b.data_ptr() for a, b in zip(kv_caches, self.kv_caches)):
            raise ValueError("the shm transport serves only KV caches made by worker.allocate_kv_caches()")

    def open_peer(self, sock: socket.socket, client_info: dict) -> tuple[Any, dict, list[int]]:
        if self._fd < 0:
            raise ProtocolError("no KV caches allocated yet")
        staged = self._mirror is not None
        peer = HostStaging(self.layout, self.layout.device) if staged else None
        return peer, {"num_blocks": self.num_blocks, "size": self._size, "staged": staged,
                      "num_kv_heads": self.layout.num_kv_heads}, [self._fd]

    def send_blocks(self, peer: Any, sock: socket.socket, block_ids: list[int],
                    transfer_id: int, timeout_s: float, heads: tuple[int, int] | None = None) -> None:
        """CPU caches: nothing to send, the puller reads the blocks (the pinned lease keeps them
        until `Finish`). GPU caches: stage them (only `heads` of them, when given) into the
        mirror first, then say so."""
        if peer is None:
            return
        ids = torch.tensor(block_ids, dtype=torch.long)
        first_layer = [0]

        def to_mirror(host: torch.Tensor) -> None:
            l0 = first_layer[0]
            mirror = self._mirror[l0:l0 + host.shape[0]]
            if heads is None:
                for layer, blocks in zip(mirror, host):
                    layer[:, ids] = blocks
            else:
                scatter_heads(host, mirror, block_ids, ids, heads)
            first_layer[0] += host.shape[0]

        peer.send_host(self.kernels, self.kv_caches, block_ids, to_mirror, heads)
        sock.sendall(STAGED)

    def close(self) -> None:
        self.kv_caches = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(eq=False)
class _PeerMapping:
    key: tuple[int, int, int]  # (device, inode, size) of the peer's memfd
    layers: list[memoryview]
    num_blocks: int
    staged: bool  # a GPU prefill: wait for its STAGED byte before reading
    num_kv_heads: int  # of the peer's shard: a prefill of another TP size holds more or fewer
    connections: int = 0

    def copy_heads(self, layer: int, src_ids: Sequence[int], heads: tuple[int, int], layout: KVLayout,
                   dst: torch.Tensor, dst_ids: Sequence[int]) -> None:
        """dst[:, dst_ids[j]] = heads [h0, h1) of the peer's block src_ids[j] in `layer`; dst is
        uint8 [2, blocks, block_size, h1 - h0, head_dim * dtype bytes] (a strided view is fine).
        One strided copy per run of blocks consecutive on both sides."""
        with warnings.catch_warnings():  # the mapping is read-only (PROT_READ) and only ever read
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(self.layers[layer], dtype=torch.uint8).view(
                2, self.num_blocks, layout.block_size, self.num_kv_heads, layout.head_dim * layout.dtype_bytes)
        src = src[:, :, :, heads[0]:heads[1]]
        for s, d, n in paired_runs(src_ids, dst_ids):
            dst[:, d:d + n] = src[:, s:s + n]


class ShmDecodeTransport(DecodeTransport):
    name = "shm"

    def __init__(self, layout: KVLayout, kernel_backend: Any = None, host_staging: bool | None = None):
        super().__init__(layout, kernel_backend)
        self.host_staging = _staged(layout, host_staging)
        self._peers_lock = threading.Lock()
        self._peers: dict[tuple[int, int, int], _PeerMapping] = {}
        self._flat: list[memoryview] | None = None
        self._staging = threading.local()  # GPU caches: one HostStaging per transfer thread

    def connect(self, endpoint: str, timeout_s: float) -> socket.socket:
        if not endpoint.startswith("unix:@"):
            raise ProtocolError(f"shm endpoint must be unix:@name, got {endpoint!r}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect("\0" + endpoint.removeprefix("unix:@"))
        except BaseException:
            sock.close()
            raise
        return sock

    @property
    def max_fds(self) -> int:
        return 1

    def open_peer(self, sock: socket.socket, server_info: dict, fds: list[int]) -> Any:
        """Map the peer's cache read-only, once per peer: every connection to the same prefill
        (each brings its own fd of the same memfd) shares one mapping, so its pages are faulted
        in once, by the pulls that read them, not per connection. (MAP_POPULATE of a whole
        cache would allocate every page of it up front, holding the GIL for seconds.)"""
        try:
            if len(fds) != 1:
                raise ProtocolError("the shm handshake must pass exactly one memfd")
            num_blocks, size = int(server_info.get("num_blocks", -1)), int(server_info.get("size", -1))
            num_kv_heads = int(server_info.get("num_kv_heads", self.layout.num_kv_heads))
            st = os.fstat(fds[0])
            block_bytes = self.layout.num_layers * self.layout.head_bytes_per_layer(max(num_kv_heads, 0))
            if num_blocks <= 0 or num_kv_heads <= 0 or size != num_blocks * block_bytes or st.st_size < size:
                raise ProtocolError(f"shm peer announced {num_blocks} blocks in {size} bytes: inconsistent")
            key = (st.st_dev, st.st_ino, size)
            with self._peers_lock:
                peer = self._peers.get(key)
                if peer is None:
                    mapping = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                    layer_bytes = size // self.layout.num_layers
                    view = memoryview(mapping)
                    peer = self._peers[key] = _PeerMapping(
                        key, [view[i * layer_bytes:(i + 1) * layer_bytes] for i in range(self.layout.num_layers)],
                        num_blocks, bool(server_info.get("staged", False)), num_kv_heads)
                peer.connections += 1
                return peer
        finally:
            for fd in fds:
                os.close(fd)

    def close_peer(self, peer: Any) -> None:
        if peer is None:
            return
        with self._peers_lock:
            peer.connections -= 1
            if peer.connections == 0 and self._peers.get(peer.key) is peer:
                del self._peers[peer.key]  # the mapping goes when the last view does

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._flat = None if self.host_staging else cache_views(kv_caches)

    def recv_blocks(self, peer: Any, sock: socket.socket, local_block_ids: list[int],
                    remote_block_ids: list[int], transfer_id: int, deadline: float,
                    heads: tuple[int, int] | None = None, remote_heads: tuple[int, int] | None = None) -> None:
        if any(not 0 <= b < peer.num_blocks for b in remote_block_ids):
            raise BlockRangeError(f"remote block ids outside the peer's {peer.num_blocks} blocks")
        if peer.staged:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                if sock.recv(1) != STAGED:
                    raise PeerLost("the shm peer hung up before staging the blocks")
            except socket.timeout:
                raise TransferTimeout("the shm peer did not stage the blocks before the deadline") from None
        whole = heads is None and remote_heads is None and peer.num_kv_heads == self.layout.num_kv_heads
        remote_heads = remote_heads or (0, peer.num_kv_heads)
        heads = heads or (0, self.layout.num_kv_heads)
        if heads[1] - heads[0] != remote_heads[1] - remote_heads[0] or remote_heads[1] > peer.num_kv_heads:
            raise ProtocolError(f"heads {remote_heads} of the peer's {peer.num_kv_heads} do not fit local heads {heads}")
        if self._flat is not None and not whole:  # a head range: strided copies, straight cache to cache
            for layer, cache in enumerate(self.kv_caches):
                if time.monotonic() > deadline:
                    raise TransferTimeout("shm copy passed its deadline")
                peer.copy_heads(layer, remote_block_ids, remote_heads, self.layout,
                                cache.view(torch.uint8)[:, :, :, heads[0]:heads[1]], local_block_ids)
            return
        if self._flat is not None:
            copy_blocks(peer.layers, peer.num_blocks, remote_block_ids, self._flat, self.num_blocks,
                        local_block_ids, self.layout.half_block_bytes, deadline)
            return
        staging = getattr(self._staging, "staging", None)
        if staging is None:
            staging = self._staging.staging = HostStaging(self.layout, self.layout.device)
        first_layer = [0]

        def from_mapping(host: torch.Tensor) -> None:
            # The chunk's layers in wire order (layer, K/V, block) straight into the pinned buffer.
            if time.monotonic() > deadline:
                raise TransferTimeout("shm copy passed its deadline")
            l0 = first_layer[0]
            if not whole:
                for i, dst in enumerate(host.view(torch.uint8)):
                    peer.copy_heads(l0 + i, remote_block_ids, remote_heads, self.layout, dst,
                                    range(len(remote_block_ids)))
                first_layer[0] += host.shape[0]
                return
            dst, offset = as_bytes(host), 0
            for view in block_views(peer.layers[l0:l0 + host.shape[0]], self.layout, peer.num_blocks,
                                    remote_block_ids):
                dst[offset:offset + len(view)] = view
                offset += len(view)
            first_layer[0] += host.shape[0]

        staging.recv_host(self.kernels, self.kv_caches, local_block_ids, from_mapping, None if whole else heads)
