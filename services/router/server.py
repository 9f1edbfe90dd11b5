"""The router process: wires the pieces together, starts the HTTP and gRPC fronts, drains on stop."""
from __future__ import annotations

import asyncio
import logging

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc
from services.router.admission import Admission
from services.router.config import RouterConfig
from services.router.discovery import make_discovery
from services.router.dispatcher import Dispatcher
from services.router.generation import TextGenerator
from services.router.grpc_front import GenerateService
from services.router.http_server import HttpGateway
from services.router.instances import InstancePool
from services.router.metrics import RouterMetrics
from services.router.kv_index import KvIndex
from services.router.lora_adapters import RuntimeLoRA
from services.router.pd_policy import PdPolicy
from services.router.policy import KvAware, make_policy
from services.router.generation_config import sampling_defaults
from services.router.reasoning import reasoning_parser
from services.router.served_model import ServedModel, load_chat_template

logger = logging.getLogger(__name__)


def resolve_model_path(model: str) -> str:
    if model == "tiny":
        from engine.tiny import default_tiny_model
        return default_tiny_model()
    return model


class Router:
    def __init__(self, config: RouterConfig, tokenizer=None) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.model = ServedModel(resolve_model_path(config.model), config.served_model_name,
                                 config.max_model_len, tokenizer, reasoning_parser(config.reasoning_parser),
                                 config.served_model_aliases, config.tool_call_parser,
                                 reasoning_end_str=config.reasoning_end_str)
        self.model.sampling_defaults = sampling_defaults(self.model.path, config.generation_config,
                                                         config.override_generation_config)
        self.model.auto_tool_choice = config.enable_auto_tool_choice
        self.model.lora_modules = dict(config.lora_modules)
        if config.chat_template is not None:
            self.model.use_chat_template(load_chat_template(config.chat_template))
        self.kv_index = KvIndex(low_confidence_weight=config.kv_low_confidence_weight)
        self.metrics.registry.register(self.kv_index)
        self.policy = make_policy(config.policy, self.kv_index, overlap_weight=config.kv_overlap_score_weight,
                                  temperature=config.router_temperature)
        conditional = config.disaggregated and config.pd_policy == "conditional"
        self.discovery = make_discovery(config)  # None: the static --prefill/--decode lists
        sources = {r: self.discovery.describe(r) for r in self.discovery.services} if self.discovery else None
        self.pool = InstancePool(
            config.prefill, config.decode, self.metrics,
            health_interval_s=config.health_check_interval_s,
            # Runtime LoRA adapters: each report says which an engine lacks or still has.
            load_interval_s=config.load_poll_interval_s
            if self.policy.needs_load_reports or conditional or config.allow_runtime_lora_updating else None,
            on_load=self.model.on_load_report, drain_grace_s=config.request_timeout_s, sources=sources,
            auth=config.engine_auth)
        self.dispatcher = Dispatcher(
            self.pool, self.policy, self.metrics, disaggregated=config.disaggregated,
            request_timeout_s=config.request_timeout_s, prefill_timeout_s=config.prefill_timeout_s,
            max_attempts=config.max_attempts, migration_limit=config.migration_limit,
            lora_paths=self.model.lora_modules,
            pd_policy=PdPolicy(config.pd_policy, self.policy, self.pool, self.metrics,
                               max_local_prefill_tokens=config.max_local_prefill_length,
                               max_prefill_queue_tokens=config.max_prefill_queue_tokens)
            if config.disaggregated else None)
        self.lora = RuntimeLoRA(self.model.lora_modules, self.pool, self.model.names, self.dispatcher.lora_idle,
                                config.lora_resolver_dir, config.lora_resolver_max_loras,
                                self.dispatcher.lora_last_used)
        if config.allow_runtime_lora_updating:  # engines that join (or restart) get the adapters loaded here
            self.pool.report_listeners.append(self.lora.sync)
        self._kv_sync: asyncio.Task | None = None
        self.generator = TextGenerator(self.dispatcher, self.model, self.metrics)
        self.admission = Admission(config.max_concurrent_requests, self.metrics)
        self.draining = False
        self.responses_serving = None  # the HTTP gateway's, once made
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self._runner: web.AppRunner | None = None
        self._grpc_server: grpc.aio.Server | None = None
        self._grpc_health: HealthServicer | None = None

    async def start(self) -> None:
        c = self.config
        await self.pool.start()
        if self.discovery is not None:
            await self.discovery.start(self.pool.update)
        if isinstance(self.policy, KvAware):  # subscribes to the KV events each instance advertises
            self._kv_sync = asyncio.create_task(self.kv_index.run_sync(self.pool, c.load_poll_interval_s))
        self._runner = web.AppRunner(HttpGateway(self).make_app(), handler_cancellation=True,
                                     shutdown_timeout=c.drain_timeout_s, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, c.host, c.port, ssl_context=c.tls.ssl_context() if c.tls else None)
        await site.start()
        self.http_port = self._runner.addresses[0][1]
        if c.grpc_port >= 0:
            await self._start_grpc()
        mode = "disaggregated" if c.disaggregated else "colocated"
        found = {r: ",".join(self.discovery.views.get(r, ()) if self.discovery else getattr(c, r))
                 for r in ("prefill", "decode")}
        logger.info("router serving %s (%s, %s policy, %s discovery; prefill=[%s] decode=[%s]) on %s://%s:%d%s",
                    self.model.name, mode, self.policy.name, c.discovery, found["prefill"], found["decode"],
                    "https" if c.tls else "http", c.host, self.http_port,
                    f" and gRPC{' (TLS)' if c.tls else ''} {c.host}:{self.grpc_port}" if self.grpc_port else "")

    async def _start_grpc(self) -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", self.config.max_payload_size)])
        pb_grpc.add_GenerateServicer_to_server(GenerateService(self), server)
        self._grpc_health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._grpc_health, server)
        names = (pb.DESCRIPTOR.services_by_name["Generate"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        address, tls = f"{self.config.host}:{self.config.grpc_port}", self.config.tls
        self.grpc_port = (server.add_secure_port(address, tls.grpc_credentials()) if tls
                          else server.add_insecure_port(address))
        await server.start()
        await self._grpc_health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._grpc_server = server

    async def stop(self) -> None:
        """Stops accepting, lets in-flight requests finish (up to the drain timeout), closes."""
        self.draining = True
        logger.info("router draining in-flight requests (up to %.0fs)", self.config.drain_timeout_s)
        stopping = []
        if self._grpc_server is not None:
            await self._grpc_health.enter_graceful_shutdown()
            stopping.append(self._grpc_server.stop(self.config.drain_timeout_s))
        if self._runner is not None:
            stopping.append(self._runner.cleanup())
        if self.responses_serving is not None:  # background responses, which no handler waits on
            stopping.append(self.responses_serving.close(self.config.drain_timeout_s))
        await asyncio.gather(*stopping)
        self.admission.close()
        await self.dispatcher.drain()
        await self.lora.close()
        if self.discovery is not None:
            await self.discovery.close()
        if self._kv_sync is not None:
            self._kv_sync.cancel()
            await asyncio.gather(self._kv_sync, return_exceptions=True)
        await self.kv_index.close()
        await self.pool.close()
        logger.info("router stopped")
