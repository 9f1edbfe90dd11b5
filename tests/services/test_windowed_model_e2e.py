"""A model with sliding-window layers and soft-capped scores (Gemma 2) through a real disaggregated
stack: the prefill computes the prompt's KV (a prompt longer than the window), the decode continues
over the pulled blocks with each windowed layer seeing its last keys only; greedy completions
token-exact against the offline engine, itself token-exact against transformers
(tests/engine/test_hf_exact.py)."""
from __future__ import annotations

import pytest

from stack import PARITY_PROMPTS, serving_as_offline

pytestmark = pytest.mark.e2e


def test_a_windowed_soft_capped_model_serves_through_prefill_and_decode(tiny_model_factory):
    model = tiny_model_factory("gemma2", max_position_embeddings=512,
                               config={"sliding_window": 24, "attn_logit_softcapping": 5.0,
                                       "final_logit_softcapping": 3.0})
    assert max(len(p) for p in PARITY_PROMPTS) > 24  # a prompt past the window
    with serving_as_offline(model):  # token-exact through prefill and decode, over pulled KV: asserted there
        pass
