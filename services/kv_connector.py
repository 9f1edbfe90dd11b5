"""Wires a kvtransfer connector into the engine core (engine.kv_transfer hooks)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from engine.kv_transfer import KVCacheSpec, KVTransferEvents
from kvtransfer import KVHandle, KVLayout, create_connector

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVConnectorFactory:
    """Picklable: sent to the engine-core process, which calls it to build its hooks."""
    transport: str
    role: str  # prefill | decode
    secret: bytes
    engine_id: str
    host: str = "127.0.0.1"
    port: int = 0
    lease_ttl_s: float = 30.0
    timeout_s: float = 30.0

    def __call__(self) -> "KVConnectorHooks":
        return KVConnectorHooks(self)


class KVConnectorHooks:
    def __init__(self, factory: KVConnectorFactory) -> None:
        self.factory = factory
        self.connector = None

    def allocate_kv_caches(self, spec: KVCacheSpec, num_blocks: int):
        f = self.factory
        layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size,
                          dtype=str(spec.dtype).removeprefix("torch."), device=str(spec.device))
        kwargs = dict(secret=f.secret, engine_id=f.engine_id)
        if f.role == "prefill":
            kwargs.update(host=f.host, port=f.port, lease_ttl_s=f.lease_ttl_s)
        else:
            kwargs.update(timeout_s=f.timeout_s)
        self.connector = create_connector(f.transport, f.role, layout, **kwargs)
        caches = self.connector.worker.allocate_kv_caches(num_blocks)
        logger.info("KV connector ready: %s %s%s", f.transport, f.role,
                    f" serving pulls at {self.connector.endpoint}" if f.role == "prefill" else "")
        return caches

    def publish(self, request_id: str, block_ids: Sequence[int], num_tokens: int) -> bytes:
        return self.connector.publish(request_id, block_ids, num_tokens).to_bytes()

    def start_pull(self, request_id: str, handle: bytes, local_block_ids: Sequence[int],
                   first_block: int) -> None:
        self.connector.start_pull(request_id, KVHandle.from_bytes(handle), local_block_ids, first_block)

    def abort(self, request_id: str) -> None:
        self.connector.abort(request_id)

    def poll(self) -> KVTransferEvents:
        events = self.connector.get_finished()
        if self.factory.role == "prefill":
            return KVTransferEvents(freed=[f.request_id for f in events.freed])
        return KVTransferEvents(pulled=list(events.finished),
                                pull_failed={rid: f"{type(e).__name__}: {e}" for rid, e in events.failed.items()})

    def stats(self) -> dict[str, int]:
        return self.connector.stats() if self.connector is not None else {}

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
