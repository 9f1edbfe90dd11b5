"""The shape of every pdserve gRPC service: grpc.aio, an interceptor mapping exceptions to
status codes, grpc.health.v1 (NOT_SERVING until warmed up), reflection, graceful drain."""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.request import DuplicateRequestError, EngineDeadError, EngineOverloadedError, InvalidRequestError
from services.common.auth import ServerAuth

logger = logging.getLogger(__name__)


class FailedPrecondition(Exception):
    """The request is valid but this instance cannot serve it (wrong role, no connector)."""


class RequestAborted(Exception):
    """The request was aborted (an Abort call) before it could answer."""


_CODES: list[tuple[type, grpc.StatusCode]] = [
    (DuplicateRequestError, grpc.StatusCode.ALREADY_EXISTS),  # before its base class
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (EngineOverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (RequestAborted, grpc.StatusCode.ABORTED),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
]


def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("%s failed", method)
    await context.abort(code, f"{type(exc).__name__}: {exc}" if code == grpc.StatusCode.INTERNAL else str(exc))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Bad input becomes INVALID_ARGUMENT with its message, never a bare INTERNAL."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    return await inner_uu(request, context)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as e:
                    await _abort(context, method, e)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request, context):
                try:
                    async for response in inner_us(request, context):
                        yield response
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as e:
                    await _abort(context, method, e)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler


class GrpcService:
    """Owns the server, its health service and the SIGTERM drain.

    `auth` adds the token interceptor and TLS; with TLS, `health_port` serves grpc.health.v1 alone in
    plaintext (kubelet's gRPC probes present no certificate), sharing the main server's health states."""

    def __init__(self, host: str, port: int, service_names: Iterable[str],
                 add_servicers: Callable[[grpc.aio.Server], None], drain_timeout_s: float = 30.0,
                 auth: ServerAuth = ServerAuth(), health_port: int | None = None) -> None:
        self.server = grpc.aio.server(interceptors=[*auth.interceptors(), ErrorInterceptor()], options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
        add_servicers(self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], self.server)
        self.port = auth.add_port(self.server, f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        self.health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        if health_port is not None:
            self.health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = self.health_server.add_insecure_port(f"{host}:{health_port}")
            if self.health_port == 0:
                raise OSError(f"cannot listen on {host}:{health_port}")
        self.drain_timeout_s = drain_timeout_s
        self._stopping = asyncio.Event()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)

    async def wait_for_stop(self) -> None:
        await self._stopping.wait()

    def request_stop(self) -> None:
        self._stopping.set()

    async def drain(self, grace_s: float | None = None) -> None:
        """Report NOT_SERVING, refuse new RPCs, let in-flight ones finish (up to the drain
        timeout, or `grace_s`)."""
        await self.set_serving(False)
        servers = [self.server, *([self.health_server] if self.health_server is not None else [])]
        grace = self.drain_timeout_s if grace_s is None else grace_s
        await asyncio.gather(*(s.stop(grace) for s in servers))


def health_serving(address: str, timeout: float = 2.0) -> bool:
    """Whether the plaintext gRPC server at address answers its health check with SERVING."""
    with grpc.insecure_channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return r.status == health_pb2.HealthCheckResponse.SERVING
