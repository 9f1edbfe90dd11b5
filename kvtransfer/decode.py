"""Decode side: pulls published blocks into its own block ids, off the engine thread."""
from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

from kvtransfer import wire
from kvtransfer.connector import DecodeTransport, KVConnector, TransferEvents
from kvtransfer.errors import (AuthError, BlockRangeError, KVTransferError, LeaseExpired, PeerLost, ProtocolError,
                               TransferAborted, TransferTimeout)
from kvtransfer.handle import KVHandle
from kvtransfer.links import Link, PrefillLinks, settimeout
from kvtransfer.shards import PullSource, plan_pull

log = logging.getLogger(__name__)


@dataclass
class _Pull:
    request_id: str
    handle: KVHandle
    local_block_ids: list[int]
    first_block: int
    deadline: float
    sources: tuple[PullSource, ...]  # the prefill ranks it pulls from, then those it only releases
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: "Future[None]" = field(default_factory=Future)
    socks: set[socket.socket] = field(default_factory=set)  # connections in use; abort() shuts them down
    errors: list[BaseException] = field(default_factory=list)  # of its sources, in the order they happened
    held: dict[int, Link] = field(default_factory=dict)  # prefill rank -> its pulled connection, kept to release on

    @property
    def alone(self) -> bool:
        """One prefill rank to pull from: it is released as its part finishes (no waiting on others)."""
        return len(self.sources) == 1


class DecodeConnector(KVConnector):
    """Pull model: the engine reserves local blocks first, then asks for exactly those bytes.

    `start_pull` validates what it can locally (tag, layout, block ranges) and raises at once;
    everything else is reported by `get_finished()`. A pull that reports failure has stopped
    writing into its reserved blocks, and its handle is spent: the prefill side is told to
    free the blocks (best effort; failing that, its lease expires).

    Under tensor parallelism there is one connector per decode rank, its layout naming the
    rank's shard: it pulls exactly its KV heads, from whichever prefill ranks hold them (the
    handle, merged from the prefill's ranks, names them all), and releases its part of their leases.
    """
    role = "decode"

    def __init__(self, transport: DecodeTransport, *, secret: bytes, engine_id: str,
                 auth_token: bytes = b"",
                 num_workers: int = 4, default_timeout_s: float = 30.0):
        if not secret:
            raise ValueError("a deployment secret is required to verify KV handles")
        self._transport = transport
        self._secret = secret
        self._links = PrefillLinks(transport, wire.handshake_key(secret, auth_token), engine_id)
        self.engine_id = engine_id
        self.default_timeout_s = default_timeout_s
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="kv-decode")
        self._lock = threading.Lock()
        self._inflight: dict[str, _Pull] = {}
        self._events = TransferEvents()
        self._counters: Counter[str] = Counter()
        self._transfer_ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 16)
        self._closed = False

    @property
    def worker(self) -> DecodeTransport:
        return self._transport

    # ---- scheduler-facing -------------------------------------------------------------------
    def start_pull(self, request_id: str, handle: KVHandle, local_block_ids: Sequence[int],
                   first_block: int = 0, timeout_s: float | None = None) -> "Future[None]":
        """Pull remote blocks handle.block_ids[first_block:first_block + len(local_block_ids)]
        into `local_block_ids` (the first `first_block` blocks being already held locally).

        The outcome is reported by `get_finished()`; the returned future resolves at the same
        time (None, or the KVTransferError), for callers that would rather wait than poll."""
        handle.verify(self._secret)
        self._transport.layout.check_compatible(handle.layout_fingerprint, handle.layout)
        sources = plan_pull(self._transport.layout, handle)
        local = [int(b) for b in local_block_ids]
        if first_block < 0 or first_block + len(local) > handle.num_blocks:
            raise BlockRangeError(f"blocks [{first_block}, {first_block + len(local)}) outside the "
                                  f"{handle.num_blocks} published for {handle.request_id!r}")
        if len(set(local)) != len(local):
            raise BlockRangeError("local block ids repeat")
        self._transport.check_block_ids(local)
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        pull = _Pull(request_id, handle, local, first_block, time.monotonic() + timeout, sources)
        with self._lock:
            if self._closed:
                raise KVTransferError("connector is closed")
            if request_id in self._inflight:
                raise ValueError(f"request {request_id!r} is already being pulled")
            self._inflight[request_id] = pull
            self._counters["pulls_started"] += 1
        self._executor.submit(self._run_pull, pull)
        return pull.done

    def extend_lease(self, handle: KVHandle, seconds: float) -> "Future[float]":
        """Keep the prefill side's blocks while waiting for room; resolves to the new expiry
        (unix time; the earliest, over the prefill ranks this rank deals with)."""
        handle.verify(self._secret)
        return self._executor.submit(self._on_each, plan_pull(self._transport.layout, handle),
                                     wire.Extend(handle.to_bytes(), seconds))

    def release(self, handle: KVHandle) -> "Future[float]":
        """Free the prefill side's blocks without pulling (e.g. all of them were cached here):
        this rank's part of them, on every prefill rank it deals with."""
        return self._executor.submit(self._on_each, plan_pull(self._transport.layout, handle),
                                     self._release_msg(handle))

    def _on_each(self, sources: Sequence[PullSource], msg: wire.Message) -> float:
        return min(self._control(source.ref.endpoint, msg) for source in sources)

    def _release_msg(self, handle: KVHandle) -> wire.Release:
        shard = self._transport.layout.shard
        return wire.Release(handle.to_bytes(), shard.tp_rank, shard.tp_size)

    def abort(self, request_id: str) -> bool:
        """Stop a pull and free the prefill side's blocks; the pull is reported as failed
        (TransferAborted) once it no longer writes. A transfer on a socket (tcp, shm, ucx)
        stops at once; a gloo/NCCL transfer stops at its deadline."""
        with self._lock:
            pull = self._inflight.get(request_id)
            if pull is not None:
                pull.cancelled.set()
                for sock in pull.socks:
                    _shutdown(sock)
        return pull is not None

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def get_finished(self) -> TransferEvents:
        with self._lock:
            events, self._events = self._events, TransferEvents()
        return events

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            request_ids = list(self._inflight)
        for request_id in request_ids:  # socket transfers stop at once, gloo/NCCL at their deadline
            self.abort(request_id)
        self._executor.shutdown(wait=True, cancel_futures=False)
        self._links.close()
        self._transport.close()

    # ---- worker threads ---------------------------------------------------------------------
    def _run_pull(self, pull: _Pull) -> None:
        error, received = None, 0
        try:
            received = self._pull_sources(pull)
        except Exception as e:  # noqa: BLE001 - every failure must reach get_finished()
            if isinstance(e, KVTransferError):
                error = e
            elif isinstance(e, OSError):  # sockets: resets, refusals, timeouts
                error = PeerLost(f"{type(e).__name__}: {e}")
            else:  # a bug, not a transfer failure: reported as it is, for the engine to surface
                log.exception("kvtransfer pull of %s raised an unexpected error", pull.request_id)
                error = e
            if pull.cancelled.is_set() and isinstance(error, KVTransferError):
                error = TransferAborted(f"request {pull.request_id!r} aborted during its pull")
        with self._lock:
            del self._inflight[pull.request_id]
            if error is None:
                self._counters["pulls_finished"] += 1
                self._counters["bytes_received"] += received
                self._events.finished.append(pull.request_id)
            else:
                self._counters["aborted" if isinstance(error, TransferAborted) else "failed"] += 1
                if not isinstance(error, KVTransferError):
                    self._counters["unexpected_errors"] += 1
                if isinstance(error, TransferTimeout):
                    self._counters["timeouts"] += 1
                self._events.failed[pull.request_id] = error
        if error is not None:
            log.info("kvtransfer pull of %s failed: %s", pull.request_id, error)
            pull.done.set_exception(error)
            # Nobody pulls these blocks now (the engine recomputes instead): the prefill side
            # gets them back at once, not when the lease expires. Best effort, after reporting.
            for conn in pull.held.values():  # clean (their parts finished): Abort may take them
                self._links.put_back(conn)
            if not isinstance(error, (LeaseExpired, AuthError)):
                self._abort_remote(pull)
        else:
            pull.done.set_result(None)
            if not pull.alone:
                self._release_sources(pull)

    def _release_sources(self, pull: _Pull) -> None:
        """A pull from several prefill ranks releases their leases only once every part is in:
        a rank whose part landed before another rank failed is aborted with the rest, so each
        prefill rank counts a transfer finished exactly when the decode has the whole request.
        After the pull is reported (it costs the request nothing), on the connection each part
        came over (so the prefill rank has counted its part first; every source's connection was
        opened during the pull, in parallel); a rank not reached keeps its blocks until the lease
        expires."""
        for source in pull.sources:
            conn = pull.held.pop(source.ref.rank)
            try:
                settimeout(conn, time.monotonic() + self.default_timeout_s)
                wire.send_msg(conn.sock, self._release_msg(pull.handle))
                wire.expect(conn.sock, wire.Ok)
            except Exception as e:  # noqa: BLE001 - the pull is done; the lease expires instead
                self._links.drop(conn)
                with self._lock:
                    self._counters["releases_failed"] += 1
                log.warning("release of %s on prefill rank %d (%s) failed, its blocks stay until the lease "
                            "expires: %s", pull.request_id, source.ref.rank, source.ref.endpoint, e)
            else:
                self._links.put_back(conn)

    def _pull_sources(self, pull: _Pull) -> int:
        """Every prefill rank of the pull at once (each its own connection and its own heads of
        the blocks: disjoint writes); the first failure stops the others. Returns bytes received."""
        def run(source: PullSource) -> int:
            try:
                return self._pull_source(pull, source)
            except BaseException as e:
                with self._lock:
                    pull.errors.append(e)
                    for sock in pull.socks:  # the request is lost: stop its other transfers now
                        _shutdown(sock)
                raise

        if pull.alone:
            return run(pull.sources[0])
        received = [0] * len(pull.sources)

        def run_into(i: int) -> None:
            try:
                received[i] = run(pull.sources[i])
            except BaseException:  # noqa: BLE001 - recorded in pull.errors
                pass

        threads = [threading.Thread(target=run_into, args=(i,), name="kv-decode-source", daemon=True)
                   for i in range(1, len(pull.sources))]
        for thread in threads:
            thread.start()
        run_into(0)
        for thread in threads:
            thread.join()
        if pull.errors:
            raise pull.errors[0]  # the cause; the others are its consequence
        return sum(received)

    def _pull_source(self, pull: _Pull, source: PullSource) -> int:
        conn = self._links.acquire(source.ref.endpoint, pull.deadline)
        try:
            with self._lock:
                pull.socks.add(conn.sock)
                if pull.errors:
                    raise TransferAborted(f"request {pull.request_id!r}: another source failed")
            if pull.cancelled.is_set():
                raise TransferAborted(f"request {pull.request_id!r} aborted before its pull started")
            received = self._pull_on(conn, pull, source)
        except BaseException:
            self._links.drop(conn)
            raise
        finally:
            with self._lock:
                pull.socks.discard(conn.sock)
        if pull.alone:
            self._links.put_back(conn)
        else:
            with self._lock:
                pull.held[source.ref.rank] = conn
        return received

    def _pull_on(self, conn: Link, pull: _Pull, source: PullSource) -> int:
        """Pull (or only release) one prefill rank's part; returns the bytes received. With
        several sources the releases wait for every part (`_release_sources`)."""
        n = len(pull.local_block_ids)
        if not n or not source.pulls:  # every block was already here, or nobody reads this replica
            if not pull.alone:
                return 0  # released with the others, once every part is in
            settimeout(conn, pull.deadline)
            wire.send_msg(conn.sock, self._release_msg(pull.handle))
            wire.expect(conn.sock, wire.Ok)
            return 0
        transfer_id = next(self._transfer_ids)
        nbytes = self._transfer(conn, pull, source, n, transfer_id)
        if pull.cancelled.is_set():
            raise TransferAborted(f"request {pull.request_id!r} aborted during its pull")
        # The prefill side pinned the blocks until our deadline: done before it, the copy read
        # blocks that nobody could free or reuse meanwhile. Past it, nothing is guaranteed.
        settimeout(conn, pull.deadline)
        shard = self._transport.layout.shard
        wire.send_msg(conn.sock, wire.Finish(transfer_id, pull.handle.to_bytes(), pull.alone, shard.tp_rank, shard.tp_size))
        return nbytes

    def _transfer(self, conn: Link, pull: _Pull, source: PullSource, n: int, transfer_id: int) -> int:
        layout = self._transport.layout
        whole = source.remote_heads is None  # the prefill rank's whole shard: the pull names no heads
        settimeout(conn, pull.deadline)
        wire.send_msg(conn.sock, wire.Pull(transfer_id, pull.handle.to_bytes(), pull.first_block, n,
                                           layout.fingerprint, pull.deadline - time.monotonic(),
                                           -1 if whole else source.head_start, -1 if whole else source.head_end,
                                           layout.tp_rank, layout.tp_size, layout.describe()))
        ready = wire.expect(conn.sock, wire.PullReady)
        nbytes = n * layout.num_layers * layout.head_bytes_per_layer(source.num_heads)
        if ready.transfer_id != transfer_id or ready.nbytes != nbytes:
            raise ProtocolError(f"peer announced {ready.nbytes} bytes, expected {nbytes}")
        remote = list(pull.handle.block_ids[pull.first_block:pull.first_block + n])
        self._transport.recv_blocks(conn.peer, conn.sock, pull.local_block_ids, remote, transfer_id, pull.deadline,
                                    source.heads, source.remote_heads)
        return nbytes

    def _abort_remote(self, pull: _Pull) -> None:
        for source in pull.sources:
            try:
                self._control(source.ref.endpoint, wire.Abort(pull.handle.to_bytes()), timeout_s=2.0)
            except Exception as e:  # noqa: BLE001 - best effort: the lease expires anyway
                log.debug("abort of %s on %s not delivered: %s", pull.request_id, source.ref.endpoint, e)

    def _control(self, endpoint: str, msg: wire.Message, timeout_s: float | None = None) -> float:
        deadline = time.monotonic() + (timeout_s or self.default_timeout_s)
        conn = self._links.acquire(endpoint, deadline)
        try:
            settimeout(conn, deadline)
            wire.send_msg(conn.sock, msg)
            ok = wire.expect(conn.sock, wire.Ok)
        except BaseException:
            self._links.drop(conn)
            raise
        self._links.put_back(conn)
        return ok.lease_expiry


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
