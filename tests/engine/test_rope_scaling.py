"""Rotary scalings beyond Llama 3's: YaRN (Qwen's long-context form), Phi-3's LongRoPE (short and
long factors, the table picked by the served context as vLLM picks it) and a partial rotary
dimension; greedy outputs token-exact against transformers."""
from __future__ import annotations

import random

import pytest

from engine import LLM
from engine.models.llama import FAMILIES
from engine.models.rope import rope_parameters, uses_long_factors
from test_hf_exact import Reference, run

# A head of 16 (64 wide, 4 heads): LongRoPE's factors are one per rotated pair of dimensions.
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.7 * i for i in range(8)]}


def prompts(vocab_size: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def test_yarn_is_token_exact(tiny_model_factory):
    path = tiny_model_factory("qwen3", max_position_embeddings=1024, config={"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256}})
    ref = Reference(path)
    batch = prompts(ref.model.config.vocab_size, (1, 17, 129, 300))
    assert run(LLM(path, max_num_batched_tokens=64), batch) == [ref.generate(p) for p in batch]


def test_longrope_within_the_pretraining_context_uses_the_short_factors(tiny_model_factory):
    """--max-model-len within original_max_position_embeddings: no sequence passes it, and the
    short factors (with the attention factor of the extended context) are transformers' choice too."""
    path = tiny_model_factory("phi3", max_position_embeddings=1024,
                              config={"original_max_position_embeddings": 256, "rope_parameters": LONGROPE})
    ref = Reference(path)
    batch = prompts(ref.model.config.vocab_size, (1, 40, 129, 200))
    llm = LLM(path, max_model_len=256)
    assert not uses_long_factors(llm.engine.runner.model.arch.rope, 256)
    assert run(llm, batch) == [ref.generate(p) for p in batch]


def test_longrope_past_the_pretraining_context_uses_the_long_factors(tiny_model_factory):
    """A served context past original_max_position_embeddings: the long factors for every position
    (vLLM's rule); transformers agrees for every sequence longer than the pretraining context."""
    path = tiny_model_factory("phi3", max_position_embeddings=1024,
                              config={"original_max_position_embeddings": 64, "rope_parameters": LONGROPE})
    ref = Reference(path)
    batch = prompts(ref.model.config.vocab_size, (65, 100, 257))
    llm = LLM(path, max_num_batched_tokens=96)
    assert uses_long_factors(llm.engine.runner.model.arch.rope, llm.engine.max_model_len)
    assert run(llm, batch) == [ref.generate(p) for p in batch]


def test_phi3s_first_longrope_name_and_its_top_level_pretraining_context_are_read():
    params = rope_parameters({"rope_theta": 10000.0, "max_position_embeddings": 131072,
                              "original_max_position_embeddings": 4096,
                              "rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}})
    assert params["rope_type"] == "longrope" and params["original_max_position_embeddings"] == 4096
    assert uses_long_factors(params, 131072) and not uses_long_factors(params, 4096)


def test_an_unsupported_rope_type_is_named_at_load(tiny_model_factory):
    path = tiny_model_factory("llama", config={"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                    "factor": 2.0}})
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'.*yarn, longrope"):
        LLM(path)


def test_gemma3s_published_config_form_is_read():
    """Gemma 3's config.json as published (transformers 4.x): rope_theta with rope_scaling for the
    full-attention layers, rope_local_base_freq for the sliding ones, every sixth layer full."""
    from engine.models.llama import LlamaArch

    arch = LlamaArch.from_hf_config({
        "model_type": "gemma3_text", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
        "max_position_embeddings": 32768, "sliding_window": 512, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": 50.0})  # (carried by some configs; transformers does not apply it to Gemma 3)
    assert arch.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(12))
    assert arch.local_rope_layers == tuple(i for i in range(12) if (i + 1) % 6)
    assert (arch.rope["rope_type"], arch.rope["factor"], arch.rope["rope_theta"]) == ("linear", 8.0, 1000000.0)
    assert (arch.rope_local["rope_type"], arch.rope_local["rope_theta"]) == ("default", 10000.0)
    assert arch.attention_multiplier == 256 ** -0.5 and arch.hidden_act == "gelu_pytorch_tanh"
    assert arch.norm_offset == 1.0 and arch.qk_norm and arch.layer_norms == "sandwich" and arch.tie_word_embeddings
    assert arch.attn_softcap == 0.0


def test_olmo3s_published_long_context_config_scales_its_full_layers_only():
    """OLMo 3's 32k config (transformers 4.x form): rope_scaling (YaRN) for the full-attention layers,
    the sliding ones plain at the same theta; three sliding layers to a full one without layer_types."""
    from engine.models.llama import LlamaArch

    arch = LlamaArch.from_hf_config({
        "model_type": "olmo3", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 65536, "sliding_window": 4096, "rope_theta": 500000,
        "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                         "attention_factor": 1.2079, "beta_fast": 32, "beta_slow": 1}})
    assert arch.layer_windows == tuple(0 if (i + 1) % 4 == 0 else 4096 for i in range(8))
    assert (arch.rope["rope_type"], arch.rope["factor"], arch.rope["rope_theta"]) == ("yarn", 8.0, 500000)
    assert (arch.rope_local["rope_type"], arch.rope_local["rope_theta"]) == ("default", 500000)
    assert arch.local_rope_layers == tuple(i for i in range(8) if (i + 1) % 4)
    assert arch.qk_norm_full and arch.layer_norms == "post" and arch.norm_in_float32


def test_exaones_pattern_string_and_its_global_layers_without_rotary():
    """EXAONE 4's own pattern form ("LLLG") without layer_types; its global layers take no rotary
    embedding while the model has a window, and every layer does without one."""
    from engine.models.llama import LlamaArch

    base = {"model_type": "exaone4", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 32768, "sliding_window_pattern": "LLLG"}
    arch = LlamaArch.from_hf_config({**base, "sliding_window": 4096})
    assert arch.layer_windows == (4096, 4096, 4096, 0) * 2 and arch.nope_layers == (3, 7)
    assert arch.qk_norm and not arch.qk_norm_full and arch.layer_norms == "post"
    whole = LlamaArch.from_hf_config({**base, "sliding_window": None, "layer_types": ["full_attention"] * 8})
    assert whole.layer_windows == (0,) * 8 and whole.nope_layers == ()


@pytest.mark.parametrize("model_type, share", [("nemotron", 0.5), ("phi", 0.5), ("stablelm", 0.25), ("glm4", 0.5),
                                               ("llama", 1.0)])
def test_a_config_without_partial_rotary_factor_takes_its_familys_default(model_type, share):
    """Published configs that leave partial_rotary_factor out rotate what transformers rotates for them."""
    params = rope_parameters({"model_type": model_type, "rope_theta": 10000.0})
    assert params["partial_rotary_factor"] == share
    assert rope_parameters({"model_type": model_type, "partial_rotary_factor": 0.75})["partial_rotary_factor"] == 0.75


def test_gpt_neoxs_published_names_and_rotary_keys_are_read():
    """Pythia's config.json (rotary_pct, rotary_emb_base) and checkpoint names, its older checkpoints'
    causal-mask buffers left unread."""
    from engine.models.llama import LlamaArch
    from engine.models.loader import canonical_name

    arch = LlamaArch.from_hf_config({
        "model_type": "gpt_neox", "vocab_size": 50304, "hidden_size": 512, "intermediate_size": 2048,
        "num_hidden_layers": 6, "num_attention_heads": 8, "rotary_pct": 0.25, "rotary_emb_base": 10000,
        "max_position_embeddings": 2048, "layer_norm_eps": 1e-5, "use_parallel_residual": True, "hidden_act": "gelu"})
    assert arch.rope["partial_rotary_factor"] == 0.25 and arch.rope["rope_theta"] == 10000
    assert arch.layer_norms == "parallel_two_norms" and not arch.gated_mlp and arch.qkv_bias and arch.o_bias
    assert canonical_name("gpt_neox.layers.3.attention.query_key_value.weight") == \
        "model.layers.3.self_attn.query_key_value.weight"
    assert canonical_name("gpt_neox.layers.3.mlp.dense_4h_to_h.bias") == "model.layers.3.mlp.down_proj.bias"
    assert canonical_name("gpt_neox.final_layer_norm.weight") == "model.norm.weight"
    assert canonical_name("gpt_neox.embed_in.weight") == "model.embed_tokens.weight"
    assert canonical_name("embed_out.weight") == "lm_head.weight"
    assert canonical_name("gpt_neox.layers.0.attention.masked_bias") is None
    assert canonical_name("gpt_neox.layers.0.attention.bias") is None
    assert canonical_name("model.layers.0.self_attn.q_proj.bias") == "model.layers.0.self_attn.q_proj.bias"


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_what_a_config_leaves_out_is_transformers_default(model_type):
    """A config.json naming only the sizes reads as transformers' config class fills it in: the norm's
    eps, tied embeddings, the window and the attention bias."""
    from transformers import AutoConfig

    from engine.models.llama import LlamaArch

    sizes = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 65536}
    hf = AutoConfig.for_model(model_type, **sizes).to_dict()
    family = FAMILIES[model_type]
    arch = LlamaArch.from_hf_config({"model_type": model_type, **sizes})
    assert arch.rms_norm_eps == hf[family.eps_key]
    if "tie_word_embeddings" in hf:  # (a vision-language text config leaves it to the outer one)
        assert arch.tie_word_embeddings == hf["tie_word_embeddings"]
    if not family.window_opt_in and "sliding_window" in hf:
        assert arch.sliding_window == hf["sliding_window"]
    if model_type in ("llama", "granite", "seed_oss", "glm", "glm4", "gemma", "olmo2", "helium", "arcee", "apertus"):
        assert arch.qkv_bias == hf["attention_bias"]


def test_every_served_architecture_has_a_family():
    from engine.models.llama import FAMILIES, LlamaArch
    from engine.models.loader import SUPPORTED_ARCHITECTURES

    assert {t for t in SUPPORTED_ARCHITECTURES.values() if t is not None} == set(FAMILIES)
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        LlamaArch.from_hf_config({"model_type": "gpt2", "num_attention_heads": 4})
    with pytest.raises(ValueError, match="phi: qk_layernorm .* is not served"):
        LlamaArch.from_hf_config({"model_type": "phi", "num_attention_heads": 4, "hidden_act": "gelu_new",
                                  "qk_layernorm": True})


def test_yarn_extends_the_served_context_by_its_factor():
    """Qwen2.5's long-context recipe: max_position_embeddings 32768, YaRN x4 over it (vLLM's limit)."""
    from engine.models.loader import resolve_max_model_len

    config = {"model_type": "qwen2", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 32768,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert resolve_max_model_len(config, None) == 131072
    with pytest.raises(ValueError, match="exceeds the model's limit of 131072"):
        resolve_max_model_len(config, 131073)
    assert resolve_max_model_len({**config, "rope_scaling": None}, None) == 32768
