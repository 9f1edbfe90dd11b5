"""The engines' token on the KV control channel: a decode that cannot prove it is refused (and logged)
before any block is served, while the prefill keeps serving decodes that can, bit for bit."""
from __future__ import annotations

import logging
import multiprocessing as mp
import time

import pytest
import torch

from kvtransfer import TRANSPORTS, AuthError, KVHandle, KVLayout, PeerLost, create_connector

from kv_peers import LAYOUTS, SECRET, blocks_bytes, fill, reference_caches, wait_events

TOKEN = b"engine-token-0123456789"
LAYOUT = LAYOUTS["f16-bs8-gqa"]
BLOCKS = 64
SEED = 7


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _prefill_child(conn, transport: str) -> None:
    """A prefill engine's connector with the deployment's secret and token, in a process of its own."""
    records = _Records()
    logging.getLogger("kvtransfer.prefill").addHandler(records)
    connector = create_connector(transport, "prefill", KVLayout(**LAYOUT), secret=SECRET,
                                 engine_id="prefill-auth", auth_token=TOKEN)
    fill(connector.worker.allocate_kv_caches(BLOCKS), SEED)
    conn.send("ready")
    while (msg := conn.recv())[0] != "close":
        cmd, args = msg[0], msg[1:]
        if cmd == "publish":
            conn.send(connector.publish(*args).to_bytes())
        elif cmd == "abort":
            conn.send(connector.abort(*args))
        elif cmd == "state":
            connector.get_finished()  # as the engine loop does: frees what ended
            conn.send((connector.stats(), connector.num_published_blocks, list(records.lines)))
    connector.close()


class Prefill:
    def __init__(self, transport: str) -> None:
        self.transport = transport
        self._conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_prefill_child, args=(child, transport), daemon=True)
        self.proc.start()
        child.close()
        assert self._call_raw(None, timeout=120) == "ready"

    def _call_raw(self, msg, timeout: float = 30.0):
        if msg is not None:
            self._conn.send(msg)
        if not self._conn.poll(timeout):
            raise TimeoutError(f"the prefill child did not answer {msg!r} in {timeout}s")
        return self._conn.recv()

    def publish(self, rid: str, block_ids: list[int], num_tokens: int) -> KVHandle:
        return KVHandle.from_bytes(self._call_raw(("publish", rid, block_ids, num_tokens)))

    def abort(self, rid: str) -> bool:
        return self._call_raw(("abort", rid))

    def state(self) -> tuple[dict, int, list[str]]:
        return self._call_raw(("state",))

    def until(self, predicate, timeout: float = 10.0) -> tuple[dict, int, list[str]]:
        """The prefill counts a refusal on its connection thread, once the peer has hung up."""
        deadline = time.monotonic() + timeout
        while not predicate(*(state := self.state())):
            assert time.monotonic() < deadline, f"not reached in {timeout}s: {state[:2]}"
            time.sleep(0.01)
        return state

    def close(self) -> None:
        self._conn.send(("close",))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(params=TRANSPORTS)
def prefill(request):
    if request.param == "ucx":
        pytest.importorskip("ucxx", reason="ucx's bindings are an optional install")
    peer = Prefill(request.param)
    yield peer
    peer.close()


def decode(transport: str, token: bytes):
    connector = create_connector(transport, "decode", KVLayout(**LAYOUT), secret=SECRET, engine_id="decode-auth",
                                 auth_token=token, timeout_s=20.0)
    caches = connector.worker.allocate_kv_caches(BLOCKS)
    for cache in caches:
        cache.reshape(-1).view(torch.uint8).fill_(0xA5)
    return connector, caches


def test_only_decodes_holding_the_token_pull(prefill):
    transport = prefill.transport
    for n, wrong in enumerate((b"", b"another-deployments-token", TOKEN[:-1])):
        rid = f"stolen-{n}"
        handle = prefill.publish(rid, [3, 4, 5], 24)  # a genuine handle: only the token is missing
        intruder, caches = decode(transport, wrong)
        untouched = blocks_bytes(caches, list(range(BLOCKS)))
        try:
            intruder.start_pull(rid, handle, [10, 11, 12])
            error = wait_events(intruder, [rid]).failed[rid]
            assert isinstance(error, (AuthError, PeerLost)), error
            assert blocks_bytes(caches, list(range(BLOCKS))) == untouched  # not one byte arrived
        finally:
            intruder.close()
        # (the intruder's best-effort release of the spent handle is refused as well)
        stats, published, _ = prefill.until(lambda s, p, logs: s.get("rejected_peers", 0) >= n + 1)
        assert stats.get("pulls_served", 0) == 0 and published == 3 * (n + 1)  # nothing served, nothing released
    _, _, logs = prefill.state()
    assert any("refused during the handshake: it did not prove the deployment's KV secret and engine token"
               in line for line in logs), logs
    # the prefill kept serving: a decode with the token pulls every published request, bit-exact
    expected = reference_caches(LAYOUT, BLOCKS, SEED)
    trusted, caches = decode(transport, TOKEN)
    try:
        for n in range(3):
            handle = prefill.publish(f"ok-{n}", [20 + n, 30 + n], 16)
            trusted.start_pull(f"ok-{n}", handle, [40 + n, 50 + n])
            assert wait_events(trusted, [f"ok-{n}"]).failed == {}
            assert blocks_bytes(caches, [40 + n, 50 + n]) == blocks_bytes(expected, [20 + n, 30 + n])
            assert prefill.abort(f"stolen-{n}")
    finally:
        trusted.close()
    prefill.until(lambda s, published, logs: s.get("pulls_served") == 3 and published == 0)
