"""The prefill side of the KV connector: publish a finished prompt's blocks, serve their pulls."""
from __future__ import annotations

import logging
from collections import Counter

from engine.kv_connector import (KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler,
                                 KVConnectorWorker)
from engine.request import RequestStatus
from kvtransfer import KVHandle, KVTransferError, merge_shard_handles

from services.common.kv_connector import TransportLink

logger = logging.getLogger(__name__)


class PrefillConnectorScheduler(KVConnectorScheduler):
    def __init__(self, link: TransportLink) -> None:
        self.link = link
        self._meta = KVConnectorMetadata()
        self.counters: Counter = Counter()
        self.worker: KVConnectorWorker | None = None

    def bind_worker(self, worker: KVConnectorWorker) -> None:
        self.worker = worker

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        return 0  # a prefill instance computes what it does not have cached

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        raise AssertionError("a prefill instance never loads remote KV")

    def request_finished(self, request, block_ids) -> tuple[bool, bytes | None]:
        """Publish only when the first token did not end the request: a decode will continue."""
        if request.status != RequestStatus.FINISHED_REMOTE_DECODE or not request.publish_kv:
            return False, None
        rid = request.request_id
        num_prompt_blocks = -(-request.num_prompt_tokens // self.link.block_size)
        # Every rank pins its shard of the blocks under its own lease; one handle names them all.
        published = self.worker.on_all_ranks("publish", rid, list(block_ids[:num_prompt_blocks]),
                                             request.num_prompt_tokens)
        errors = [f"rank {rank}: {error}" for rank, (_, error) in enumerate(published) if error]
        if not errors:
            try:
                handle = merge_shard_handles([KVHandle.from_bytes(data) for data, _ in published],
                                             self.link.config.secret)
            except KVTransferError as e:
                errors = [f"merging the ranks' handles: {e}"]
        if errors:  # the decode recomputes the prompt: slower, not wrong
            logger.error("publishing the KV of %s failed: %s", rid, "; ".join(errors))
            self.worker.on_all_ranks("abort", rid)  # the ranks that pinned blocks let them go
            self.counters["kv_publish_failures"] += 1
            return False, None
        self.worker.expect_sending(rid)
        self.counters["kv_published"] += 1
        return True, handle.to_bytes()

    def cancel(self, request_id: str) -> None:
        self._meta.cancels.append(request_id)

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta

    def stats(self) -> dict[str, float]:
        return dict(self.counters)


class PrefillConnectorWorker(KVConnectorWorker):
    def __init__(self, link: TransportLink) -> None:
        self.link = link

    def allocate_kv_caches(self, spec, num_blocks: int):
        c = self.link.config
        connector = self.link.create(spec, host=c.host, port=self.link.port_of(spec),
                                     advertise_host=c.advertise_host, lease_ttl_s=c.lease_ttl_s)
        caches = connector.worker.allocate_kv_caches(num_blocks)
        logger.info("KV connector ready: %s prefill serving pulls at %s", c.transport, connector.endpoint)
        return caches

    def publish(self, request_id: str, block_ids: list[int], num_tokens: int) -> tuple[bytes | None, str | None]:
        """Pin this rank's shard of the blocks: (its handle's bytes, None) or (None, why not)."""
        try:
            return self.link.connector.publish(request_id, block_ids, num_tokens).to_bytes(), None
        except KVTransferError as e:
            return None, f"{type(e).__name__}: {e}"

    def abort(self, request_id: str) -> bool:
        return self.link.connector.abort(request_id)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        for request_id in metadata.cancels:
            self.link.connector.abort(request_id)  # the lease ends; its blocks come back as sent

    def get_finished(self) -> KVConnectorOutput:
        events = self.link.connector.get_finished()
        return KVConnectorOutput(finished_sending=[f.request_id for f in events.freed])

    def stats(self) -> dict[str, float]:
        return self.link.connector.stats()

    def close(self) -> None:
        self.link.close()
