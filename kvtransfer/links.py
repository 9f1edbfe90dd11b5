"""The decode side's authenticated control connections to prefill endpoints, kept for reuse."""
from __future__ import annotations

import hmac
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvtransfer import wire
from kvtransfer.connector import DecodeTransport
from kvtransfer.errors import AuthError, PeerLost, TransferTimeout


@dataclass
class Link:
    endpoint: str
    sock: socket.socket
    peer: Any  # the transport's per-connection state


def settimeout(link: Link, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransferTimeout("deadline passed")
    link.sock.settimeout(remaining)


class PrefillLinks:
    """Idle connections per endpoint; a pull takes one (or opens one, with the mutual handshake)
    and puts it back when the exchange ended cleanly, or drops it."""

    def __init__(self, transport: DecodeTransport, handshake_key: bytes, engine_id: str):
        self._transport = transport
        self._handshake_key = handshake_key
        self.engine_id = engine_id
        self._lock = threading.Lock()
        self._idle: dict[str, list[Link]] = {}
        self._closed = False

    def acquire(self, endpoint: str, deadline: float) -> Link:
        with self._lock:
            idle = self._idle.get(endpoint)
            if idle:
                return idle.pop()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferTimeout(f"deadline passed before connecting to {endpoint}")
        try:
            sock = self._transport.connect(endpoint, remaining)
        except socket.timeout:
            raise TransferTimeout(f"timed out connecting to {endpoint}") from None
        except OSError as e:
            raise PeerLost(f"cannot connect to {endpoint}: {e}") from None
        try:
            return Link(endpoint, sock, self._handshake(sock, deadline))
        except BaseException:
            sock.close()
            raise

    def _handshake(self, sock: socket.socket, deadline: float) -> Any:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        nonce = os.urandom(32)
        wire.send_msg(sock, wire.Hello(self.engine_id, nonce))
        challenge = wire.expect(sock, wire.Challenge)
        if not hmac.compare_digest(challenge.proof, wire.proof(self._handshake_key, b"server", nonce, challenge.nonce)):
            raise AuthError(f"prefill {challenge.engine_id!r} failed the handshake")
        wire.send_msg(sock, wire.Auth(wire.proof(self._handshake_key, b"client", nonce, challenge.nonce),
                                      self._transport.client_info()))
        max_fds = self._transport.max_fds
        welcome, fds = wire.expect(sock, wire.Welcome, max_fds) if max_fds else (wire.expect(sock, wire.Welcome), [])
        return self._transport.open_peer(sock, welcome.transport_info, fds)

    def put_back(self, link: Link) -> None:
        with self._lock:
            if not self._closed:
                self._idle.setdefault(link.endpoint, []).append(link)
                return
        self.drop(link)

    def drop(self, link: Link) -> None:
        self._transport.close_peer(link.peer)
        link.sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = [link for idle in self._idle.values() for link in idle]
            self._idle.clear()
        for link in links:
            self.drop(link)
