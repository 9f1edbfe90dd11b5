"""The decode's KV connector recomputes a prompt on transfer errors only: any other exception is a
bug, and surfaces instead of hiding behind a slower answer that is still right."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from engine.kv_connector import KVConnectorMetadata, KVLoad
from kvtransfer import KVHandle
from kvtransfer.connector import TransferEvents
from kvtransfer.errors import AuthError, LeaseExpired, PeerLost
from services.decode.kv_connector import DecodeConnectorScheduler, DecodeConnectorWorker

HANDLE = KVHandle(request_id="r", engine_id="prefill-0", transport="tcp", endpoint="tcp://127.0.0.1:1",
                  block_ids=(0, 1), num_tokens=20, layout_fingerprint="f", lease_expiry=time.time() + 30).to_bytes()
REQUEST = SimpleNamespace(request_id="r", remote_kv=HANDLE, num_prompt_tokens=20)
LOAD = KVConnectorMetadata(loads=[KVLoad("r", HANDLE, [3, 4], 0)])


class FailingLink:
    """A transport link (and its connector) whose handle check and pulls raise `error`."""

    block_size = 16

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.connector = self

    def parse_handle(self, data: bytes):
        raise self.error

    def start_pull(self, *args) -> None:
        raise self.error

    def get_finished(self) -> TransferEvents:
        return TransferEvents()


@pytest.mark.parametrize("error", [AuthError("tag does not verify"), LeaseExpired("gone"), PeerLost("reset")])
def test_a_transfer_error_means_recompute(error):
    scheduler = DecodeConnectorScheduler(FailingLink(error))
    scheduler.add_request(REQUEST)
    assert scheduler.stats()["kv_recomputed_fallbacks"] == 1
    assert scheduler.get_num_new_matched_tokens(REQUEST, 0) == 0  # nothing to load: computed here
    worker = DecodeConnectorWorker(FailingLink(error))
    worker.start_load_kv(LOAD)
    assert list(worker.get_finished().failed_recving) == ["r"]  # the scheduler recomputes it


@pytest.mark.parametrize("error", [ValueError("a bug"), IndexError("a bug"), RuntimeError("a bug")])
def test_any_other_error_surfaces(error):
    with pytest.raises(type(error)):
        DecodeConnectorScheduler(FailingLink(error)).add_request(REQUEST)
    with pytest.raises(type(error)):
        DecodeConnectorWorker(FailingLink(error)).start_load_kv(LOAD)
