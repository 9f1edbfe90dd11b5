"""Fixtures: a prefill connector in a spawned process per transport, decode connectors here."""
from __future__ import annotations

import pytest
import torch

from kvtransfer import TRANSPORTS, KVLayout, create_connector

from kv_peers import DECODE_BLOCKS, LAYOUTS, PREFILL_BLOCKS, SECRET, PrefillPeer


@pytest.fixture(scope="module", params=TRANSPORTS)
def prefill(request):
    """One child process per transport, holding one prefill connector per layout."""
    peer = PrefillPeer(request.param)
    peer.endpoints = {key: peer.open(key, kwargs, PREFILL_BLOCKS, seed=i + 1)
                      for i, (key, kwargs) in enumerate(LAYOUTS.items())}
    peer.seeds = {key: i + 1 for i, key in enumerate(LAYOUTS)}
    yield peer
    peer.close()


@pytest.fixture
def make_decode():
    """make_decode(transport, layout_key or KVLayout kwargs, secret=...) -> (connector, caches)."""
    made = []

    def make(transport: str, layout: str | dict, num_blocks: int = DECODE_BLOCKS, secret: bytes = SECRET, **kw):
        kwargs = LAYOUTS[layout] if isinstance(layout, str) else layout
        connector = create_connector(transport, "decode", KVLayout(**kwargs), secret=secret,
                                     engine_id="decode-test", timeout_s=kw.pop("timeout_s", 20.0), **kw)
        made.append(connector)
        caches = connector.worker.allocate_kv_caches(num_blocks)
        for cache in caches:  # a known pattern, to show which blocks a pull touched
            cache.reshape(-1).view(torch.uint8).fill_(0xA5)
        return connector, caches

    yield make
    for connector in made:
        connector.close()
