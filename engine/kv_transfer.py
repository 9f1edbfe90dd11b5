"""The seam between the engine core and a KV-transfer connector.

The engine does not import `kvtransfer` (layering: services wire it in). A service hands the
engine core a factory that builds an object with this shape inside the engine-core process.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device


@dataclass
class KVTransferEvents:
    pulled: list[str] = field(default_factory=list)  # decode: KV is in place
    pull_failed: dict[str, str] = field(default_factory=dict)  # decode: request id -> reason
    freed: list[str] = field(default_factory=list)  # prefill: pinned blocks may be returned


class KVTransferHooks(Protocol):
    def allocate_kv_caches(self, spec: KVCacheSpec, num_blocks: int) -> list[torch.Tensor]:
        """Allocate (zeroed) and register the engine's KV caches."""

    def publish(self, request_id: str, block_ids: Sequence[int], num_tokens: int) -> bytes:
        """Prefill: pin the blocks under a lease; returns the opaque, signed KV handle."""

    def start_pull(self, request_id: str, handle: bytes, local_block_ids: Sequence[int],
                   first_block: int) -> None:
        """Decode: pull remote blocks [first_block:] of the handle into local_block_ids."""

    def abort(self, request_id: str) -> None:
        """Prefill: free a published lease now. Decode: stop a pull (reported as failed)."""

    def poll(self) -> KVTransferEvents:
        """Never blocks."""

    def stats(self) -> dict[str, int]:
        ...

    def close(self) -> None:
        ...


KVTransferFactory = Callable[[], KVTransferHooks]
