"""Prefill side: publishes requests' blocks under leases and serves pulls of them."""
from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time
from collections import Counter
from typing import Callable, Sequence

from kvtransfer import wire
from kvtransfer.connector import KVConnector, PrefillTransport, TransferEvents, no_delay
from kvtransfer.errors import AuthError, BlockRangeError, KVTransferError, LeaseExpired, ProtocolError, UnknownRequest
from kvtransfer.handle import MAX_BLOCKS, KVHandle, KVShardRef
from kvtransfer.lease import EXPIRED, RELEASED, LeaseTable
from kvtransfer.shards import lease_releasers, local_heads

log = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT_S = 5.0
MAX_TRANSFER_TIMEOUT_S = 600.0


class PrefillConnector(KVConnector):
    """Owns the lease table and a control server; `worker` moves the bytes.

    `on_blocks_freed(request_id, block_ids)` is called from `get_finished()`, on the caller's
    thread, for every lease that ends (released by the decode side, expired, or aborted).
    """
    role = "prefill"

    def __init__(self, transport: PrefillTransport, *, secret: bytes, engine_id: str,
                 auth_token: bytes = b"",
                 host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 lease_ttl_s: float = 30.0,
                 on_blocks_freed: Callable[[str, tuple[int, ...]], None] | None = None,
                 allowed_peers: Sequence[str] | None = None, max_connections: int = 64):
        if not secret:
            raise ValueError("a deployment secret is required to sign KV handles")
        self._transport = transport
        self._secret = secret
        self._handshake_key = wire.handshake_key(secret, auth_token)
        self.engine_id = engine_id
        self.leases = LeaseTable(lease_ttl_s)
        self.on_blocks_freed = on_blocks_freed
        self._allowed_peers = set(allowed_peers) if allowed_peers is not None else None
        self._max_connections = max_connections
        self._counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closed = threading.Event()
        self._listener, self.endpoint = transport.listen(host, port, advertise_host or host)
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kv-prefill-accept", daemon=True)
        self._accept_thread.start()
        log.info("kvtransfer prefill %s serving %s on %s", engine_id, transport.name, self.endpoint)

    @property
    def worker(self) -> PrefillTransport:
        return self._transport

    # ---- scheduler-facing -------------------------------------------------------------------
    def publish(self, request_id: str, block_ids: Sequence[int], num_tokens: int,
                lease_ttl_s: float | None = None) -> KVHandle:
        """Pin a request's blocks until the decode side releases them (or the lease ends)."""
        block_ids = tuple(int(b) for b in block_ids)
        if len(block_ids) > MAX_BLOCKS:
            raise BlockRangeError(f"{len(block_ids)} blocks exceed the {MAX_BLOCKS} a handle may carry")
        self._transport.check_block_ids(block_ids)
        ttl = self.leases.default_ttl_s if lease_ttl_s is None else lease_ttl_s
        layout = self._transport.layout
        sharded: dict = {}
        if layout.tp_size > 1:  # this rank's part: merge_shard_handles makes the request's handle
            shard = layout.shard
            sharded = dict(shards=(KVShardRef(shard.tp_rank, shard.tp_size, self.endpoint, shard.head_start,
                                              shard.head_end, self.engine_id),), layout=layout.describe())
        handle = KVHandle(request_id=request_id, engine_id=self.engine_id, transport=self._transport.name,
                          endpoint=self.endpoint, block_ids=block_ids, num_tokens=num_tokens,
                          layout_fingerprint=layout.fingerprint,
                          lease_expiry=time.time() + ttl, **sharded).signed(self._secret)
        self.leases.add(request_id, block_ids, handle.tag, ttl)
        return handle

    def abort(self, request_id: str) -> bool:
        """Free a request's blocks (e.g. the client went away): now, or when a transfer reading
        them ends; False if none were published."""
        return self.leases.abort(request_id)

    @property
    def num_published_blocks(self) -> int:
        return self.leases.num_published_blocks

    def get_finished(self) -> TransferEvents:
        self.leases.expire()
        events = TransferEvents(freed=self.leases.drain_freed())
        for freed in events.freed:
            if freed.reason == RELEASED:
                events.finished.append(freed.request_id)
            elif freed.reason == EXPIRED:
                events.failed[freed.request_id] = LeaseExpired(f"request {freed.request_id!r}: lease expired")
            if self.on_blocks_freed is not None:
                self.on_blocks_freed(freed.request_id, freed.block_ids)
        return events

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counters)
        out.update(self.leases.counters)
        out["published_blocks"] = self.leases.num_published_blocks
        return out

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._conns.items())
        for sock, _ in conns:
            _shutdown(sock)
        self._accept_thread.join(timeout=5)
        for _, thread in conns:
            thread.join(timeout=5)
        self._transport.close()

    # ---- network threads --------------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counters[key] += n

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            peer_host = addr[0] if isinstance(addr, tuple) else "127.0.0.1"  # unix sockets are local
            with self._lock:
                full = len(self._conns) >= self._max_connections
            if full or (self._allowed_peers is not None and peer_host not in self._allowed_peers):
                self._count("rejected_peers")
                sock.close()
                continue
            thread = threading.Thread(target=self._serve, args=(no_delay(sock),), name="kv-prefill-conn", daemon=True)
            with self._lock:
                self._conns[sock] = thread
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        peer, authenticated, pinned = None, False, {}
        try:
            peer = self._handshake(sock)
            authenticated = True
            while not self._closed.is_set():
                msg, _ = wire.recv_msg(sock)
                self._dispatch(peer, sock, msg, pinned)
        except (KVTransferError, _BrokenConnection) as e:  # the peer went away or broke the protocol
            if not authenticated:
                self._count("rejected_peers")
                log.warning("kvtransfer peer %s refused during the handshake: it did not prove the "
                            "deployment's KV secret and engine token (%s)", _peer_name(sock), e)
            else:
                log.debug("kvtransfer connection closed: %s", e)
        except Exception:  # noqa: BLE001 - a transport bug must not kill the server, only this connection
            log.exception("kvtransfer connection failed")
        finally:
            for transfer_id, request_id in pinned.items():
                self.leases.unpin(request_id, transfer_id)
            if peer is not None:
                self._transport.close_peer(peer)
            sock.close()
            with self._lock:
                self._conns.pop(sock, None)

    def _handshake(self, sock: socket.socket) -> object:
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        hello = wire.expect(sock, wire.Hello)
        nonce = os.urandom(32)
        server_proof = wire.proof(self._handshake_key, b"server", hello.nonce, nonce)
        wire.send_msg(sock, wire.Challenge(self.engine_id, nonce, server_proof))
        auth = wire.expect(sock, wire.Auth)
        if not hmac.compare_digest(auth.proof, wire.proof(self._handshake_key, b"client", hello.nonce, nonce)):
            raise AuthError(f"peer {hello.engine_id!r} failed the handshake")
        peer, info, fds = self._transport.open_peer(sock, auth.transport_info)
        wire.send_msg(sock, wire.Welcome(info), fds)
        sock.settimeout(None)
        return peer

    def _verified(self, raw: bytes) -> tuple[KVHandle, bytes]:
        """The handle, checked, and the tag of this engine's lease in it (a handle merged from a
        TP prefill's ranks carries each rank's tag in its shard entry)."""
        handle = KVHandle.from_bytes(raw)
        handle.verify(self._secret)
        if not handle.shards:
            if handle.engine_id != self.engine_id:
                raise UnknownRequest(f"handle of engine {handle.engine_id!r} sent to engine {self.engine_id!r}")
            return handle, handle.tag
        shard = self._transport.layout.shard
        ref = next((r for r in handle.shards if r.engine_id == self.engine_id), None)
        if ref is None:
            raise UnknownRequest(f"handle of engines {[r.engine_id for r in handle.shards]} sent to engine "
                                 f"{self.engine_id!r}")
        if (ref.rank, ref.tp_size, ref.head_start, ref.head_end) != (shard.tp_rank, shard.tp_size,
                                                                      shard.head_start, shard.head_end):
            raise ProtocolError(f"handle names rank {ref.rank} of {ref.tp_size} with heads [{ref.head_start}, "
                                f"{ref.head_end}) for engine {self.engine_id!r}, which is {shard}")
        return handle, ref.tag or handle.tag

    def _release(self, raw: bytes, decode_rank: int, decode_tp: int) -> None:
        handle, tag = self._verified(raw)
        releasers = lease_releasers(self._transport.layout, decode_rank, decode_tp)
        self.leases.release(handle.request_id, tag, decode_rank, releasers)

    def _dispatch(self, peer: object, sock: socket.socket, msg: wire.Message, pinned: dict[int, str]) -> None:
        try:
            if isinstance(msg, wire.Pull):
                self._serve_pull(peer, sock, msg, pinned)
                return
            if isinstance(msg, wire.Finish):  # one way: the puller does not wait for an answer
                if msg.transfer_id in pinned:
                    self.leases.unpin(pinned.pop(msg.transfer_id), msg.transfer_id)
                if msg.release:
                    self._release(msg.handle, msg.decode_rank, msg.decode_tp)
                return
            reply = self._control(msg)
        except KVTransferError as e:
            self._count("refused")
            if not isinstance(msg, wire.Finish):
                wire.send_msg(sock, wire.Error(e.code, str(e)))
            return
        wire.send_msg(sock, reply)

    def _control(self, msg: wire.Message) -> wire.Message:
        if isinstance(msg, wire.Extend):
            handle, tag = self._verified(msg.handle)
            remaining = self.leases.extend(handle.request_id, tag, min(msg.seconds, MAX_TRANSFER_TIMEOUT_S))
            return wire.Ok(lease_expiry=time.time() + remaining)
        if isinstance(msg, wire.Release):
            self._release(msg.handle, msg.decode_rank, msg.decode_tp)
            return wire.Ok()
        if isinstance(msg, wire.Abort):
            handle, tag = self._verified(msg.handle)
            self.leases.check(handle.request_id, tag)
            self.leases.abort(handle.request_id)
            return wire.Ok()
        raise ProtocolError(f"unexpected {type(msg).__name__} on a prefill connection")

    def _serve_pull(self, peer: object, sock: socket.socket, msg: wire.Pull, pinned: dict[int, str]) -> None:
        handle, tag = self._verified(msg.handle)
        layout = self._transport.layout
        layout.check_compatible(msg.layout_fingerprint, msg.layout)
        layout.check_compatible(handle.layout_fingerprint, handle.layout)
        if msg.num_blocks < 0 or msg.first_block < 0 or msg.first_block + msg.num_blocks > handle.num_blocks:
            raise BlockRangeError(f"blocks [{msg.first_block}, {msg.first_block + msg.num_blocks}) "
                                  f"outside the {handle.num_blocks} published for {handle.request_id!r}")
        heads = None if msg.head_end == -1 else local_heads(layout.shard, msg.head_start, msg.head_end)
        lease_releasers(layout, msg.decode_rank, msg.decode_tp)  # refuse a decode TP that cannot split the heads
        timeout_s = min(max(msg.timeout_s, 0.001), MAX_TRANSFER_TIMEOUT_S)
        lease = self.leases.pin(handle.request_id, tag, msg.transfer_id, timeout_s)
        pinned[msg.transfer_id] = handle.request_id  # unpinned by Finish, or when the connection ends
        block_ids = list(lease.block_ids[msg.first_block:msg.first_block + msg.num_blocks])
        num_heads = layout.num_kv_heads if heads is None else heads[1] - heads[0]
        nbytes = len(block_ids) * layout.num_layers * layout.head_bytes_per_layer(num_heads)
        wire.send_msg(sock, wire.PullReady(msg.transfer_id, nbytes))
        try:
            self._transport.send_blocks(peer, sock, block_ids, msg.transfer_id, timeout_s, heads)
        except Exception as e:
            self._count("failed")
            # Raw bytes may be half sent: an error frame now would read as KV data. Hang up.
            raise _BrokenConnection(f"transfer {msg.transfer_id} failed: {e}") from e
        self._count("pulls_served")
        self._count("bytes_sent", nbytes)


def _peer_name(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername() or "(local)")
    except OSError:
        return "(gone)"


class _BrokenConnection(Exception):
    """A failure after the data phase began: the connection is closed, never answered."""


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass

