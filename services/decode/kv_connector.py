"""The decode side of the KV connector: check a request's handle, pull exactly the blocks it does not
hold into blocks the scheduler reserved, keep the remote lease alive while it waits for room."""
from __future__ import annotations

import logging
import time
from collections import Counter

from engine.kv_connector import (KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler,
                                 KVConnectorWorker, KVLoad)
from kvtransfer import KVHandle, KVTransferError

from services.common.kv_connector import TransportLink

logger = logging.getLogger(__name__)
# A request still waiting for room asks the prefill to keep its blocks this much longer once
# their lease has less than LEASE_MARGIN_S left.
LEASE_EXTENSION_S = 30.0
LEASE_MARGIN_S = 10.0
EXTEND_CHECK_INTERVAL_S = 0.5


class DecodeConnectorScheduler(KVConnectorScheduler):
    def __init__(self, link: TransportLink) -> None:
        self.link = link
        self._handles: dict[str, KVHandle] = {}  # queued with a valid handle, not yet admitted
        self._extend_at: dict[str, float] = {}  # request id -> monotonic time of its next extension
        self._next_extend_check = 0.0
        self._loading: dict[str, float] = {}  # request id -> monotonic start of its pull
        self._cancelled: set[str] = set()
        self._meta = KVConnectorMetadata()
        self.counters: Counter = Counter()

    def add_request(self, request) -> None:
        if request.remote_kv is None:
            return
        try:
            handle = self.link.parse_handle(request.remote_kv)
        except KVTransferError as e:  # a bad handle: the prompt is computed here instead
            logger.warning("KV handle of %s refused (%s): recomputing the prompt", request.request_id, e)
            self.counters["kv_recomputed_fallbacks"] += 1
            return
        self._handles[request.request_id] = handle
        remaining = handle.lease_expiry - time.time()
        self._extend_at[request.request_id] = time.monotonic() + max(0.0, remaining - LEASE_MARGIN_S)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        handle = self._handles.get(request.request_id)
        if handle is None:
            return 0
        num_external = request.num_prompt_tokens - num_computed_tokens
        if num_external <= 0:  # every prompt block is cached here: give the remote ones back
            self._forget(request.request_id)
            self._meta.releases.append(request.remote_kv)
            self.counters["kv_released_unpulled"] += 1
        return max(num_external, 0)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        rid = request.request_id
        bs = self.link.block_size
        first = request.num_computed_tokens // bs
        num_prompt_blocks = -(-request.num_prompt_tokens // bs)
        self._meta.loads.append(KVLoad(rid, request.remote_kv, list(block_ids[first:num_prompt_blocks]), first))
        self._forget(rid)
        self._loading[rid] = time.monotonic()
        self.counters["kv_pulls_started"] += 1
        self.counters["kv_blocks_local_hits"] += first

    def request_finished(self, request, block_ids) -> tuple[bool, bytes | None]:
        rid = request.request_id
        self._forget(rid)
        if rid not in self._loading:
            return False, None
        # Aborted while its KV is arriving: the blocks stay reserved until the pull stops.
        self._cancelled.add(rid)
        self._meta.cancels.append(rid)
        return True, None

    def _forget(self, request_id: str) -> None:
        self._handles.pop(request_id, None)
        self._extend_at.pop(request_id, None)

    def build_connector_meta(self) -> KVConnectorMetadata:
        now = time.monotonic()
        if self._extend_at and now >= self._next_extend_check:
            self._next_extend_check = now + EXTEND_CHECK_INTERVAL_S
            for rid, at in self._extend_at.items():
                if now >= at:
                    self._meta.lease_extensions.append((self._handles[rid].to_bytes(), LEASE_EXTENSION_S))
                    self._extend_at[rid] = now + LEASE_EXTENSION_S - LEASE_MARGIN_S
                    self.counters["kv_lease_extensions"] += 1
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        now = time.monotonic()
        for rid in [*output.finished_recving, *output.failed_recving]:
            started = self._loading.pop(rid, None)
            if started is not None:
                self.counters["kv_transfer_seconds_total"] += now - started
                self.counters["kv_transfers_timed"] += 1
        for rid in output.finished_recving:
            if rid not in self._cancelled:
                self.counters["kv_pulls_finished"] += 1
        for rid, reason in output.failed_recving.items():
            if rid in self._cancelled:
                continue
            logger.warning("KV pull for %s failed (%s): recomputing the prompt", rid, reason)
            self.counters["kv_pull_failures"] += 1
            self.counters["kv_recomputed_fallbacks"] += 1
        self._cancelled.difference_update(output.finished_recving)
        self._cancelled.difference_update(output.failed_recving)

    def stats(self) -> dict[str, float]:
        return dict(self.counters)


class DecodeConnectorWorker(KVConnectorWorker):
    def __init__(self, link: TransportLink) -> None:
        self.link = link
        self._failed_to_start: dict[str, str] = {}

    def allocate_kv_caches(self, spec, num_blocks: int):
        c = self.link.config
        connector = self.link.create(spec, timeout_s=c.timeout_s)
        caches = connector.worker.allocate_kv_caches(num_blocks)
        logger.info("KV connector ready: %s decode", c.transport)
        return caches

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        connector = self.link.connector
        for load in metadata.loads:
            try:
                connector.start_pull(load.request_id, KVHandle.from_bytes(load.kv_handle), load.block_ids,
                                     load.first_block)
            except KVTransferError as e:  # reported with the next get_finished(): recomputed there
                self._failed_to_start[load.request_id] = f"{type(e).__name__}: {e}"
        for request_id in metadata.cancels:
            connector.abort(request_id)  # the pull reports failure once it no longer writes
        for data, seconds in metadata.lease_extensions:
            self._log_failure(connector.extend_lease(KVHandle.from_bytes(data), seconds), "extending")
        for data in metadata.releases:
            self._log_failure(connector.release(KVHandle.from_bytes(data)), "releasing")

    @staticmethod
    def _log_failure(future, what: str) -> None:
        def done(f) -> None:
            if f.exception() is not None:  # the pull (or the lease's expiry) settles it
                logger.warning("%s a KV lease failed: %s", what, f.exception())

        future.add_done_callback(done)

    def get_finished(self) -> KVConnectorOutput:
        events = self.link.connector.get_finished()
        for rid, e in events.failed.items():
            if not isinstance(e, KVTransferError):  # a bug: surfaces (the engine core stops), never a recompute
                raise RuntimeError(f"the KV pull of {rid} hit a bug: {type(e).__name__}: {e}") from e
        failed = {rid: f"{type(e).__name__}: {e}" for rid, e in events.failed.items()}
        if self._failed_to_start:
            failed.update(self._failed_to_start)
            self._failed_to_start = {}
        return KVConnectorOutput(finished_recving=list(events.finished), failed_recving=failed)

    def stats(self) -> dict[str, float]:
        return self.link.connector.stats()

    def close(self) -> None:
        self.link.close()
