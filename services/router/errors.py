"""One error type for everything the router refuses, with its HTTP status and gRPC code."""
from __future__ import annotations

import grpc

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          502: "upstream_error", 503: "service_unavailable", 504: "timeout"}
_GRPC_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
               404: grpc.StatusCode.INVALID_ARGUMENT, 413: grpc.StatusCode.INVALID_ARGUMENT,
               422: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
               502: grpc.StatusCode.UNAVAILABLE, 503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


class RouterError(Exception):
    """Answered as an OpenAI-style error body over HTTP and as a status over gRPC."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC_CODES.get(self.status, grpc.StatusCode.INTERNAL)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> RouterError:
    return RouterError(400, message, param=param, code=code)


def unsupported(feature: str, param: str) -> RouterError:
    return RouterError(400, f"{feature} is not supported by this server", param=param,
                       code="unsupported_parameter")
