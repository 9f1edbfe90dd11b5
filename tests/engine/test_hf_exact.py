"""Greedy outputs are token-exact against transformers, in every engine configuration."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

MAX_NEW = 20
VARIANTS = {
    "llama": dict(arch="llama"),
    "llama3-rope-scaling": dict(arch="llama", rope_scaling={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(arch="mistral"),
    # Sliding windows: Mistral's on every layer (48 keys: prompts and prefix hits pass it); Qwen2's
    # from max_window_layers on; Phi-3's with its fused projections.
    "mistral-sliding-window": dict(arch="mistral", config={"sliding_window": 48}),
    "qwen2-sliding-window-layer-1": dict(arch="qwen2", config={"use_sliding_window": True, "sliding_window": 40,
                                                              "max_window_layers": 1}),
    "phi3-sliding-window": dict(arch="phi3", config={"sliding_window": 33}),
    "qwen2-tied": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3"),
    # Gemma: 1 + weight norms (random weights), the sqrt(hidden) normalizer, GELU (tanh), tied embeddings.
    "gemma": dict(arch="gemma"),
    # Gemma 2: soft-capped scores and logits, a 40-key window on every other layer, sandwich norms,
    # query_pre_attn_scalar; Gemma 3: q / k norms, its sliding layers' own rotary table (and linear
    # scaling on the full ones).
    "gemma2": dict(arch="gemma2", config={"sliding_window": 40, "attn_logit_softcapping": 5.0,
                                          "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 24}),
    "gemma3": dict(arch="gemma3_text", config={"sliding_window": 40, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    # Phi-3's fused projections, with Phi-4-mini's partial rotary embedding; Granite's multipliers.
    "phi3-partial-rotary": dict(arch="phi3", config={"partial_rotary_factor": 0.75}),
    "granite": dict(arch="granite"),
    # SmolLM3's layer without a rotary embedding; Seed-OSS's q/k/v biases (random), o_proj without one.
    "smollm3-nope": dict(arch="smollm3", config={"no_rope_layers": [1, 0]}),
    "seed-oss": dict(arch="seed_oss"),
    # OLMo 2: q and k normalised over all heads at once, each sublayer's output normalised.
    "olmo2": dict(arch="olmo2"),
    # OLMo 3: OLMo 2's layers, a 40-key window on the first, YaRN on the full-attention one only.
    "olmo3": dict(arch="olmo3", config={
        "sliding_window": 40, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0,
                                               "original_max_position_embeddings": 256},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}}),
    # EXAONE 4: per-head q / k norms, each sublayer's output normalised; a 40-key window on the
    # first layer, the full-attention second one without a rotary embedding.
    "exaone4": dict(arch="exaone4", config={"sliding_window": 40, "sliding_window_pattern": 2}),
    # GLM: dims 2i and 2i + 1 rotated as a pair over half of each head, a fused gate_up_proj, q/k/v
    # biases (random); GLM-4: four norms a layer (random weights), by its own names.
    "glm": dict(arch="glm"),
    "glm4": dict(arch="glm4"),
    # Ministral: Mistral's layers with windows by layer_types; Helium and ERNIE 4.5: the interleaved
    # rotary over whole heads (Helium's q/k/v and MLP biases, its norms scaled in float32; ERNIE's
    # biases on every projection and tied embeddings).
    "ministral": dict(arch="ministral", config={"sliding_window": 40,
                                                "layer_types": ["sliding_attention", "full_attention"]}),
    "helium": dict(arch="helium", config={"attention_bias": True, "mlp_bias": True}),
    "ernie4_5": dict(arch="ernie4_5", tie_word_embeddings=True, config={"use_bias": True}),
    # Cohere: LayerNorms, attention and the MLP in parallel off one norm, the interleaved rotary,
    # biases on every attention projection; Command R+'s q / k norms with a weight per head;
    # Command R7B's: a window on the first layer, the full second one without a rotary embedding.
    "cohere": dict(arch="cohere", config={"attention_bias": True}),
    "cohere-qk-norm": dict(arch="cohere", config={"use_qk_norm": True}),
    "cohere2": dict(arch="cohere2", config={"sliding_window": 40,
                                            "layer_types": ["sliding_attention", "full_attention"]}),
    # HunYuan: per-head q / k norms on the rotated q and k (by its own names), the NTK-alpha rotary
    # its checkpoints label "dynamic", tied embeddings.
    "hunyuan": dict(arch="hunyuan_v1_dense", tie_word_embeddings=True, rope_scaling={
        "rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}),
    # Plain MLPs (no gate): Arcee's ReLU^2 with biases; Nemotron's ReLU^2, LayerNorms with biases by
    # 1 + weight, half of each head rotated; StarCoder 2's GELU (tanh), LayerNorms with biases, biases
    # on every projection under its own MLP names (c_fc, c_proj), a 40-key window.
    "arcee": dict(arch="arcee", config={"mlp_bias": True}),
    "nemotron": dict(arch="nemotron", config={"attention_bias": True, "mlp_bias": True}),
    "starcoder2": dict(arch="starcoder2", config={"sliding_window": 40}),
    # Apertus: the xIELU activation with its learned parameters a layer (random), per-head q / k norms,
    # its norms under their own names, Llama 3's rotary scaling.
    "apertus": dict(arch="apertus", config={"attention_bias": True}, rope_scaling={
        "rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # StableLM: LayerNorms with biases, a quarter of each head rotated, q/k/v biases; its parallel
    # residual. Phi (2, 1.5): parallel layers summing their two outputs first, a plain GELU MLP, biases
    # on every projection and on the LM head, its own names (dense, fc1, fc2, final_layernorm).
    "stablelm": dict(arch="stablelm", config={"use_qkv_bias": True}),
    "stablelm-parallel": dict(arch="stablelm", config={"use_parallel_residual": True}),
    "phi": dict(arch="phi"),
    # GPT-NeoX (Pythia): each head's q, k and v rows fused in turn (query_key_value), its parallel
    # residual with a norm for each branch, or sequential; a quarter of each head rotated.
    "gpt-neox": dict(arch="gpt_neox", num_kv_heads=4),
    "gpt-neox-sequential": dict(arch="gpt_neox", num_kv_heads=4, config={"use_parallel_residual": False}),
    # Mixtures of experts: Mixtral's renormalised top 2 of 8, Qwen2-MoE's shared expert, Qwen3-MoE
    # with a dense layer between sparse ones.
    "mixtral": dict(arch="mixtral"),
    "qwen2-moe": dict(arch="qwen2_moe"),
    "qwen3-moe": dict(arch="qwen3_moe", moe_config={"norm_topk_prob": True, "mlp_only_layers": [1]}),
    # Granite-MoE: stacked experts under its own names, the softmax of the top k logits, Granite's multipliers.
    "granite-moe": dict(arch="granitemoe"),
    # OLMoE: full-width q / k norms, then q, k and v clamped; the top 8 of 8 experts renormalised.
    "olmoe-clip": dict(arch="olmoe", moe_config={"clip_qkv": 0.5, "norm_topk_prob": True}),
}
CONFIGS = {
    "plain": dict(),
    "chunked-prefill": dict(max_num_batched_tokens=48),
    "preemption": dict(num_blocks=23),
}


def mixed_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in (1, 5, 16, 17, 40, 129, 250, 321)]


def shared_prefix_prompts(vocab_size: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(200)]
    return [prefix + [rng.randrange(vocab_size) for _ in range(n)] for n in (1, 3, 16, 30, 47, 64, 90, 110)]


class Reference:
    """transformers' own greedy generate on the same checkpoint, one prompt at a time; as
    ignore_eos, it runs on past an end-of-sequence token rather than suppressing one."""

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.eos_token_id = self.model.generation_config.eos_token_id
        self.model.generation_config.eos_token_id = None
        self.cache: dict[tuple, list[int]] = {}  # the reference's greedy tokens, computed on the CPU

    def generate(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self.cache:
            ids = torch.tensor([prompt])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=MAX_NEW, pad_token_id=self.eos_token_id)
            self.cache[key] = out[0, len(prompt):].tolist()
        return self.cache[key]


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tiny_model_factory):
    path = tiny_model_factory(max_position_embeddings=1024, **VARIANTS[request.param])
    return path, Reference(path)


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_transformers(variant, config, device):
    path, ref = variant
    llm = LLM(path, device=device, **CONFIGS[config])
    prompts = mixed_prompts(ref.model.config.vocab_size)
    expected = [ref.generate(p) for p in prompts]
    assert run(llm, prompts) == expected
    if config == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0, "the tiny KV pool should force preemption"
    if config == "chunked-prefill":
        assert llm.config.scheduler.max_num_batched_tokens < max(len(p) for p in prompts)
    llm.engine.check_integrity(expect_all_free=True)


def test_prefix_cache_hits_are_exact(variant, device):
    path, ref = variant
    llm = LLM(path, device=device, max_num_batched_tokens=256)
    prompts = shared_prefix_prompts(ref.model.config.vocab_size)
    expected = [ref.generate(p) for p in prompts]
    assert run(llm, prompts) == expected
    first_hits = llm.engine.kv_cache_manager.prefix_hits
    assert first_hits > 0, "later prompts share a 200-token prefix with earlier ones"
    # Second pass: every full block of every prompt is already cached.
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for prompt, out in zip(prompts, outputs):
        assert out.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    llm.engine.check_integrity(expect_all_free=True)


# Greedy answers cannot see a positive scale or a soft cap on the logits; the distribution does.
SCALED_LOGITS = {
    "granite": dict(arch="granite"),  # divided by logits_scaling
    "gemma2": dict(arch="gemma2", config={"final_logit_softcapping": 3.0}),  # soft-capped
    "cohere": dict(arch="cohere", config={"logit_scale": 0.25}),  # multiplied by logit_scale
}


@pytest.mark.parametrize("name", list(SCALED_LOGITS))
def test_prompt_logprobs_match_transformers_where_logits_are_scaled(name, tiny_model_factory):
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(max_position_embeddings=1024, **SCALED_LOGITS[name])
    prompt = list(range(5, 45))
    out = LLM(path).generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    got = [entry[token] for entry, token in zip(out.prompt_logprobs, prompt[1:])]
    assert got == pytest.approx([float(ref[i, t]) for i, t in enumerate(prompt[1:])], abs=1e-4)
