"""A mixture of experts (Qwen3-MoE) through a real disaggregated stack: the prefill computes the
prompt's KV through its experts, the decode continues over the pulled blocks (tcp); greedy
completions token-exact against the offline engine, itself token-exact against transformers
(tests/engine/test_hf_exact.py)."""
from __future__ import annotations

import pytest

from service_procs import poll_until
from stack import PARITY_PROMPTS, PARITY_TOKENS, SERVED_MODEL, serving_as_offline

pytestmark = pytest.mark.e2e


def test_a_mixture_of_experts_serves_through_prefill_and_decode(tiny_model_factory):
    model = tiny_model_factory("qwen3_moe", max_position_embeddings=512, moe_config={"norm_topk_prob": True})
    with serving_as_offline(model) as (stack, client, want):
        stream = client.completions.create(model=SERVED_MODEL, prompt=PARITY_PROMPTS[1], max_tokens=PARITY_TOKENS,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
        streamed = [t for chunk in stream for t in (chunk.choices[0].model_extra.get("token_ids") or [])]
        assert streamed == want[1]
        assert poll_until(lambda: stack.decodes[0].metric("pdserve:kv_transfers_total") >= len(PARITY_PROMPTS) + 1, 10)
