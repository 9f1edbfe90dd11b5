"""The decode keeps a prefill's lease alive while a request waits for room (in-process engines)."""
from __future__ import annotations

import asyncio
import time

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from kvtransfer import KVHandle
from services.common.kv_connector import KVConnectorConfig
from services.common.role import Role

SECRET = b"lease-test-secret"
LEASE_TTL_S = 1.0


def test_a_request_waiting_for_room_keeps_its_remote_kv(tiny_model_factory):
    model = tiny_model_factory("llama", max_position_embeddings=32768)  # room for a long hog
    # The decode has a seat for one request. A long request holds it until the second one's lease
    # (1 s) is well past its first expiry: that KV is still there only if the decode extended it.
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = list(range(200, 240))
    expected = LLM(model).generate([prompt], params)[0].outputs[0].token_ids

    async def main():
        prefill = await AsyncEngine.create(model, detokenize=False, kv_connector_factory=KVConnectorConfig(
            "tcp", Role.PREFILL, SECRET, "p", lease_ttl_s=LEASE_TTL_S))
        decode = await AsyncEngine.create(model, detokenize=False, max_num_seqs=1,
                                          kv_connector_factory=KVConnectorConfig("tcp", Role.DECODE, SECRET, "d"))
        try:
            hog = decode.generate([1, 2, 3], SamplingParams(max_tokens=32000, ignore_eos=True))
            await hog.__anext__()  # it holds the only seat
            first = None
            async for out in prefill.generate(prompt, params, prefill_only=True, publish_kv=True):
                first = out
            tokens = list(first.outputs[0].token_ids)
            waiting = decode.generate(prompt, params, remote_kv=first.kv_handle, first_token_id=tokens[0])
            pending = asyncio.ensure_future(waiting.__anext__())
            expiry = KVHandle.from_bytes(first.kv_handle).lease_expiry
            await asyncio.sleep(expiry + 1.0 - time.time())  # the time under test: past the first expiry
            assert not pending.done()  # still waiting for the seat
            await hog.aclose()  # frees the seat
            tokens += (await pending).delta_token_ids
            async for out in waiting:
                tokens += out.delta_token_ids
            assert tokens == expected
            stats = decode.client.core.stats()
            assert stats["kv_lease_extensions"] >= 1
            assert stats["kv_pulls_finished"] == 1 and stats.get("kv_recomputed_fallbacks", 0) == 0
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    asyncio.run(main())
