"""The engines' token on the KV control channel: a decode that cannot prove it is refused (and logged)
before any block is served, while the prefill keeps serving decodes that can, bit for bit."""
from __future__ import annotations

import logging
import time

import pytest
import torch

from kvtransfer import TRANSPORTS, AuthError, KVLayout, PeerLost, create_connector

from kv_peers import LAYOUTS, SECRET, blocks_bytes, fill, wait_events

TOKEN = b"engine-token-0123456789"
LAYOUT = LAYOUTS["f16-bs8-gqa"]
BLOCKS = 64


@pytest.fixture(params=TRANSPORTS)
def prefill(request):
    """A prefill connector holding the deployment's secret and token, its cache seeded at random."""
    try:
        connector = create_connector(request.param, "prefill", KVLayout(**LAYOUT), secret=SECRET,
                                     engine_id="prefill-auth", auth_token=TOKEN)
    except ImportError as e:  # ucx's bindings are an optional install
        pytest.skip(f"{request.param}: {e}")
    caches = connector.worker.allocate_kv_caches(BLOCKS)
    fill(caches, seed=7)
    yield request.param, connector, caches
    connector.close()


def until(predicate, timeout: float = 10.0) -> bool:
    """The prefill counts a refusal on its connection thread, once the peer has hung up."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def decode(transport: str, token: bytes):
    connector = create_connector(transport, "decode", KVLayout(**LAYOUT), secret=SECRET, engine_id="decode-auth",
                                 auth_token=token, timeout_s=20.0)
    caches = connector.worker.allocate_kv_caches(BLOCKS)
    for cache in caches:
        cache.reshape(-1).view(torch.uint8).fill_(0xA5)
    return connector, caches


def test_only_decodes_holding_the_token_pull(prefill, caplog):
    transport, server, prefill_caches = prefill
    caplog.set_level(logging.WARNING, logger="kvtransfer.prefill")
    for n, wrong in enumerate((b"", b"another-deployments-token", TOKEN[:-1])):
        rid = f"stolen-{n}"
        handle = server.publish(rid, [3, 4, 5], 24)  # a genuine handle: only the token is missing
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
        assert until(lambda: server.stats().get("rejected_peers", 0) >= n + 1), server.stats()
        assert server.stats().get("pulls_served", 0) == 0
        assert server.num_published_blocks == 3 * (n + 1)  # nothing was served, nothing released
    assert "refused during the handshake: it did not prove the deployment's KV secret and engine token" in caplog.text
    # the prefill kept serving: a decode with the token pulls every published request, bit-exact
    trusted, caches = decode(transport, TOKEN)
    try:
        for n in range(3):
            handle = server.publish(f"ok-{n}", [20 + n, 30 + n], 16)
            trusted.start_pull(f"ok-{n}", handle, [40 + n, 50 + n])
            assert wait_events(trusted, [f"ok-{n}"]).failed == {}
            assert blocks_bytes(caches, [40 + n, 50 + n]) == blocks_bytes(prefill_caches, [20 + n, 30 + n])
            assert server.abort(f"stolen-{n}")
    finally:
        trusted.close()
    assert until(lambda: server.stats().get("pulls_served") == 3), server.stats()
    assert until(lambda: server.get_finished() is not None and server.num_published_blocks == 0)
