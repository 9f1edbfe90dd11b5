"""One error type for everything the router refuses, with its HTTP status and gRPC code."""
from __future__ import annotations

import hmac

import grpc

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          502: "upstream_error", 503: "service_unavailable", 504: "timeout"}
Code = grpc.StatusCode
# Bad input of any kind is INVALID_ARGUMENT over gRPC, as the API promises.
_GRPC_CODES = {400: Code.INVALID_ARGUMENT, 401: Code.UNAUTHENTICATED, 404: Code.INVALID_ARGUMENT,
               413: Code.INVALID_ARGUMENT, 422: Code.INVALID_ARGUMENT, 429: Code.RESOURCE_EXHAUSTED,
               502: Code.UNAVAILABLE, 503: Code.UNAVAILABLE, 504: Code.DEADLINE_EXCEEDED}


class RouterError(Exception):
    """Answered as an OpenAI-style error body over HTTP and as a status over gRPC."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.retry_after_s = retry_after_s  # HTTP Retry-After, when a later try can succeed

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC_CODES.get(self.status, Code.INTERNAL)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class ModelNotFound(RouterError):
    """A request's model is none the router serves (OpenAI's 404 model_not_found); `name` is it."""

    def __init__(self, name: str) -> None:
        super().__init__(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        self.name = name


def bad_request(message: str, param: str | None = None, code: str | None = None) -> RouterError:
    return RouterError(400, message, param=param, code=code)


def unsupported(feature: str, param: str) -> RouterError:
    return RouterError(400, f"{feature} is not supported by this server", param=param,
                       code="unsupported_parameter")


def overloaded(role: str, num_tried: int) -> RouterError:
    """Every instance tried refused the request at capacity: the client should come back later."""
    return RouterError(429, f"every {role} instance tried ({num_tried}) is at capacity; retry later",
                       code="overloaded", retry_after_s=1)


def key_matches(given: str, keys: tuple[bytes, ...]) -> bool:
    """`given` is one of the API keys; every key is compared (in constant time each), so the
    answer's timing does not say which one came close."""
    token = given.strip().encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(token, key)
    return found
