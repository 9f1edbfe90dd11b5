"""The engine core: scheduler + model runner (each with its half of the KV connector), one step at a time."""
from __future__ import annotations

import logging
import time

import torch

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import KVConnectorFactory
from engine.kv_events import AllBlocksCleared, make_publisher
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
                 kv_connector_factory: KVConnectorFactory | None = None) -> None:
        self.config = config
        hf_config = config.model.hf_config
        check_architecture(hf_config)
        self.max_model_len = resolve_max_model_len(config, hf_config)
        if config.parallel.num_threads:
            torch.set_num_threads(config.parallel.num_threads)
        connector_scheduler, connector_worker = (kv_connector_factory() if kv_connector_factory is not None
                                                 else (None, None))
        self.connector_worker = connector_worker
        self.runner = ModelRunner(config, hf_config, self.max_model_len, show_progress, connector_worker)
        self.vocab_size = self.runner.model.arch.vocab_size
        # KV events go out from a thread of the publisher's own; each epoch starts all cleared.
        self.kv_event_publisher = make_publisher(config.kv_events)
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish([AllBlocksCleared()])
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                               config.cache.enable_prefix_caching,
                                               enable_kv_cache_events=self.kv_event_publisher is not None,
                                               medium="GPU" if self.runner.device.type == "cuda" else "CPU")
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.max_model_len,
                                   connector_scheduler, self.kv_event_publisher)
        logger.info("engine core ready: %d KV blocks of %d tokens, max_model_len=%d, kernels=%s",
                    self.runner.num_blocks, config.cache.block_size, self.max_model_len,
                    self.runner.kernels.name)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids: list[str]) -> None:
        """Finished by the front end (a stop string matched)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Requests to run, or transfers whose outcome must still be collected."""
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_transfers()

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled and not scheduler_output.finished_req_ids:
            time.sleep(0.0005)  # only KV in flight: let the transfer threads run
        model_output = self.runner.execute(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def stats(self) -> dict:
        s = self.scheduler
        kv = self.kv_cache_manager
        stats = {
            "num_running": s.num_running, "num_waiting": s.num_waiting,
            "num_blocks": kv.block_pool.num_blocks, "num_free_blocks": kv.block_pool.num_free_blocks,
            "kv_cache_usage": kv.usage, "num_pinned_blocks": s.num_held_blocks,
            "prefix_cache_queries": kv.prefix_queries, "prefix_cache_hits": kv.prefix_hits,
            "num_preemptions": s.num_preemptions,
            # Work still owed: prompt tokens to compute plus tokens to generate (for routing).
            "outstanding_tokens": sum(r.num_tokens - r.num_computed_tokens
                                      + r.sampling_params.max_tokens - r.num_output_tokens
                                      for r in s.requests.values()),
        }
        if self.kv_event_publisher is not None:
            stats.update(self.kv_event_publisher.stats())
        if s.connector is not None:
            stats.update(s.connector.stats())
            stats.update({f"connector_{k}": v for k, v in self.connector_worker.stats().items()})
        return stats

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()

    def check_integrity(self, expect_all_free: bool = False) -> None:
        self.kv_cache_manager.check_integrity(expect_all_free)
