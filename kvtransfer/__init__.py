"""Moving paged KV blocks between engines: leases, authenticated handles, four transports.

Importing the package (handles, layouts, errors) does not import torch; the connectors do.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from kvtransfer.errors import (AuthError, BlockRangeError, KVTransferError, LayoutMismatch, LeaseExpired,
                               PeerLost, ProtocolError, TransferAborted, TransferTimeout, UnknownRequest)
from kvtransfer.handle import KVHandle, KVShardRef, merge_shard_handles
from kvtransfer.layout import KVLayout, KVShard
from kvtransfer.lease import FreedBlocks

if TYPE_CHECKING:
    from kvtransfer.decode import DecodeConnector
    from kvtransfer.prefill import PrefillConnector

TRANSPORTS = ("tcp", "shm", "ucx", "nccl")
ROLES = ("prefill", "decode")


def _transport_classes(transport: str) -> tuple[type, type]:
    if transport == "tcp":
        from kvtransfer.tcp import TcpDecodeTransport, TcpPrefillTransport
        return TcpPrefillTransport, TcpDecodeTransport
    if transport == "shm":
        from kvtransfer.shm import ShmDecodeTransport, ShmPrefillTransport
        return ShmPrefillTransport, ShmDecodeTransport
    if transport == "ucx":
        from kvtransfer.ucx import UcxDecodeTransport, UcxPrefillTransport
        return UcxPrefillTransport, UcxDecodeTransport
    if transport == "nccl":
        from kvtransfer.nccl import NcclDecodeTransport, NcclPrefillTransport
        return NcclPrefillTransport, NcclDecodeTransport
    raise ValueError(f"unknown KV transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")


def create_connector(transport: str, role: str, layout: KVLayout, *, secret: bytes, engine_id: str,
                     auth_token: bytes = b"",
                     host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                     lease_ttl_s: float = 30.0,
                     on_blocks_freed: Callable[[str, tuple[int, ...]], None] | None = None,
                     allowed_peers: Sequence[str] | None = None, num_workers: int = 4,
                     timeout_s: float = 30.0, kernel_backend: Any = None,
                     **transport_options: Any) -> "PrefillConnector | DecodeConnector":
    """Build one engine's connector.

    prefill: serves pulls on host:port (port 0 = any; handles name advertise_host, default
    host) and signs handles with `secret`; leases last `lease_ttl_s` unless extended;
    decode: pulls with `num_workers` threads, each pull bounded by `timeout_s` by default.
    Control connections open with a mutual challenge-response on `secret` and `auth_token` (the
    engines' gRPC token, when the deployment sets one): a peer that lacks either is refused
    before any block is served.
    `transport_options` go to the transport (e.g. tcp's direct_io, chunk_bytes).
    Then register the KV caches: `connector.worker.register_kv_caches(caches)` (or let the
    transport allocate them: `connector.worker.allocate_kv_caches(num_blocks)`, which shm needs).

    Tensor parallelism: one connector per rank, `layout` naming the rank's shard (tp_size,
    tp_rank, total_kv_heads). Prefill ranks each publish; `merge_shard_handles` makes the
    request's handle, with which every decode rank pulls exactly its heads.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")
    prefill_cls, decode_cls = _transport_classes(transport)
    if role == "prefill":
        from kvtransfer.prefill import PrefillConnector

        return PrefillConnector(prefill_cls(layout, kernel_backend, **transport_options), secret=secret,
                                engine_id=engine_id, auth_token=auth_token, host=host, port=port,
                                advertise_host=advertise_host,
                                lease_ttl_s=lease_ttl_s,
                                on_blocks_freed=on_blocks_freed, allowed_peers=allowed_peers)
    from kvtransfer.decode import DecodeConnector

    return DecodeConnector(decode_cls(layout, kernel_backend, **transport_options), secret=secret,
                           engine_id=engine_id, auth_token=auth_token, num_workers=num_workers,
                           default_timeout_s=timeout_s)


__all__ = [
    "TRANSPORTS", "create_connector", "KVHandle", "KVShardRef", "merge_shard_handles", "KVLayout", "KVShard",
    "FreedBlocks", "KVTransferError", "AuthError",
    "LayoutMismatch", "LeaseExpired", "UnknownRequest", "BlockRangeError", "TransferTimeout",
    "TransferAborted", "PeerLost", "ProtocolError",
]
