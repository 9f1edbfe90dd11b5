"""One engine service process, whatever its role: the engine, its metrics, the gRPC server with the
role's servicer and the shared Engine service (Abort, GetLoad), warm-up, drain."""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import grpc

from engine.async_engine import AsyncEngine
from engine.lora_errors import (LoRAAdapterBusyError, LoRAAdapterError, LoRAAdapterExistsError,
                                LoRAAdapterNotFoundError, LoRANotEnabledError, LoRAOutOfMemoryError)
from engine.request import InvalidRequestError, SamplingParams
from services import convert
from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from services.common.auth import ServerAuth
from services.common.grpc_server import GrpcService, RequestAborted
from services.common.kv_connector import KVConnectorConfig
from services.common.metrics import ServiceMetrics
from services.common.pairing_descriptor import describe_engine
from services.common.role import Role

logger = logging.getLogger("pdserve.engine")


class EngineHost:
    """What a role's servicer works with: the engine, its metrics, its identity."""

    def __init__(self, engine: AsyncEngine, role: Role, engine_id: str, metrics: ServiceMetrics) -> None:
        self.engine, self.role, self.engine_id, self.metrics = engine, role, engine_id, metrics

    @staticmethod
    def prompt(ids) -> list[int]:
        prompt = list(ids)
        if not prompt:
            raise InvalidRequestError("prompt_token_ids is empty")
        return prompt

    @staticmethod
    def raise_if_aborted(completion, request_id: str) -> None:
        """An aborted request is an error to its caller, never a reply that merely stops short."""
        if completion.finish_reason != "abort":
            return
        if completion.stop_reason is not None:  # the engine core refused it
            raise InvalidRequestError(f"request rejected by the engine: {completion.stop_reason}")
        raise RequestAborted(f"request {request_id} was aborted")

    def count_tokens(self, prompt_tokens: int, gen_tokens: int) -> None:
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.generation_tokens.inc(gen_tokens)

    def observe_finished(self, start: float, reason: str) -> None:
        self.metrics.e2e.observe(time.monotonic() - start)
        self.metrics.finished(reason)

    def observe_first_token(self, start: float, queue_time: float | None) -> None:
        self.metrics.ttft.observe(time.monotonic() - start)
        if queue_time is not None:
            self.metrics.queue.observe(queue_time)


class EngineServicer(pb_grpc.EngineServicer):
    """Abort, GetLoad and the LoRA adapters' load / unload, the same on every role. GetLoad is the router's handshake: each report
    carries the pairing descriptor, so a pair that cannot work is refused before any request."""

    def __init__(self, host: EngineHost, pairing: pb.PairingDescriptor) -> None:
        self.host = host
        self.pairing = pairing

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        engine = self.host.engine
        found = request.request_id in engine.streams
        engine.abort(request.request_id)  # also frees published KV that no decode pulled
        return pb.AbortResponse(found=found)

    async def GetLoad(self, request, context) -> pb.LoadReport:
        engine = self.host.engine
        report = convert.load_report(engine.stats(), self.host.engine_id, self.host.role.value,
                                     engine.config.cache.block_size, engine.max_model_len,
                                     engine.config.scheduler.max_num_batched_tokens)
        report.pairing.CopyFrom(self.pairing)
        report.lora_enabled = engine.config.lora is not None
        report.lora_adapters.extend(pb.LoRAAdapter(name=n, path=p) for n, p in engine.lora_adapters.items())
        return report

    async def LoadLoRAAdapter(self, request: pb.LoadLoRAAdapterRequest, context) -> pb.LoRAAdapterResponse:
        loaded = await self._lora_call(context, self.host.engine.load_lora_adapter(request.lora_name,
                                                                                  request.lora_path))
        return pb.LoRAAdapterResponse(loaded=loaded)

    async def UnloadLoRAAdapter(self, request: pb.UnloadLoRAAdapterRequest, context) -> pb.LoRAAdapterResponse:
        await self._lora_call(context, self.host.engine.unload_lora_adapter(request.lora_name))
        return pb.LoRAAdapterResponse()

    @staticmethod
    async def _lora_call(context, call):
        try:
            return await call
        except LoRAAdapterError as e:
            code = grpc.StatusCode.INVALID_ARGUMENT  # the checkpoint does not load
            if isinstance(e, LoRAAdapterExistsError):
                code = grpc.StatusCode.ALREADY_EXISTS
            elif isinstance(e, LoRAAdapterNotFoundError):
                code = grpc.StatusCode.NOT_FOUND
            elif isinstance(e, LoRANotEnabledError):
                code = grpc.StatusCode.FAILED_PRECONDITION
            elif isinstance(e, LoRAAdapterBusyError):
                code = grpc.StatusCode.ABORTED
            elif isinstance(e, LoRAOutOfMemoryError):
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
            await context.abort(code, str(e))


def _switch(args, name: str) -> bool:
    """A feature on by default, off by our --no-<name> or vLLM's --no-enable-<name>; the two
    spellings saying opposite things is an error."""
    vllm, off = getattr(args, f"enable_{name}", None), getattr(args, f"no_{name}")
    flag = name.replace("_", "-")
    if vllm and off:
        raise ValueError(f"--enable-{flag} and --no-{flag} contradict each other: give one")
    return not off if vllm is None else vllm


def engine_kwargs(args) -> dict:
    """The engine options of the shared flags."""
    return dict(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size,
                num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_waiting_requests=args.max_waiting_requests, max_waiting_tokens=args.max_waiting_tokens,
                enable_prefix_caching=_switch(args, "prefix_caching"),
                enable_chunked_prefill=_switch(args, "chunked_prefill"), policy=args.scheduling_policy,
                stream_interval=args.stream_interval,
                num_threads=args.num_threads, kernel_backend=args.kernel_backend, kv_events=args.kv_events_config,
                linear_backend=args.linear_backend, cpu_allocator=args.cpu_allocator,
                enforce_eager=args.enforce_eager, cuda_graph_sizes=args.cuda_graph_sizes,
                async_scheduling=args.async_scheduling, speculative_config=args.speculative_config,
                tensor_parallel_size=args.tensor_parallel_size,
                kv_cache_memory_bytes=(None if args.kv_cache_memory_gb is None
                                       else int(args.kv_cache_memory_gb * (1 << 30))),
                gpu_memory_utilization=args.gpu_memory_utilization, quantization=args.quantization,
                quantized_weights=args.quantized_weights, kv_cache_dtype=args.kv_cache_dtype,
                **_lora_kwargs(args))


def _lora_kwargs(args) -> dict:
    """--enable-lora's adapters (none without it; --lora-modules alone is the config's error)."""
    modules, rank, cap = args.lora_modules, args.max_lora_rank, args.max_loras  # a string from the environment
    host_cap = args.max_cpu_loras
    if not args.enable_lora and not modules:
        return {}
    return dict(enable_lora=args.enable_lora, lora_modules=modules or [], max_lora_rank=rank, max_loras=cap,
                max_cpu_loras=host_cap)


_DEAD_CORE_EXIT_S = 20.0


def _exit_within(seconds: float) -> None:
    """The last resort after the engine core died: the orderly stop (gRPC, ZMQ, the connector's
    threads) must not keep a dead instance up, holding its port and its GPU, because some library
    thread blocks; the supervisor restarts it either way."""

    def watchdog() -> None:
        time.sleep(seconds)
        logger.error("still stopping %.0fs after the engine core died; exiting now", seconds)
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=watchdog, name="dead-core-exit", daemon=True).start()


async def serve(args, role: Role, service_name: str, add_servicer: Callable[[EngineHost, grpc.aio.Server], None],
                kv_connector: KVConnectorConfig | None) -> int:
    """Run one engine service until SIGTERM; returns the exit code."""
    engine_id = args.engine_id
    auth = ServerAuth.from_args(args)  # bad files: a ValueError, `error: ...` on the command line
    logger.info("starting %s %s on %s:%d (model %s, authentication: %s)", role, engine_id, args.host, args.port,
                args.model, auth.describe())
    engine = await AsyncEngine.create(args.model, multiprocess=not args.inproc, detokenize=False,
                                      kv_connector_factory=kv_connector, **engine_kwargs(args))
    model_name = args.served_model_name or os.path.basename(os.path.normpath(engine.config.model.path))
    metrics = ServiceMetrics(engine.stats, model_name, role.value, engine_id)
    host = EngineHost(engine, role, engine_id, metrics)
    pairing = describe_engine(engine.config, engine.tokenizer.get_vocab(), model_name,
                              kv_connector.transport if kv_connector is not None else "")

    def add(server: grpc.aio.Server) -> None:
        add_servicer(host, server)
        pb_grpc.add_EngineServicer_to_server(EngineServicer(host, pairing), server)

    names = [pb.DESCRIPTOR.services_by_name[n].full_name for n in (service_name, "Engine")]
    service = GrpcService(args.host, args.port, names, add, args.drain_timeout, auth, args.health_port)
    await service.start()
    service.install_signal_handlers()
    died: list[Exception] = []

    def on_engine_death(error: Exception) -> None:
        # Requests in flight have failed with UNAVAILABLE; report NOT_SERVING and exit non-zero
        # so that the supervisor (Kubernetes, `pdserve up`) restarts this instance.
        logger.error("%s %s: %s; stopping", role, engine_id, error)
        died.append(error)
        service.request_stop()
        _exit_within(_DEAD_CORE_EXIT_S)

    engine.on_death(on_engine_death)
    if args.metrics_port:
        metrics.serve(args.host, args.metrics_port)
        logger.info("%s %s metrics on http://%s:%d/metrics", role, engine_id, args.host, args.metrics_port)
    # Warm up: one real request through the whole engine before reporting SERVING.
    async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)):
        pass
    await service.set_serving(True)
    logger.info("%s %s ready: gRPC on %s:%d", role, engine_id, args.host, service.port)
    await service.wait_for_stop()
    if died:  # every request in flight failed with the core: there is nothing to let finish
        await service.drain(grace_s=0)
    else:
        logger.info("%s %s draining (up to %.0fs)", role, engine_id, args.drain_timeout)
        await service.drain()
    await engine.shutdown()
    logger.info("%s %s stopped%s", role, engine_id, " (its engine core died)" if died else "")
    return 1 if died else 0
