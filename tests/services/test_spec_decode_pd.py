"""Speculative decoding on a decode instance after its KV pull: the same greedy tokens as one
engine without speculation, with proposals accepted (a draft model computes the prompt's KV in its
own cache: the pulled blocks hold the target's only), and no KV left behind on either side."""
from __future__ import annotations

import asyncio
import random

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from services.common.kv_connector import KVConnectorConfig
from services.common.role import Role
from test_disagg_engine import SECRET, disaggregated, transfers_settled  # one prefill then one decode, as the router does


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_decode_speculates_after_its_pull(tiny_llama, method):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(4)] * 5, [rng.randrange(3, 500) for _ in range(30)],
               [7, 8, 9] * 8 + [10]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(tiny_llama).generate(prompts, params)]
    spec = ({"method": "ngram", "num_speculative_tokens": 3} if method == "ngram"
            else {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3})

    async def main():
        prefill = await AsyncEngine.create(
            tiny_llama, detokenize=False, block_size=4,
            kv_connector_factory=KVConnectorConfig("tcp", Role.PREFILL, SECRET, "p-0"))
        decode = await AsyncEngine.create(
            tiny_llama, detokenize=False, speculative_config=spec, block_size=4,
            kv_connector_factory=KVConnectorConfig("tcp", Role.DECODE, SECRET, "d-0"))
        try:
            got = await asyncio.gather(*(disaggregated(prefill, decode, p, params) for p in prompts))
            assert got == expected
            pcore, dcore = prefill.client.core, decode.client.core
            stats = dcore.stats()
            assert stats["kv_pulls_finished"] == len(prompts) and stats.get("kv_recomputed_fallbacks", 0) == 0
            assert stats["spec_decode_num_drafts"] > 0
            if method == "draft_model":  # the draft is the target, its prompt KV computed in its own cache
                assert stats["spec_decode_acceptance_rate"] == 1.0
            await transfers_settled(pcore)
            pcore.check_integrity(expect_all_free=True)
            dcore.check_integrity(expect_all_free=True)
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    asyncio.run(main())
