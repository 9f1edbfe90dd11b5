"""Two engines, one prefill and one decode, joined by a real KV connector: same tokens as one."""
from __future__ import annotations

import asyncio
import random

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from services.common.kv_connector import KVConnectorConfig
from services.common.role import Role

SECRET = b"test-secret"


async def disaggregated(prefill: AsyncEngine, decode: AsyncEngine, prompt, params: SamplingParams):
    first = None
    async for out in prefill.generate(prompt, params, prefill_only=True, publish_kv=True):
        first = out
    assert first.finished and first.outputs[0].finish_reason is None and first.kv_handle
    first_token = first.outputs[0].token_ids[0]
    tokens = [first_token]
    async for out in decode.generate(prompt, params, remote_kv=first.kv_handle, first_token_id=first_token):
        tokens += out.delta_token_ids
    return tokens


async def transfers_settled(prefill_core) -> None:
    """Wait (up to 3 s) until the prefill core's published KV has been pulled or released: the
    releases cross threads and sockets."""
    for _ in range(300):
        if not prefill_core.scheduler.has_pending_transfers():
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("transport,kv_cache_dtype", [("tcp", "auto"), ("shm", "auto"), ("tcp", "fp8"),
                                                    ("shm", "fp8_e5m2")])
def test_disaggregated_engines_match_colocated(tiny_llama, transport, kv_cache_dtype):
    """An fp8 cache too: its blocks move as stored, so the decode reads what a colocated engine
    with the same cache would (the same tokens, to the last)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (3, 16, 17, 40, 120)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in LLM(tiny_llama, kv_cache_dtype=kv_cache_dtype).generate(prompts, params)]

    async def main():
        prefill = await AsyncEngine.create(
            tiny_llama, detokenize=False, max_num_batched_tokens=32, kv_cache_dtype=kv_cache_dtype,  # chunked
            kv_connector_factory=KVConnectorConfig(transport, Role.PREFILL, SECRET, "prefill-0"))
        decode = await AsyncEngine.create(
            tiny_llama, detokenize=False, kv_cache_dtype=kv_cache_dtype,
            kv_connector_factory=KVConnectorConfig(transport, Role.DECODE, SECRET, "decode-0"))
        try:
            got = await asyncio.gather(*(disaggregated(prefill, decode, p, params) for p in prompts))
            assert got == expected
            # Repeat: the decode side now has the prompts' full blocks in its prefix cache.
            got = await asyncio.gather(*(disaggregated(prefill, decode, p, params) for p in prompts))
            assert got == expected
            pcore, dcore = prefill.client.core, decode.client.core
            await transfers_settled(pcore)
            assert pcore.scheduler.num_held_blocks == 0
            stats = dcore.stats()
            # One transfer per request; a prompt whose blocks are all cached here (16 tokens, the
            # second time) gives the remote ones back unread instead.
            assert stats["kv_pulls_finished"] == stats["kv_pulls_started"]
            assert stats["kv_pulls_finished"] + stats.get("kv_released_unpulled", 0) == 2 * len(prompts)
            assert stats.get("kv_recomputed_fallbacks", 0) == 0
            pcore.check_integrity(expect_all_free=True)
            dcore.check_integrity(expect_all_free=True)
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    asyncio.run(main())


def test_bad_handle_falls_back_to_recompute(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = list(range(40, 90))
    expected = LLM(tiny_llama).generate([prompt], params)[0].outputs[0].token_ids

    async def main():
        prefill = await AsyncEngine.create(
            tiny_llama, detokenize=False,
            kv_connector_factory=KVConnectorConfig("tcp", Role.PREFILL, b"another-secret", "p"))
        decode = await AsyncEngine.create(
            tiny_llama, detokenize=False, kv_connector_factory=KVConnectorConfig("tcp", Role.DECODE, SECRET, "d"))
        try:
            assert await disaggregated(prefill, decode, prompt, params) == expected
            assert decode.client.core.stats()["kv_recomputed_fallbacks"] == 1
            decode.client.core.check_integrity(expect_all_free=True)
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    asyncio.run(main())
