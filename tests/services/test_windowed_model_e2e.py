"""A model with sliding-window layers and soft-capped scores (Gemma 2) through a real disaggregated
stack: the prefill computes the prompt's KV (a prompt longer than the window), the decode continues
over the pulled blocks with each windowed layer seeing its last keys only; greedy completions
token-exact against the offline engine, itself token-exact against transformers
(tests/engine/test_hf_exact.py)."""
from __future__ import annotations

import openai
import pytest

from engine import LLM, SamplingParams
from service_procs import poll_until
from stack import SERVED_MODEL, Stack, StackSpec

pytestmark = pytest.mark.e2e

PROMPTS = [[17, 230, 41, 99, 5, 300, 41, 99, 12, 400, 73], list(range(40, 90))]
MAX_TOKENS = 12


def test_a_windowed_soft_capped_model_serves_through_prefill_and_decode(tiny_model_factory):
    model = tiny_model_factory("gemma2", max_position_embeddings=512,
                               config={"sliding_window": 24, "attn_logit_softcapping": 5.0,
                                       "final_logit_softcapping": 3.0})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model).generate(PROMPTS, params)]
    with Stack(model, StackSpec()) as stack, \
            openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        for prompt, tokens in zip(PROMPTS, want):
            out = client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            assert out.choices[0].model_extra["token_ids"] == tokens
        assert poll_until(lambda: stack.decodes[0].metric("pdserve:kv_transfers_total") >= len(PROMPTS), 10)
