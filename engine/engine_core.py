"""The engine core: scheduler + model runner (each with its half of the KV connector), one step at a time."""
from __future__ import annotations

import logging
import time

import torch

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import KVConnectorFactory
from engine.kv_events import AllBlocksCleared, make_publisher
from engine.model_runner import LaunchedStep, ModelRunner
from engine.models.llama import LlamaArch
from engine.models.loader import check_architecture, resolve_max_model_len
from engine.lora_errors import LoRAAdapterBusyError, LoRAAdapterNotFoundError, LoRANotEnabledError
from engine.request import DuplicateRequestError, InvalidRequestError, Request, RequestStatus, generation_budget
from engine.scheduler import EngineCoreOutput, Scheduler, SchedulerOutput
from engine.spec_decode import make_proposer, spec_decode_stats
from engine.structured_output.manager import StructuredOutputManager
from engine.thinking_budget import for_request

logger = logging.getLogger(__name__)


def _thinking_may_force(r) -> bool:
    at = for_request(r)
    return at is not None and r.sampling_params.thinking_budget.may_force_after_next(*at)


def next_decode_step(step: LaunchedStep, max_model_len: int, block_size: int) -> SchedulerOutput | None:
    """Step n+1 for the rows of step n that continue whatever n samples: each computes one more
    position, in a block it already holds that this token does not fill (so nothing is allocated
    or published to the prefix cache behind the scheduler's back), and none can end by length or
    be kept from stopping by min_tokens at n, and none has penalties, multi-token bad words or
    a thinking budget that n's token may spend (n+1's logits processors would read n's token,
    which only the device knows yet). A row
    that ends at n on a stop id or EOS runs n+1 anyway: the scheduler drops that token (the
    request is finished) and frees the slot it wrote."""
    so = step.scheduler_output
    if not step.requests or so.total_num_scheduled_tokens != len(so.scheduled):
        return None
    if any(r.structured_output is not None for r in step.requests):
        # n+1's grammar mask needs n's token accepted by the matcher first; leaving only the
        # grammar rows out would idle them every other step, so the batch waits for n instead.
        return None
    rows = []
    for r in step.requests:
        p = r.sampling_params
        position = r.num_tokens  # of the token n samples, n+1's input
        if (r.status != RequestStatus.RUNNING or r.prefill_only or r.remote_kv is not None
                or r.num_output_tokens + 1 >= p.max_tokens or position + 1 >= max_model_len
                or p.min_tokens > r.num_output_tokens or p.depends_on_output
                or (p.thinking_budget is not None and _thinking_may_force(r))
                or (position + 1) % block_size == 0
                or position // block_size >= r.num_computed_tokens // block_size + 1):
            continue
        rows.append(r)
    if not rows:
        return None
    return SchedulerOutput(scheduled=rows, num_scheduled_tokens=[1] * len(rows), new_block_ids=[[] for _ in rows])


class EngineCore:
    def __init__(self, config: EngineConfig, show_progress: bool = False,
                 kv_connector_factory: KVConnectorFactory | None = None) -> None:
        self.config = config
        hf_config = config.model.hf_config
        check_architecture(hf_config)
        self.max_model_len = resolve_max_model_len(hf_config, config.model.max_model_len)
        if config.parallel.num_threads:
            torch.set_num_threads(config.parallel.num_threads)
        # The loaded LoRA adapters' paths (their prefix-cache keys); a name unloaded at run time
        # keeps its weights and key until the last of its requests finishes.
        self.lora_paths: dict[str, str] = config.lora.paths if config.lora is not None else {}
        self._retiring_loras: set[str] = set()
        self._stage_loras = config.lora is not None and config.lora.max_cpu_loras is not None
        connector_scheduler, connector_worker = (kv_connector_factory() if kv_connector_factory is not None
                                                 else (None, None))
        self.runner = ModelRunner(config, hf_config, self.max_model_len, show_progress, connector_worker,
                                  kv_connector_factory)
        self.connector_worker = self.runner.connector  # under tensor parallelism, every rank's
        if connector_scheduler is not None:
            connector_scheduler.bind_worker(self.connector_worker)
        self.vocab_size = self.runner.model.arch.vocab_size
        # KV events go out from a thread of the publisher's own; each epoch starts all cleared.
        self.kv_event_publisher = make_publisher(config.kv_events)
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish([AllBlocksCleared()])
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                               config.cache.enable_prefix_caching,
                                               enable_kv_cache_events=self.kv_event_publisher is not None,
                                               medium="GPU" if self.runner.device.type == "cuda" else "CPU",
                                               lora_paths=self.lora_paths)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.max_model_len,
                                   connector_scheduler, self.kv_event_publisher, config.speculative,
                                   max_loras=config.lora.max_loras if config.lora is not None else None)
        # Speculative decoding: proposals for the next step, made once this one is settled.
        self.proposer = make_proposer(config.speculative, self.max_model_len, self.runner,
                                      self.kv_cache_manager.get_block_ids)
        self._in_flight: LaunchedStep | None = None  # async scheduling: a step launched ahead
        self.structured_output = StructuredOutputManager(config.model.path, self.vocab_size)
        self.num_async_steps = 0
        logger.info("engine core ready: %d KV blocks of %d tokens (%s), max_model_len=%d, kernels=%s, "
                    "tensor_parallel_size=%d", self.runner.num_blocks, config.cache.block_size,
                    str(self.runner.kv_dtype).removeprefix("torch."), self.max_model_len, self.runner.kernels.name,
                    config.parallel.tensor_parallel_size)

    def add_request(self, request: Request) -> None:
        lora = request.sampling_params.lora_name
        if lora is not None and (lora not in self.lora_paths or lora in self._retiring_loras):
            raise InvalidRequestError(f"LoRA adapter {lora!r} is not loaded on this engine")
        if request.request_id in self.structured_output.waiting:
            raise DuplicateRequestError(f"request id {request.request_id!r} is already in use")
        if not self.structured_output.add(request):  # else it waits here for its grammar
            self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.structured_output.remove(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids: list[str]) -> None:
        """Finished by the front end (a stop string matched)."""
        self.structured_output.remove(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def add_lora(self, name: str, path: str) -> None:
        """Loads a LoRA adapter between steps (vLLM's add_lora); LoRAAdapterError says why not."""
        if self.runner.lora is None:
            raise LoRANotEnabledError("LoRA is not enabled on this engine: start it with --enable-lora")
        if name in self._retiring_loras:
            raise LoRAAdapterBusyError(f"LoRA adapter {name!r} was unloaded and still has requests to finish; "
                                       "load it again once they have")
        self.runner.lora.add(name, path)
        self.lora_paths[name] = path

    def remove_lora(self, name: str) -> None:
        """Unloads an adapter: no new request may use it from now on; its weights go once the
        requests that do have finished (at once when there are none)."""
        if self.runner.lora is None:
            raise LoRANotEnabledError("LoRA is not enabled on this engine: start it with --enable-lora")
        if name not in self.lora_paths or name in self._retiring_loras:
            raise LoRAAdapterNotFoundError(f"LoRA adapter {name!r} is not loaded")
        self._retiring_loras.add(name)
        self._free_retired_loras()

    def _unfinished_requests(self):
        """Every request this engine still owes an answer: the scheduler's and those waiting for a grammar."""
        yield from self.scheduler.requests.values()
        yield from self.structured_output.waiting.values()

    def _free_retired_loras(self) -> None:
        if self._in_flight is not None:  # a step launched ahead may still read the weights
            return
        in_use = {r.sampling_params.lora_name for r in self._unfinished_requests()}
        for name in [n for n in self._retiring_loras if n not in in_use]:
            self.runner.lora.remove(name)
            del self.lora_paths[name]
            self._retiring_loras.discard(name)
            logger.info("LoRA adapter %s unloaded", name)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.structured_output.num_waiting > 0

    def check_alive(self) -> None:
        """Raises if a part of this engine outside its process (a tensor-parallel worker) is gone."""
        self.runner.check_alive()

    def has_work(self) -> bool:
        """Requests to run, a launched step to collect, or transfers whose outcome must still be collected."""
        return (self.has_unfinished_requests() or self._in_flight is not None
                or self.scheduler.has_pending_transfers())

    def step(self) -> list[EngineCoreOutput]:
        grammars = self.structured_output
        if grammars.num_waiting and self._in_flight is None and not self.scheduler.has_unfinished_requests():
            grammars.wait(0.005)  # nothing else to run: wait for a compile rather than spin
        failed = self._admit_compiled(*grammars.take_settled()) if grammars.num_waiting else []
        if self._stage_loras and self._in_flight is None:  # (a step in flight runs what is on the device)
            failed += self._stage_lora_adapters()
        outputs = failed + self._step()
        if self._retiring_loras:
            self._free_retired_loras()
        return outputs

    def _stage_lora_adapters(self) -> list[EngineCoreOutput]:
        """--max-cpu-loras: the adapters the next step may run in host memory, read back from their
        files where evicted. The requests of one that cannot be read back (its files removed or
        changed, no memory) fail with the reason (finish_reason abort); it stays loaded, and the
        next request for it tries again; the rest go on."""
        outputs = []
        failed = self.runner.lora.stage(self.scheduler.adapters_to_run(), keep=self._retiring_loras)
        for name, why in failed.items():
            reason = (f"LoRA adapter {name!r} could not be read back from {self.lora_paths.get(name)} (its "
                      f"host copy was evicted under --max-cpu-loras): {why}")
            logger.error(reason)
            ids = [r.request_id for r in self._unfinished_requests() if r.sampling_params.lora_name == name]
            self.abort_requests(ids)
            outputs += [EngineCoreOutput(rid, [], finish_reason="abort", stop_reason=reason, finished=True)
                        for rid in ids]
        return outputs

    def _admit_compiled(self, ready: list[Request], failed: list[tuple[Request, str]]) -> list[EngineCoreOutput]:
        """Requests whose grammar compiled go to the scheduler; one that did not compile fails alone
        (finish_reason abort with the reason: the service turns it into INVALID_ARGUMENT)."""
        outputs = []
        for request in ready:
            try:
                self.scheduler.add_request(request)
            except ValueError as e:
                failed.append((request, str(e)))
        for request, why in failed:
            request.status = RequestStatus.FINISHED_ABORTED
            outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="abort", stop_reason=why,
                                            finished=True))
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
        if self._in_flight is not None:  # launched ahead by the previous call: collect it now
            step, self._in_flight = self._in_flight, None
            self._launch_ahead(step, scheduler_idle=True)
            return self.scheduler.update_from_output(step.scheduler_output, self.runner.collect(step))
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled and not scheduler_output.finished_req_ids:
            time.sleep(0.0005)  # only KV in flight: let the transfer threads run
        step = self.runner.launch(scheduler_output)
        self._launch_ahead(step)
        outputs = self.scheduler.update_from_output(scheduler_output, self.runner.collect(step))
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        return outputs

    def _launch_ahead(self, step: LaunchedStep, scheduler_idle: bool = False) -> None:
        """Async scheduling: queue step n+1 behind step n before n's tokens reach the CPU, for the
        rows that surely continue; the scheduler sees n+1 only once n is settled. A chain of such
        steps goes on while they carry every running request and none waits (scheduler_idle:
        the scheduler would have nothing else to do); otherwise it runs once n is collected."""
        if not self.config.scheduler.async_scheduling:
            return
        following = next_decode_step(step, self.max_model_len, self.config.cache.block_size)
        if following is None:
            return
        if scheduler_idle and (self.scheduler.num_waiting or len(following.scheduled) != len(self.scheduler.running)):
            return  # (the rows are running requests: as many as the running batch means all of it)
        self._in_flight = self.runner.launch(following, prev=step)
        self.num_async_steps += 1

    def stats(self) -> dict:
        s = self.scheduler
        kv = self.kv_cache_manager
        stats = {
            "num_running": s.num_running, "num_waiting": s.num_waiting + self.structured_output.num_waiting,
            "num_blocks": kv.block_pool.num_blocks, "num_free_blocks": kv.block_pool.num_free_blocks,
            "kv_cache_usage": kv.usage, "num_pinned_blocks": s.num_held_blocks,
            "prefix_cache_queries": kv.prefix_queries, "prefix_cache_hits": kv.prefix_hits,
            "num_preemptions": s.num_preemptions,
            "num_async_steps": self.num_async_steps,
            **spec_decode_stats(s, self.proposer),
            **self.runner.stats,
            **self.structured_output.stats(),
            # Work still owed: prompt tokens to compute plus tokens to generate (for routing).
            "outstanding_tokens": sum(r.num_tokens - r.num_computed_tokens
                                      + max(0, generation_budget(r.sampling_params, r.prefill_only)
                                            - r.num_output_tokens)
                                      for r in s.requests.values()),
        }
        if self.kv_event_publisher is not None:
            stats.update(self.kv_event_publisher.stats())
        if s.connector is not None:
            stats.update(s.connector.stats())
            stats.update({f"connector_{k}": v for k, v in self.connector_worker.stats().items()})
        return stats

    def shutdown(self) -> None:
        self.runner.shutdown()
        self.structured_output.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()

    def check_integrity(self, expect_all_free: bool = False) -> None:
        self.kv_cache_manager.check_integrity(expect_all_free)
