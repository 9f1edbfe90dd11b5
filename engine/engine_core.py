"""The engine core: scheduler + model runner (+ the KV connector's hooks), one step at a time."""
from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_transfer import KVTransferFactory
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaArch
from engine.models.loader import check_architecture
from engine.request import Request, RequestStatus
from engine.scheduler import EngineCoreOutput, Scheduler

logger = logging.getLogger(__name__)


def resolve_max_model_len(config: EngineConfig, hf_config: dict) -> int:
    arch = LlamaArch.from_hf_config(hf_config)
    limit = arch.max_position_embeddings
    if arch.sliding_window is not None and arch.sliding_window < limit:
        # Attention here is full, not windowed: stay within the window, where both agree.
        limit = arch.sliding_window
    wanted = config.model.max_model_len
    if wanted is None:
        return limit
    if wanted > limit:
        raise ValueError(f"max_model_len={wanted} exceeds the model's limit of {limit} tokens")
    return wanted


class EngineCore:
    def __init__(self, config: EngineConfig, show_progress: bool = False,
                 kv_transfer_factory: KVTransferFactory | None = None) -> None:
        self.config = config
        hf_config = config.model.hf_config
        check_architecture(hf_config)
        self.max_model_len = resolve_max_model_len(config, hf_config)
        if config.parallel.num_threads:
            torch.set_num_threads(config.parallel.num_threads)
        self.kv_transfer = kv_transfer_factory() if kv_transfer_factory is not None else None
        self.runner = ModelRunner(config, hf_config, self.max_model_len, show_progress, self.kv_transfer)
        self.vocab_size = self.runner.model.arch.vocab_size
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                               config.cache.enable_prefix_caching)
        self.runner.block_ids_of = self.kv_cache_manager.get_block_ids
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.max_model_len)
        self.counters: Counter = Counter()
        self._aborting_pulls: set[str] = set()
        self._pull_started: dict[str, float] = {}
        logger.info("engine core ready: %d KV blocks of %d tokens, max_model_len=%d, kernels=%s",
                    self.runner.num_blocks, config.cache.block_size, self.max_model_len,
                    self.runner.kernels.name)

    def add_request(self, request: Request) -> None:
        if (request.remote_kv is not None or request.publish_kv) and self.kv_transfer is None:
            raise ValueError("this engine has no KV connector: it cannot take part in disaggregation")
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        now = []
        for rid in request_ids:
            if rid in self.scheduler.waiting_for_remote_kv:
                # The pull may still write into the request's blocks: free them once it stops.
                self.kv_transfer.abort(rid)
                self._aborting_pulls.add(rid)
            elif rid in self.scheduler.pinned:
                self.kv_transfer.abort(rid)  # the lease ends; its blocks come back via poll()
            else:
                now.append(rid)
        self.scheduler.finish_requests(now, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids: list[str]) -> None:
        """Finished by the front end (a stop string matched)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Requests to run, or pinned blocks / pulls whose events must still be collected."""
        return self.scheduler.has_unfinished_requests() or bool(self.scheduler.pinned)

    def step(self) -> list[EngineCoreOutput]:
        if self.kv_transfer is not None:
            self._collect_transfer_events()
        scheduler_output = self.scheduler.schedule()
        if self.kv_transfer is not None:
            for request, num_local, block_ids in scheduler_output.remote_kv_allocations:
                self._start_pull(request, num_local, block_ids)
        if not scheduler_output.scheduled and not scheduler_output.finished_req_ids:
            time.sleep(0.0005)  # only KV in flight: let the transfer threads run
        model_output = self.runner.execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if self.scheduler.newly_pinned:
            self._publish(outputs)
        return outputs

    def _start_pull(self, request: Request, num_local_tokens: int, block_ids: list[int]) -> None:
        bs = self.config.cache.block_size
        first = num_local_tokens // bs
        num_prompt_blocks = -(-request.num_prompt_tokens // bs)
        try:
            self.kv_transfer.start_pull(request.request_id, request.remote_kv,
                                        block_ids[first:num_prompt_blocks], first)
            self.counters["kv_pulls_started"] += 1
            self.counters["kv_blocks_local_hits"] += first
            self._pull_started[request.request_id] = time.monotonic()
        except Exception as e:  # a bad handle: recompute the prompt here instead
            logger.warning("KV pull for %s refused (%s): recomputing the prompt", request.request_id, e)
            self.counters["kv_recomputed_fallbacks"] += 1
            self.scheduler.finish_remote_kv(request.request_id, success=False)

    def _collect_transfer_events(self) -> None:
        events = self.kv_transfer.poll()
        now = time.monotonic()
        for rid in [*events.pulled, *events.pull_failed]:
            started = self._pull_started.pop(rid, None)
            if started is not None:
                self.counters["kv_transfer_seconds_total"] += now - started
                self.counters["kv_transfers_timed"] += 1
        for rid in events.pulled:
            if rid in self._aborting_pulls:
                self._aborting_pulls.discard(rid)
                self._abort_after_pull(rid)
            else:
                self.counters["kv_pulls_finished"] += 1
                self.scheduler.finish_remote_kv(rid, success=True)
        for rid, reason in events.pull_failed.items():
            if rid in self._aborting_pulls:
                self._aborting_pulls.discard(rid)
                self._abort_after_pull(rid)
                continue
            logger.warning("KV pull for %s failed (%s): recomputing the prompt", rid, reason)
            self.counters["kv_pull_failures"] += 1
            self.counters["kv_recomputed_fallbacks"] += 1
            self.scheduler.finish_remote_kv(rid, success=False)
        for rid in events.freed:
            self.scheduler.free_pinned(rid)

    def _abort_after_pull(self, request_id: str) -> None:
        self.scheduler.finish_remote_kv(request_id, success=False)
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        by_id = {o.request_id: o for o in outputs}
        bs = self.config.cache.block_size
        for request in self.scheduler.newly_pinned:
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            num_prompt_blocks = -(-request.num_prompt_tokens // bs)
            try:
                handle = self.kv_transfer.publish(request.request_id, block_ids[:num_prompt_blocks],
                                                  request.num_prompt_tokens)
            except Exception as e:
                logger.error("publishing KV of %s failed: %s", request.request_id, e)
                self.scheduler.free_pinned(request.request_id)
                continue
            self.counters["kv_published"] += 1
            out = by_id.get(request.request_id)
            if out is not None:
                out.kv_handle = handle
        self.scheduler.newly_pinned = []

    def stats(self) -> dict:
        s = self.scheduler
        kv = self.kv_cache_manager
        stats = {
            "num_running": s.num_running, "num_waiting": s.num_waiting,
            "num_blocks": kv.block_pool.num_blocks, "num_free_blocks": kv.block_pool.num_free_blocks,
            "kv_cache_usage": kv.usage, "num_pinned_blocks": s.num_pinned_blocks,
            "prefix_cache_queries": kv.prefix_queries, "prefix_cache_hits": kv.prefix_hits,
            "num_preemptions": s.num_preemptions,
            # Work still owed: prompt tokens to compute plus tokens to generate (for routing).
            "outstanding_tokens": sum(r.num_tokens - r.num_computed_tokens
                                      + r.sampling_params.max_tokens - r.num_output_tokens
                                      for r in s.requests.values()),
        }
        stats.update(self.counters)
        if self.kv_transfer is not None:
            stats.update({f"connector_{k}": v for k, v in self.kv_transfer.stats().items()})
        return stats

    def shutdown(self) -> None:
        if self.kv_transfer is not None:
            self.kv_transfer.close()

    def check_integrity(self, expect_all_free: bool = False) -> None:
        self.kv_cache_manager.check_integrity(expect_all_free)
