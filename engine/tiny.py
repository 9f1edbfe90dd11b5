"""Tiny random Hugging Face checkpoints with a real tokenizer, made offline with transformers."""
from __future__ import annotations

import os
import random
import shutil
import tempfile

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "granite", "smollm3",
         "seed_oss", "olmo2", "olmo3", "exaone4", "glm", "glm4", "ministral", "helium",
         "ernie4_5", "cohere", "cohere2", "hunyuan_v1_dense", "arcee",
         "nemotron", "starcoder2", "apertus", "stablelm", "phi", "gpt_neox",
         "mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "olmoe")
# Granite 3's multipliers (ibm-granite/granite-3.0-2b-instruct's config), so that a tiny Granite
# exercises each of them.
GRANITE_MULTIPLIERS = dict(embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22,
                           logits_scaling=8.0)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

_WORDS = """the of and to in is was that for on as with by he at from his an were are which this be
or has had not but one they their been have its new after who also two first all more other when
time years there into only would most some over during about out up can her she than school between
world city people may used under while such state three many then where later year team name known
both through these each before since part life made no him war several including music following
film series called national well area until being against season second however game members
university early we number any de house century them around high because played public four work
town family often what american best home like could even south north back so use own our way
village water light river stone tree green small large old young long short house garden window door
quick brown fox jumps over lazy dog red blue yellow sun moon star night day morning evening road
cat bird fish horse king queen castle ship sea island mountain forest field winter summer spring
autumn rain snow wind fire earth gold silver iron bread milk apple book letter word story song dance
""".split()


def synthetic_corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """English-like lines from a fixed word list: enough for a BPE to learn real merges."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", ".", "!", "?", ","]))
    lines += ["0 1 2 3 4 5 6 7 8 9 10 100 1000", "a b c d e f g h i j k l m n o p q r s t u v w x y z"]
    return lines


def train_tokenizer(vocab_size: int | None = None, seed: int = 0):
    """A byte-level BPE trained on the synthetic corpus. If vocab_size is more than the
    corpus supports, the vocabulary is filled up with added <extra_i> tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size or 2000, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(synthetic_corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    if vocab_size is not None and len(fast) < vocab_size:
        fast.add_tokens([f"<extra_{i}>" for i in range(vocab_size - len(fast))])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(path: str, arch: str = "llama", vocab_size: int | None = None,
                    hidden_size: int = 64, intermediate_size: int = 128, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
                    max_position_embeddings: int = 2048, tie_word_embeddings: bool = False,
                    initializer_range: float = 0.1, rope_scaling: dict | None = None,
                    num_experts: int = 8, num_experts_per_tok: int = 2, moe_intermediate_size: int = 64,
                    moe_config: dict | None = None, config: dict | None = None, seed: int = 0) -> str:
    """Write a random-weight checkpoint that transformers itself produced (save_pretrained).

    The mixtures of experts (mixtral, qwen2_moe, qwen3_moe, granitemoe, olmoe) take num_experts of
    moe_intermediate_size each (Mixtral's, Granite-MoE's and OLMoE's are intermediate_size),
    num_experts_per_tok per token; Qwen2-MoE's shared expert is intermediate_size; moe_config: more
    of the config's keys (norm_topk_prob, decoder_sparse_step, mlp_only_layers, ...). phi3 stores
    its attention and MLP projections fused (qkv_proj, gate_up_proj); granite and granitemoe take
    Granite 3's multipliers; smollm3 leaves every fourth layer without a rotary embedding (its
    default); seed_oss has random q/k/v biases; olmo2 normalises after each sublayer; gemma's norm
    weights are random (transformers starts them at zero: 1 + 0 would hide an offset not added). config: more of any architecture's config keys
    (partial_rotary_factor, original_max_position_embeddings, no_rope_layers, ...)."""
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    tokenizer = train_tokenizer(vocab_size, seed)
    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma",
             "gemma2": "Gemma2", "gemma3_text": "Gemma3Text", "phi3": "Phi3", "granite": "Granite",
             "smollm3": "SmolLM3", "seed_oss": "SeedOss", "olmo2": "Olmo2", "olmo3": "Olmo3", "exaone4": "Exaone4",
             "glm": "Glm", "glm4": "Glm4", "ministral": "Ministral", "helium": "Helium", "ernie4_5": "Ernie4_5",
             "cohere": "Cohere", "cohere2": "Cohere2", "hunyuan_v1_dense": "HunYuanDenseV1",
             "arcee": "Arcee", "nemotron": "Nemotron", "starcoder2": "Starcoder2",
             "apertus": "Apertus", "stablelm": "StableLm", "phi": "Phi",
             "gpt_neox": "GPTNeoX",
             "mixtral": "Mixtral",
             "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "granitemoe": "GraniteMoe", "olmoe": "Olmoe"}[arch]
    config_cls = getattr(transformers, f"{names}Config")
    model_cls = getattr(transformers, "Gemma3ForCausalLM" if arch == "gemma3_text" else f"{names}ForCausalLM")
    kwargs = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
                  tie_word_embeddings=tie_word_embeddings, initializer_range=initializer_range,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    elif arch in ("qwen3", "qwen3_moe", "seed_oss", "gemma", "gemma2", "gemma3_text", "glm", "glm4", "ernie4_5",
                  "ministral", "helium", "hunyuan_v1_dense", "nemotron"):
        kwargs["head_dim"] = hidden_size // num_heads
    if arch in ("mistral", "mixtral", "ministral"):
        kwargs["sliding_window"] = max_position_embeddings
    if arch in ("mixtral", "granitemoe"):
        kwargs.update(num_local_experts=num_experts, num_experts_per_tok=num_experts_per_tok)
    elif arch in ("qwen2_moe", "qwen3_moe"):
        kwargs.update(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                      moe_intermediate_size=moe_intermediate_size)
        if arch == "qwen2_moe":
            kwargs["shared_expert_intermediate_size"] = intermediate_size
    elif arch == "olmoe":
        kwargs.update(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok)
    if arch in ("granite", "granitemoe"):
        kwargs.update(GRANITE_MULTIPLIERS)
    kwargs.update(moe_config or {})
    kwargs.update(config or {})
    if rope_scaling is not None:
        kwargs["rope_parameters"] = rope_scaling
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    # transformers starts biases and Gemma's norm weights at zero and the others' at one: each made
    # random where that would hide one read wrong (GLM's: its q/k/v biases, its four norms a layer).
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") and arch in ("seed_oss", "gemma", "gemma2", "gemma3_text", "glm", "glm4",
                                                   "helium", "ernie4_5", "cohere", "cohere2", "nemotron", "arcee",
                                                   "starcoder2", "stablelm", "phi", "gpt_neox") or \
                    arch in ("gemma", "gemma2", "gemma3_text", "nemotron") and name.endswith("norm.weight"):
                param.normal_(0.0, 0.1)
            elif arch in ("glm", "glm4", "helium", "cohere", "cohere2", "hunyuan_v1_dense", "starcoder2", "stablelm",
                          "phi", "gpt_neox") and \
                    name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
            elif ".act_fn.alpha_" in name:  # Apertus's xIELU: its learned parameters, each layer its own
                param.add_(torch.randn_like(param) * 0.3)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def default_tiny_model() -> str:
    """The built-in `tiny` model, made once and cached under $PDSERVE_CACHE_DIR (~/.cache/pdserve)."""
    root = os.environ.get("PDSERVE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pdserve"))
    path = os.path.join(root, "tiny-llama-v1")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root, prefix=".tiny-")
    try:
        make_tiny_model(tmp, arch="llama", hidden_size=128, intermediate_size=344, num_layers=4,
                        num_heads=4, num_kv_heads=2)
        try:
            os.rename(tmp, path)  # atomic: concurrent makers race, one wins
        except OSError:
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
