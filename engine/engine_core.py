"""The engine core: scheduler + model runner, one step at a time."""
from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
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
    def __init__(self, config: EngineConfig, show_progress: bool = False) -> None:
        self.config = config
        hf_config = config.model.hf_config
        check_architecture(hf_config)
        self.max_model_len = resolve_max_model_len(config, hf_config)
        if config.parallel.num_threads:
            torch.set_num_threads(config.parallel.num_threads)
        self.runner = ModelRunner(config, hf_config, self.max_model_len, show_progress)
        self.vocab_size = self.runner.model.arch.vocab_size
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                               config.cache.enable_prefix_caching)
        self.runner.block_ids_of = self.kv_cache_manager.get_block_ids
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.max_model_len)
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

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        model_output = self.runner.execute(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def check_integrity(self, expect_all_free: bool = False) -> None:
        self.kv_cache_manager.check_integrity(expect_all_free)
