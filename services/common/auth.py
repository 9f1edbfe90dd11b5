"""Engine authentication: a shared bearer token checked by a server interceptor and/or (mutual) TLS on
the engines' gRPC services, and the matching credentials on the channels the router opens to them."""
from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common.flags import add

logger = logging.getLogger("pdserve.auth")

TOKEN_METADATA = "authorization"
# kubelet's gRPC probes send no metadata and present no certificate: health (serving or not, nothing
# else) stays reachable without the token, and with TLS on a plaintext port of its own (--health-port).
PUBLIC_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
REFUSAL_LOG_INTERVAL_S = 10.0


def read_token(token: str | None, token_file: str | None, flag: str = "--auth-token") -> bytes | None:
    """The token from a flag / environment value or a file (a mounted Secret); None when neither is set."""
    if token and token_file:
        raise ValueError(f"give {flag} or {flag}-file, not both")
    if token_file:
        try:
            with open(token_file, "rb") as f:
                token_bytes = f.read().strip()  # a Secret written with `echo` ends with a newline
        except OSError as e:
            raise ValueError(f"{flag}-file: cannot read {token_file}: {e.strerror}") from None
        if not token_bytes:
            raise ValueError(f"{flag}-file: {token_file} is empty")
        return token_bytes
    return token.strip().encode() if token and token.strip() else None


def _read(path: str | None, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None


def _key_pair(certfile: str | None, keyfile: str | None, prefix: str) -> tuple[bytes | None, bytes | None]:
    cert, key = _read(certfile, f"{prefix}ssl-certfile"), _read(keyfile, f"{prefix}ssl-keyfile")
    if bool(cert) != bool(key):
        raise ValueError(f"{prefix}ssl-certfile and {prefix}ssl-keyfile go together")
    return cert, key


@dataclass(frozen=True)
class ServerAuth:
    """What an engine demands of its callers. Built once from the flags (files read at start-up)."""
    token: bytes | None = field(default=None, repr=False)
    certificate: bytes | None = None  # PEM chain: TLS on when set
    private_key: bytes | None = field(default=None, repr=False)
    client_ca: bytes | None = None  # PEM: clients must present a certificate it signed (mutual TLS)

    @classmethod
    def from_args(cls, args) -> "ServerAuth":
        cert, key = _key_pair(args.ssl_certfile, args.ssl_keyfile, "--")
        ca = _read(args.ssl_ca_certs, "--ssl-ca-certs")
        if ca and not cert:
            raise ValueError("--ssl-ca-certs (client certificates) needs --ssl-certfile and --ssl-keyfile")
        return cls(read_token(args.auth_token, args.auth_token_file), cert, key, ca)

    @property
    def tls(self) -> bool:
        return self.certificate is not None

    def describe(self) -> str:
        parts = (["mutual TLS" if self.client_ca else "TLS"] if self.tls else []) + (["token"] if self.token else [])
        return " + ".join(parts) or "none"

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenInterceptor(self.token)] if self.token else []

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        if not self.tls:
            return server.add_insecure_port(address)
        credentials = grpc.ssl_server_credentials([(self.private_key, self.certificate)],
                                                  root_certificates=self.client_ca,
                                                  require_client_auth=self.client_ca is not None)
        return server.add_secure_port(address, credentials)


def add_server_auth_flags(p) -> None:
    """An engine's authentication flags (TLS ones named as vLLM's HTTP server names them)."""
    add(p, "--auth-token", default=None,
        help="require 'authorization: Bearer TOKEN' on every gRPC call but health, and the same token "
             "on KV control connections (prefer the environment variable or --auth-token-file)")
    add(p, "--auth-token-file", default=None, help="a file holding the token (e.g. a mounted Secret)")
    add(p, "--ssl-certfile", default=None, help="serve gRPC over TLS with this PEM certificate chain")
    add(p, "--ssl-keyfile", default=None, help="the TLS private key (PEM)")
    add(p, "--ssl-ca-certs", default=None,
        help="CA bundle (PEM): clients must present a certificate it signed (mutual TLS)")
    add(p, "--health-port", type=int, default=None,
        help="with TLS: a plaintext port serving only grpc.health.v1, for kubelet gRPC probes")


class _RefusalLog:
    """One warning per interval, with the count since the last: a flood of bad calls cannot flood the log."""

    def __init__(self) -> None:
        self._last = float("-inf")
        self._suppressed = 0

    def __call__(self, method: str, peer: str) -> None:
        now = time.monotonic()
        if now - self._last < REFUSAL_LOG_INTERVAL_S:
            self._suppressed += 1
            return
        more = f" (and {self._suppressed} more since the last report)" if self._suppressed else ""
        logger.warning("refused %s from %s: missing or wrong bearer token%s", method, peer, more)
        self._last, self._suppressed = now, 0


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without `authorization: Bearer <token>` (health excepted) or with a
    wrong one (health included: a router holding the wrong token sees why its instances are down).
    The token is compared in constant time; a refused call's body is never deserialized."""

    def __init__(self, token: bytes) -> None:
        self._expected = b"Bearer " + token
        self._log = _RefusalLog()

    def _valid(self, metadata, public: bool) -> bool:
        for key, value in metadata or ():
            if key == TOKEN_METADATA:  # checked wherever it is given: a wrong one fails health checks too
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._expected)
        return public

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or self._valid(details.invocation_metadata, details.method in PUBLIC_METHODS):
            return handler
        return _refusing(handler, details.method, self._log)


def _refusing(handler, method: str, log: _RefusalLog):
    """A handler of the same streaming shape that answers UNAUTHENTICATED."""
    async def refuse(context) -> None:
        log(method, context.peer())
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    async def unary(request, context):
        await refuse(context)

    async def streaming(request, context):
        await refuse(context)
        yield  # never reached: abort raises

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary)
    return grpc.stream_stream_rpc_method_handler(streaming)


class _AddToken:
    """Puts the bearer token on every call of a channel (plaintext or TLS alike). grpc.aio files an
    interceptor under the first call shape it implements, hence one subclass per shape."""

    def __init__(self, token: bytes) -> None:
        self._entry = (TOKEN_METADATA, "Bearer " + token.decode())

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return details._replace(metadata=grpc.aio.Metadata(*tuple(details.metadata or ()), self._entry))


class _AddTokenUnaryUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AddTokenUnaryStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AddTokenStreamUnary(_AddToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _AddTokenStreamStream(_AddToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


_ADD_TOKEN = (_AddTokenUnaryUnary, _AddTokenUnaryStream, _AddTokenStreamUnary, _AddTokenStreamStream)


@dataclass(frozen=True)
class ChannelAuth:
    """The credentials the router (or any client) presents to engines."""
    token: bytes | None = field(default=None, repr=False)
    ca_certs: bytes | None = None  # PEM: TLS on when set (the engines' certificates are checked against it)
    certificate: bytes | None = None  # PEM: the client certificate, for mutual TLS
    private_key: bytes | None = field(default=None, repr=False)
    server_name: str | None = None  # the name the engines' certificate holds, when dialled by address

    @classmethod
    def from_flags(cls, token: str | None = None, token_file: str | None = None, ca_certs: str | None = None,
                   certfile: str | None = None, keyfile: str | None = None,
                   server_name: str | None = None, prefix: str = "--engine-") -> "ChannelAuth":
        cert, key = _key_pair(certfile, keyfile, prefix)
        ca = _read(ca_certs, f"{prefix}ssl-ca-certs")
        if (cert or server_name) and not ca:
            raise ValueError(f"{prefix}ssl-certfile/{prefix}ssl-server-name need {prefix}ssl-ca-certs (TLS)")
        return cls(read_token(token, token_file, f"{prefix}auth-token"), ca, cert, key, server_name or None)

    @property
    def tls(self) -> bool:
        return self.ca_certs is not None

    def describe(self) -> str:
        parts = (["mutual TLS" if self.certificate else "TLS"] if self.tls else []) + (["token"] if self.token else [])
        return " + ".join(parts) or "none"

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """For calls made without the channel below (sync clients, tests)."""
        return ((TOKEN_METADATA, "Bearer " + self.token.decode()),) if self.token else ()

    def aio_channel(self, address: str, options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
        options = list(options or [])
        interceptors = [cls(self.token) for cls in _ADD_TOKEN] if self.token else None
        if not self.tls:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        credentials = grpc.ssl_channel_credentials(self.ca_certs, self.private_key, self.certificate)
        return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
