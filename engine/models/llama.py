"""The Llama family (Llama 2/3, Mistral, Ministral, Qwen2, Qwen3, Gemma 1-3, Phi-3, Granite, SmolLM3,
Seed-OSS, OLMo 2 and 3, EXAONE 4, GLM and GLM-4, Helium, ERNIE 4.5, Command R / R+ / R7B / A, HunYuan, and the
plain-MLP models Arcee, Nemotron and StarCoder 2, and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE,
Granite-MoE and OLMoE) over a paged KV cache;
what each model type fixes is one row of FAMILIES."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.models.moe import SparseMoE, moe_fields
from engine.models.rope import rope_parameters, rope_table
from kernels import KernelBackend, reference

# A gated MLP's activation -> (gate, up) -> act(gate) * up (silu: the backend's fused kernel).
ACTIVATIONS = {"silu": reference.silu_and_mul, "gelu_pytorch_tanh": reference.gelu_tanh_and_mul}
# A plain (non-gated) MLP's: up -> act(up), as transformers' ACT2FN computes each ("xielu": a
# module with learned parameters, XIELU).
PLAIN_ACTIVATIONS = {
    "relu2": lambda x: torch.square(torch.relu(x)),
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu": nn.functional.gelu,
    "silu": nn.functional.silu,
    # GPT-2's tanh form, written out as transformers' NewGELUActivation computes it (Phi)
    "gelu_new": lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))),
    "xielu": None,
}


class XIELU(nn.Module):
    """xIELU (Apertus): x > 0: softplus(alpha_p) x^2 + beta x; else (expm1(min(x, eps)) - x) *
    (beta + softplus(alpha_n)) + beta x; alpha_p and alpha_n learned per layer, beta and eps stored
    beside them (mlp.act_fn.*), as transformers' XIELUActivation computes it in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.beta = nn.Parameter(torch.tensor(0.5), requires_grad=False)
        self.eps = nn.Parameter(torch.tensor(-1e-6), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = nn.functional.softplus(self.alpha_p)
        alpha_n = self.beta + nn.functional.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)

if TYPE_CHECKING:
    from engine.parallel.group import TPGroup


@dataclass(frozen=True)
class Family:
    """What a model type fixes (FAMILIES); its config.json says the sizes and the rest."""
    qk_norm: str = ""  # "head": q and k normalised per head (Qwen3); "full": over all heads at once (OLMo 2)
    qk_norm_after_rope: bool = False  # (HunYuan) the per-head norms applied to the rotated q and k
    layer_norms: str = "pre"  # where a layer's norms sit: LAYER_NORMS' key (LlamaArch.layer_norms)
    # "rms": the kernels' RMS norm (the normalised x rounded before the weight: Llama's); "rms32":
    # scaled in float32 and rounded once (OLMo 2's, Helium's); "gemma": the same by 1 + weight;
    # "layer": Cohere's LayerNorm (the mean subtracted, no bias, in float32); "layer_bias": torch's
    # LayerNorm with a bias, in the model's dtype (StarCoder 2); "layer1p": the same by 1 + weight (Nemotron).
    norm: str = "rms"
    gated_mlp: bool = True  # act(gate) * up; else (Arcee, Nemotron, StarCoder 2) act(up) alone
    rope_interleaved: bool = False  # dims 2i and 2i + 1 rotated as a pair (GPT-J style), not i and half + i
    rope_by_layer_type: bool = False  # the sliding layers' own rotary parameters (_ropes_by_layer_type)
    window_opt_in: bool = False  # Qwen's: a window only where use_sliding_window says, from max_window_layers on
    # Without layer_types, which layers slide: every (i + 1) % n != 0 (n: the config's
    # sliding_window_pattern, else this); 0: every layer (where the config sets a window).
    sliding_pattern: int = 0
    pattern_key: bool = False  # the config's sliding_window_pattern overrides it (Gemma 3, Cohere 2, EXAONE 4)
    # transformers' defaults for keys a config.json may leave out, where they are not this reader's
    # (an RMS eps of 1e-6, no attention bias, no window)
    defaults: dict = field(default_factory=dict)
    full_layers_nope: bool = False  # with a window, the full-attention layers take no rotary embedding
    tied: bool = False  # tie_word_embeddings where the config leaves it out
    eps_key: str = "rms_norm_eps"
    lm_head_bias: bool = False  # (Phi) the LM head adds a bias to the logits


# Every model type served (engine.models.loader.SUPPORTED_ARCHITECTURES maps the architectures).
# Gemma's and Granite's multipliers, Gemma's soft caps and the MoE routing are read in code.
_EPS_1E5 = {"rms_norm_eps": 1e-5}
_WINDOW_4096 = {"sliding_window": 4096}
FAMILIES = {
    "llama": Family(), "granite": Family(),
    "mistral": Family(defaults=_WINDOW_4096), "ministral": Family(defaults=_WINDOW_4096),
    "seed_oss": Family(defaults={"attention_bias": True}), "phi3": Family(defaults=_EPS_1E5),
    "qwen2": Family(window_opt_in=True), "qwen3": Family(qk_norm="head", window_opt_in=True),
    # Qwen2-VL / 2.5-VL / 3-VL's language models (text only: their multimodal rotary is the plain one)
    "qwen2_vl_text": Family(window_opt_in=True, defaults=_EPS_1E5),
    "qwen2_5_vl_text": Family(window_opt_in=True, defaults=_EPS_1E5),
    "qwen3_vl_text": Family(qk_norm="head", window_opt_in=True),
    "smollm3": Family(window_opt_in=True, tied=True),
    "gemma": Family(norm="gemma", tied=True),
    "gemma2": Family(norm="gemma", tied=True, layer_norms="sandwich", sliding_pattern=2, defaults=_WINDOW_4096),
    "gemma3_text": Family(norm="gemma", tied=True, layer_norms="sandwich", qk_norm="head", rope_by_layer_type=True,
                          sliding_pattern=6, pattern_key=True, defaults=_WINDOW_4096),
    "olmo2": Family(qk_norm="full", layer_norms="post", norm="rms32", defaults=_EPS_1E5),
    "olmo3": Family(qk_norm="full", layer_norms="post", norm="rms32", rope_by_layer_type=True, sliding_pattern=4,
                    defaults={**_EPS_1E5, **_WINDOW_4096}),
    "exaone4": Family(qk_norm="head", layer_norms="post", sliding_pattern=4, pattern_key=True, full_layers_nope=True,
                      defaults={**_EPS_1E5, **_WINDOW_4096}),
    "glm": Family(rope_interleaved=True, defaults={"rms_norm_eps": 1.5625e-07, "attention_bias": True}),
    "glm4": Family(rope_interleaved=True, layer_norms="glm4",
                   defaults={"rms_norm_eps": 1.5625e-07, "attention_bias": True}),
    "helium": Family(rope_interleaved=True, norm="rms32", defaults={"rms_norm_eps": 1e-8}),
    "ernie4_5": Family(rope_interleaved=True, tied=True, defaults=_EPS_1E5),
    "cohere": Family(rope_interleaved=True, layer_norms="parallel", norm="layer", tied=True, eps_key="layer_norm_eps"),
    "cohere2": Family(rope_interleaved=True, layer_norms="parallel", norm="layer", tied=True, eps_key="layer_norm_eps",
                      sliding_pattern=4, pattern_key=True, full_layers_nope=True, defaults=_WINDOW_4096),
    "hunyuan_v1_dense": Family(qk_norm="head", qk_norm_after_rope=True, defaults=_EPS_1E5),
    "arcee": Family(gated_mlp=False, defaults=_EPS_1E5),
    "nemotron": Family(gated_mlp=False, norm="layer1p", eps_key="norm_eps"),
    "starcoder2": Family(gated_mlp=False, norm="layer_bias", tied=True, eps_key="norm_epsilon"),
    "apertus": Family(gated_mlp=False, qk_norm="head", defaults=_EPS_1E5),
    # StableLM: its layers "parallel" where use_parallel_residual says
    "stablelm": Family(norm="layer_bias", eps_key="layer_norm_eps"),
    "phi": Family(gated_mlp=False, norm="layer_bias", layer_norms="parallel_sum", eps_key="layer_norm_eps",
                  lm_head_bias=True),
    # GPT-NeoX (Pythia): its layers "parallel_two_norms" unless use_parallel_residual is false
    "gpt_neox": Family(gated_mlp=False, norm="layer_bias", layer_norms="parallel_two_norms", eps_key="layer_norm_eps"),
    "mixtral": Family(defaults=_EPS_1E5),
    "qwen2_moe": Family(window_opt_in=True), "qwen3_moe": Family(qk_norm="head", window_opt_in=True),
    "granitemoe": Family(),
    "olmoe": Family(qk_norm="full", defaults=_EPS_1E5),
}


@dataclass(frozen=True)
class LlamaArch:
    """What differs between the family members, read from config.json."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    rope: dict
    sliding_window: int | None
    # A mixture of experts (num_experts > 0): the MLP of each layer in sparse_layers routes every
    # token to num_experts_per_tok experts of moe_intermediate_size (engine.models.moe).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the k routing weights renormalised to sum to one
    route_in_model_dtype: bool = False  # the weights rounded to the model's dtype (Qwen), else float32
    softmax_of_top_k: bool = False  # Granite-MoE: the softmax of the k largest logits (the same weights)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one dense expert beside, sigmoid-gated
    sparse_layers: tuple[int, ...] = ()
    # Granite's multipliers: the embeddings scaled, attention's softmax scale (None: head_dim ** -0.5),
    # each layer's attention and MLP output scaled before the residual add, the logits divided.
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    nope_layers: tuple[int, ...] = ()  # SmolLM3: layers whose attention takes no rotary embedding
    # OLMo 2 / OLMoE: q and k normalised over all their heads at once (q_norm [heads * head_dim]),
    # before the rotary embedding; then clamped to +-clip_qkv (and v) where the config says.
    qk_norm_full: bool = False
    clip_qkv: float | None = None
    qk_norm_after_rope: bool = False  # HunYuan: the per-head q / k norms after the rotary embedding
    # Where a layer's norms sit (LAYER_NORMS): "pre" (Llama's: each sublayer's input), "post" (OLMo 2,
    # EXAONE 4: each sublayer's output, before the residual add), "sandwich" (Gemma 2 / 3: input and
    # output, pre_ / post_feedforward_layernorm around the MLP), "glm4" (the same under GLM-4's names),
    # "parallel" (Cohere: attention and the MLP both read one norm of the stream, both added to it),
    # "parallel_sum" (Phi: the same, the two outputs summed first),
    # "parallel_two_norms" (GPT-NeoX: each reads its own norm of the stream, the outputs summed first).
    layer_norms: str = "pre"
    hidden_act: str = "silu"  # the gated MLP's activation (Gemma's: gelu_pytorch_tanh)
    # Gemma: RMS norms scale by 1 + weight, and the embeddings by sqrt(hidden_size) rounded to the
    # model's dtype. Gemma's and OLMo 2's norms scale in float32 and round once (Float32RMSNorm).
    norm_offset: float = 0.0
    norm_in_float32: bool = False
    # Cohere: LayerNorms (the mean subtracted, no bias, in float32), not RMS norms; Command R+'s q / k
    # norms with a weight per head ([heads, head_dim]); the logits multiplied by logit_scale.
    layer_norm: bool = False
    layer_norm_bias: bool = False  # StarCoder 2, Nemotron: torch's LayerNorm (a bias; Nemotron's by 1 + weight)
    gated_mlp: bool = True  # False: the MLP is down(act(up(x))) (Arcee, Nemotron, StarCoder 2)
    qk_norm_per_head: bool = False
    logit_scale: float = 1.0
    lm_head_bias: bool = False
    embedding_multiplier_in_dtype: bool = False
    # Each layer's sliding window (0: full attention): a query sees the last `window` keys.
    layer_windows: tuple[int, ...] = ()
    # Gemma 2 / 3: soft-capped attention scores and logits (0: none); Gemma 3 (and OLMo 3): the
    # sliding layers' own rotary parameters (rope_local; the others take rope).
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    rope_local: dict | None = None
    local_rope_layers: tuple[int, ...] = ()
    rope_interleaved: bool = False  # GLM: dims 2i and 2i + 1 rotated as a pair (GPT-J style), not i and half + i

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "LlamaArch":
        model_type = cfg.get("model_type", "llama")
        if model_type not in FAMILIES:
            raise ValueError(f"unsupported model_type {model_type!r} (served: {', '.join(sorted(FAMILIES))})")
        family = FAMILIES[model_type]
        cfg = {**family.defaults, **cfg}  # (a key the config sets, null included, wins)
        if model_type in ("stablelm", "phi") and cfg.get("qk_layernorm"):
            raise ValueError(f"{model_type}: qk_layernorm (LayerNorms with biases on q and k) is not served")
        heads = cfg["num_attention_heads"]
        gemma = model_type in GEMMA_TYPES
        act = (cfg.get("hidden_activation") if model_type != "gemma" else None) or \
            cfg.get("hidden_act", "gelu_pytorch_tanh" if gemma else "silu")
        if gemma and act == "gelu":  # Gemma's first configs; transformers reads the tanh form
            act = "gelu_pytorch_tanh"
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention (an embedding model's attention) is not served")
        served = ACTIVATIONS if family.gated_mlp else PLAIN_ACTIVATIONS
        if act not in served:
            raise ValueError(f"unsupported hidden_act {act!r} (served: {', '.join(served)})")
        window = cfg.get("sliding_window")
        if family.window_opt_in and not cfg.get("use_sliding_window", False):
            window = None
        granite = model_type in ("granite", "granitemoe")
        sliding = _sliding_layers(cfg, family)
        rope, rope_local = _ropes_by_layer_type(cfg, model_type) if family.rope_by_layer_type \
            else (rope_parameters(cfg), None)
        qkv_bias, o_bias, mlp_bias = _biases(cfg, model_type)
        # Command R+'s q / k norms (use_qk_norm): a weight per head.
        per_head_qk_norm = model_type == "cohere" and bool(cfg.get("use_qk_norm", False))
        # (StableLM's parallel residual adds as Cohere's: the stream plus attention, then the MLP)
        layer_norms = "parallel" if model_type == "stablelm" and cfg.get("use_parallel_residual") \
            else "pre" if model_type == "gpt_neox" and not cfg.get("use_parallel_residual", True) else family.layer_norms
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get(family.eps_key, 1e-6 if family.norm in ("rms", "rms32", "gemma") else 1e-5),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=family.qk_norm == "head" or per_head_qk_norm,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.tied)),
            rope=rope,
            sliding_window=window,
            layer_windows=tuple(window if i in sliding and window and window < cfg.get("max_position_embeddings", 2048)
                                else 0 for i in range(cfg["num_hidden_layers"])),
            **moe_fields(cfg, model_type),
            embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)) if granite
            else cfg["hidden_size"] ** 0.5 if gemma else 1.0,
            attention_multiplier=float(cfg["attention_multiplier"]) if granite and "attention_multiplier" in cfg
            else float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma and model_type != "gemma" else None,
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)) if granite else 1.0,
            logits_scaling=float(cfg.get("logits_scaling", 1.0)) if granite else 1.0,
            nope_layers=_nope_layers(cfg) if model_type == "smollm3" else
            tuple(i for i in range(cfg["num_hidden_layers"]) if i not in sliding)
            if family.full_layers_nope and window else (),
            qk_norm_full=family.qk_norm == "full",
            qk_norm_after_rope=family.qk_norm_after_rope,
            clip_qkv=float(cfg["clip_qkv"]) if model_type == "olmoe" and cfg.get("clip_qkv") is not None else None,
            layer_norms=layer_norms,
            hidden_act=act,
            norm_offset=1.0 if family.norm in ("gemma", "layer1p") else 0.0,
            norm_in_float32=family.norm in ("gemma", "rms32"),
            layer_norm=family.norm == "layer",
            layer_norm_bias=family.norm in ("layer_bias", "layer1p"),
            gated_mlp=family.gated_mlp,
            qk_norm_per_head=per_head_qk_norm,
            logit_scale=float(cfg.get("logit_scale", 0.0625)) if model_type in ("cohere", "cohere2") else 1.0,
            embedding_multiplier_in_dtype=gemma,
            # (Gemma 3's config may carry attn_logit_softcapping; transformers does not apply it there)
            attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0) if model_type == "gemma2" else 0.0,
            final_softcap=float(cfg.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
            rope_local=rope_local,
            local_rope_layers=tuple(sorted(sliding)) if rope_local is not None else (),
            rope_interleaved=family.rope_interleaved,
            lm_head_bias=family.lm_head_bias,
        )


GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")


def _biases(cfg: dict, model_type: str) -> tuple[bool, bool, bool]:
    """Whether q/k/v, o_proj and the MLP's projections have biases."""
    if model_type in ("cohere", "cohere2"):  # attention_bias on every attention projection, none on the MLP
        return (bool(cfg.get("attention_bias", False)),) * 2 + (False,)
    if model_type in ("qwen2", "qwen2_moe", "qwen2_vl_text", "qwen2_5_vl_text"):  # always on q/k/v (Qwen2-MoE's
        # config may say otherwise)
        return bool(cfg.get("qkv_bias", True)) if model_type == "qwen2_moe" else True, False, False
    if model_type in ("ernie4_5", "starcoder2"):  # one switch for every projection
        return (bool(cfg.get("use_bias", model_type == "starcoder2")),) * 3
    if model_type == "phi":  # every projection
        return True, True, True
    if model_type == "gpt_neox":  # the MLP's always; attention's where attention_bias says (its default: on)
        attention = bool(cfg.get("attention_bias", True))
        return attention, attention, True
    if model_type == "stablelm":  # q / k / v where use_qkv_bias says
        return bool(cfg.get("use_qkv_bias", False)), False, False
    attention = bool(cfg.get("attention_bias", False))
    if model_type in ("glm", "glm4", "helium"):  # o_proj without one
        o = False
    elif model_type == "seed_oss":
        o = bool(cfg.get("attention_out_bias", False))
    else:
        o = attention
    return attention, o, bool(cfg.get("mlp_bias", False))


def _sliding_layers(cfg: dict, family: Family) -> frozenset[int]:
    """The layers of sliding-window attention, as transformers reads the config (their window:
    sliding_window): layer_types' "sliding_attention" ones where it lists them; else Qwen's from
    max_window_layers on when use_sliding_window says so; else by the family's pattern (Gemma 2's
    every other layer, Gemma 3's five of six, OLMo 3's and Cohere 2's three of four; EXAONE's
    "LLLG" form: L a local layer, G a global one); else every layer."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"unsupported layer_types {sorted(unknown)} (served: sliding_attention, full_attention)")
        return frozenset(i for i, t in enumerate(types) if t == "sliding_attention")
    if family.window_opt_in:
        if not cfg.get("use_sliding_window", False):
            return frozenset()
        return frozenset(range(cfg.get("max_window_layers", 28), layers))
    if family.sliding_pattern:
        pattern = (cfg.get("sliding_window_pattern") if family.pattern_key else None) or family.sliding_pattern
        if isinstance(pattern, str):
            return frozenset(i for i in range(layers) if pattern[i % len(pattern)] == "L")
        return frozenset(i for i in range(layers) if (i + 1) % int(pattern))
    return frozenset(range(layers))


def _ropes_by_layer_type(cfg: dict, model_type: str) -> tuple[dict, dict | None]:
    """The rotary parameters of the full-attention layers and of the sliding ones (None: the
    same): transformers 5's rope_parameters by layer type, or 4.x's rope_theta and rope_scaling.
    Gemma 3's sliding layers take rope_local_base_freq (10k) and no scaling; OLMo 3's take its
    rope_theta without the scaling (transformers applies rope_scaling to the full layers only)."""
    by_type = cfg.get("rope_parameters") or {}
    gemma = model_type == "gemma3_text"
    theta = cfg.get("rope_theta", 1_000_000.0 if gemma else 500_000.0)
    if "full_attention" in by_type or "sliding_attention" in by_type:
        full = by_type.get("full_attention") or {"rope_type": "default", "rope_theta": theta}
        local = by_type.get("sliding_attention") or {"rope_type": "default",
                                                      "rope_theta": 10_000.0 if gemma else theta}
    else:
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": theta}
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10_000.0) if gemma else theta}
    base = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    full, local = rope_parameters({**base, "rope_parameters": full}), rope_parameters({**base, "rope_parameters": local})
    return full, (None if local == full else local)


def _nope_layers(cfg: dict) -> tuple[int, ...]:
    """SmolLM3's layers without a rotary embedding: no_rope_layers[i] == 0, or, where the config
    leaves the list out, every no_rope_layer_interval-th layer (transformers' rule)."""
    layers = cfg.get("no_rope_layers")
    if layers is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        layers = [int((i + 1) % interval != 0) for i in range(cfg["num_hidden_layers"])]
    if len(layers) != cfg["num_hidden_layers"]:
        raise ValueError(f"no_rope_layers has {len(layers)} entries for {cfg['num_hidden_layers']} layers")
    return tuple(i for i, rope in enumerate(layers) if not rope)


@dataclass
class AttentionMetadata:
    """The flattened batch as the attention kernels see it (built by the model runner)."""
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    decode_only: bool  # one query token per sequence


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: KernelBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.kernels.rms_norm(x, self.weight, self.eps, residual)

    def scale(self, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x already normalised (float32) times the weight, as forward rounds it (TP's full-width norm)."""
        return self.weight * normed.to(dtype)


class Float32RMSNorm(RMSNorm):
    """Gemma's norms (scaling by offset 1 + weight) and OLMo 2's: normalised and scaled in float32,
    rounded to the input's dtype once, as transformers' GemmaRMSNorm and Olmo2RMSNorm (Llama's,
    the kernels', rounds the normalised x before the weight: the same in float32, not in bf16)."""

    def __init__(self, dim: int, eps: float, kernels: KernelBackend, offset: float = 0.0) -> None:
        super().__init__(dim, eps, kernels)
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        xf = x.float()
        return self.scale(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps), x.dtype), x

    def scale(self, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (normed * (self.weight.float() + self.offset)).to(dtype)


class Float32LayerNorm(RMSNorm):
    """Cohere's LayerNorm: the mean subtracted, normalised and scaled in float32, rounded to the
    input's dtype once; no bias. dim: an int, or (heads, head_dim) for a weight per head (Command
    R+'s q / k norms: each head normalised over head_dim and scaled by its own row)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        xf = x.float()
        centred = xf - xf.mean(-1, keepdim=True)
        normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype), x


class BiasedLayerNorm(RMSNorm):
    """torch's LayerNorm with a bias, in the input's dtype (StarCoder 2's nn.LayerNorm); offset 1:
    Nemotron's LayerNorm1P, scaling by 1 + weight."""

    def __init__(self, dim: int, eps: float, kernels: KernelBackend, offset: float = 0.0) -> None:
        super().__init__(dim, eps, kernels)
        self.bias = nn.Parameter(torch.zeros(dim))
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        weight = self.weight + self.offset if self.offset else self.weight
        return nn.functional.layer_norm(x, (x.shape[-1],), weight, self.bias, self.eps), x


@functools.lru_cache(maxsize=None)
def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype`, as a Python number: a host scalar, so a step (and a CUDA graph's
    capture) makes no tensor for it on the device."""
    return float(torch.tensor(value, dtype=dtype))


def make_norm(arch: "LlamaArch", dim: int | tuple[int, int], kernels: KernelBackend) -> RMSNorm:
    """The architecture's norm over `dim` (RMS, or Cohere's LayerNorm)."""
    if arch.layer_norm:
        return Float32LayerNorm(dim, arch.rms_norm_eps, kernels)
    if arch.layer_norm_bias:
        return BiasedLayerNorm(dim, arch.rms_norm_eps, kernels, arch.norm_offset)
    if arch.norm_in_float32:
        return Float32RMSNorm(dim, arch.rms_norm_eps, kernels, arch.norm_offset)
    return RMSNorm(dim, arch.rms_norm_eps, kernels)


class Attention(nn.Module):
    """With tp: this rank's query heads and KV heads (qkv_proj column-parallel), o_proj
    row-parallel, its partial sums all-reduced. `*_lora`: LoRA adapters (engine.lora), when served."""
    qkv_lora = o_lora = None
    # A checkpoint's calibrated (k_scale, v_scale): an fp8 cache stores k / k_scale and v / v_scale.
    # Floats (one a layer), or [local KV heads] tensors (llm-compressor's attn_head): set_kv_scales.
    kv_scales = (1.0, 1.0)
    has_kv_scales = False
    _per_head = None  # per-head scales: (K's, V's divisors [KV heads, 1]; Q's, O's factors [heads, 1])

    def __init__(self, arch: LlamaArch, kernels: KernelBackend, tp: "TPGroup | None" = None,
                 rotary: bool = True, window: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.rotary = rotary
        self._rope = dict(interleaved=True) if arch.rope_interleaved else {}  # (the kernels' default: Neox)
        self.window, self.softcap = window, arch.attn_softcap  # sliding window, soft-capped scores (kernels' args)
        self._band = dict(window=window, softcap=arch.attn_softcap) if window or arch.attn_softcap else {}
        o_bias = arch.o_bias
        if tp is not None:
            self.num_heads, self.num_kv_heads = tp.layout.local_heads, tp.layout.local_kv_heads
            o_bias = o_bias and tp.layout.owns_replicated_bias()
        self.tp = tp
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=o_bias)
        # Per head: one weight for every head, or (Command R+) each of this rank's heads its own row.
        q_dim, k_dim = ((self.num_heads, self.head_dim), (self.num_kv_heads, self.head_dim)) \
            if arch.qk_norm_per_head else (self.head_dim, self.head_dim)
        self.q_norm = make_norm(arch, q_dim, kernels) if arch.qk_norm else None
        self.k_norm = make_norm(arch, k_dim, kernels) if arch.qk_norm else None
        self.qk_norm_full, self.clip_qkv = arch.qk_norm_full, arch.clip_qkv
        self.qk_norm_after_rope = arch.qk_norm_after_rope
        if arch.qk_norm_full:  # this rank's slice of the full-width weights; the variance is over all heads
            self.q_norm = make_norm(arch, self.q_size, kernels)
            self.k_norm = make_norm(arch, self.kv_size, kernels)
            # Each KV head is on size // KV heads ranks when it is replicated: its squares counted once.
            self._k_replicas = 1 if tp is None else max(1, tp.layout.size // arch.num_kv_heads)
        self.scale = self.head_dim ** -0.5 if arch.attention_multiplier is None else arch.attention_multiplier
        self.kernels = kernels

    def _full_norm(self, x: torch.Tensor, norm: "RMSNorm", replicas: int) -> torch.Tensor:
        """RMS norm over every head's [T, heads * head_dim] at once; under TP the squares are summed
        over the ranks (each replicated KV head once) and each rank scales its heads by its slice."""
        if self.tp is None:
            return norm(x)[0]
        xf = x.float()
        squares = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        width = x.shape[-1] * self.tp.layout.size // replicas
        normed = xf * torch.rsqrt(squares / (replicas * width) + norm.eps)
        return norm.scale(normed, x.dtype).contiguous()

    def set_kv_scales(self, k_scale, v_scale, dtype: torch.dtype, device: torch.device) -> None:
        """A checkpoint's K and V scales: floats, or tensors of this rank's KV heads' (the divisors
        and, for the query heads each KV head serves, the factors, in the model's dtype on its device)."""
        self.kv_scales = (k_scale, v_scale)
        self.has_kv_scales = not (isinstance(k_scale, float) and isinstance(v_scale, float)) or \
            (k_scale, v_scale) != (1.0, 1.0)
        if isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor):
            k, v = (torch.as_tensor(s, dtype=torch.float32).reshape(-1).expand(self.num_kv_heads)
                    for s in (k_scale, v_scale))
            group = self.num_heads // self.num_kv_heads
            self._per_head = tuple(t.to(device=device, dtype=dtype)[:, None].contiguous() for t in (
                k, v, k.repeat_interleave(group), v.repeat_interleave(group)))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, cos_sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.qkv_lora is not None:
            self.qkv_lora(x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_full:
            q, k = self._full_norm(q, self.q_norm, 1), self._full_norm(k, self.k_norm, self._k_replicas)
            if self.clip_qkv is not None:
                q, k, v = (x.clamp(-self.clip_qkv, self.clip_qkv) for x in (q, k, v))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        per_head_norm = self.q_norm is not None and not self.qk_norm_full
        if per_head_norm and not self.qk_norm_after_rope:
            q = self.q_norm(q)[0]
            k = self.k_norm(k)[0]
        if self.rotary:
            q, k = self.kernels.rotary_embedding(positions, q, k, cos_sin, **self._rope)
        else:  # (SmolLM3's NoPE layers) the kernels take q and k as the rotary kernel leaves them
            q, k = q.contiguous(), k.contiguous()
        if per_head_norm and self.qk_norm_after_rope:
            q = self.q_norm(q)[0]
            k = self.k_norm(k)[0]
        scale, (k_scale, v_scale) = self.scale, self.kv_scales
        scaled = kv_cache.element_size() == 1 and self.has_kv_scales
        per_head = self._per_head if scaled else None
        if per_head is not None:  # the same, a scale per KV head: q's heads take their KV head's k_scale
            k, v, q = k / per_head[0], v / per_head[1], q * per_head[2]
        elif scaled:  # an fp8 cache with calibrated scales: softmax(q . k8 * k_scale) . v8 * v_scale
            k, v, scale = k / k_scale, v / v_scale, scale * k_scale
        self.kernels.store_kv(k, v, kv_cache, meta.slot_mapping)
        if meta.decode_only:
            o = self.kernels.paged_decode_attention(q, kv_cache, meta.seq_lens, meta.block_tables, scale, **self._band)
        else:
            o = self.kernels.paged_attention(q, kv_cache, meta.query_start_loc, meta.seq_lens,
                                             meta.block_tables, scale, **self._band)
        if per_head is not None:
            o = o * per_head[3]
        elif scaled and v_scale != 1.0:
            o = o * v_scale
        o = o.reshape(t, self.q_size)
        out = self.o_proj(o)
        if self.o_lora is not None:
            self.o_lora(o, out)
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    """With tp: gate_up column-parallel, down_proj row-parallel (all-reduced). gate_up_proj holds the
    gate rows then the up rows (gate_up_sizes); a plain MLP's (arch.gated_mlp False) holds no gate rows."""
    gate_up_lora = down_lora = None

    def __init__(self, arch: LlamaArch, kernels: KernelBackend, tp: "TPGroup | None" = None,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        self.tp = tp
        if intermediate_size is None:
            intermediate_size = arch.intermediate_size if tp is None else tp.layout.local_intermediate
        self.intermediate_size = intermediate_size
        down_bias = arch.mlp_bias and (tp is None or tp.layout.owns_replicated_bias())
        self.gate_up_sizes = (intermediate_size if arch.gated_mlp else 0, intermediate_size)
        self.gate_up_proj = nn.Linear(arch.hidden_size, sum(self.gate_up_sizes), bias=arch.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, arch.hidden_size, bias=down_bias)
        if not arch.gated_mlp and arch.hidden_act == "xielu":
            self.act_fn = XIELU()  # (its parameters are the checkpoint's mlp.act_fn.*)
            self.act_and_mul = self.act_fn.forward  # (one module, registered once: as act_fn)
        else:
            self.act_and_mul = PLAIN_ACTIVATIONS[arch.hidden_act] if not arch.gated_mlp else \
                kernels.silu_and_mul if arch.hidden_act == "silu" else ACTIVATIONS[arch.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gate_up_lora is None:
            out = self.down_proj(self.act_and_mul(gate_up))
        else:
            self.gate_up_lora(x, gate_up)
            h = self.act_and_mul(gate_up)
            out = self.down_proj(h)
            self.down_lora(h, out)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch, kernels: KernelBackend, tp: "TPGroup | None" = None,
                 index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(arch, kernels, tp, rotary=index not in arch.nope_layers,
                                   window=arch.layer_windows[index] if arch.layer_windows else 0)
        self.mlp = SparseMoE(arch, kernels, MLP, tp) if index in arch.sparse_layers else MLP(arch, kernels, tp)
        self.input_layernorm = make_norm(arch, arch.hidden_size, kernels)
        self.post_attention_layernorm = make_norm(arch, arch.hidden_size, kernels)
        self.residual_multiplier = arch.residual_multiplier

    def forward(self, positions, x, residual, kv_cache, meta, cos_sin):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, kv_cache, meta, cos_sin)
        if self.residual_multiplier != 1.0:  # Granite: each branch scaled before it joins the residual
            h = h * self.residual_multiplier
        h, residual = self.post_attention_layernorm(h, residual)
        h = self.mlp(h)
        return (h if self.residual_multiplier == 1.0 else h * self.residual_multiplier), residual


class PostNormDecoderLayer(DecoderLayer):
    """OLMo 2: the residual stream goes into attention and the MLP as it is, and each one's output is
    normalised (post_attention_layernorm, post_feedforward_layernorm) before it joins the stream."""

    def __init__(self, arch: LlamaArch, kernels: KernelBackend, tp: "TPGroup | None" = None,
                 index: int = 0) -> None:
        super().__init__(arch, kernels, tp, index)
        del self.input_layernorm
        self.post_feedforward_layernorm = make_norm(arch, arch.hidden_size, kernels)

    def forward(self, positions, x, residual, kv_cache, meta, cos_sin):
        h = self.self_attn(positions, x, kv_cache, meta, cos_sin)
        x = x + self.post_attention_layernorm(h)[0]
        return x + self.post_feedforward_layernorm(self.mlp(x))[0], None


class ParallelDecoderLayer(DecoderLayer):
    """Cohere: attention and the MLP both read one norm of the residual stream (input_layernorm),
    and both outputs are added to it."""

    def __init__(self, arch: LlamaArch, kernels: KernelBackend, tp: "TPGroup | None" = None,
                 index: int = 0) -> None:
        super().__init__(arch, kernels, tp, index)
        del self.post_attention_layernorm

    def forward(self, positions, x, residual, kv_cache, meta, cos_sin):
        h = self.input_layernorm(x)[0]
        return x + self.self_attn(positions, h, kv_cache, meta, cos_sin) + self.mlp(h), None


class ParallelSumDecoderLayer(ParallelDecoderLayer):
    """Phi: as Cohere's, the two outputs summed before the stream."""

    def forward(self, positions, x, residual, kv_cache, meta, cos_sin):
        h = self.input_layernorm(x)[0]
        return self.self_attn(positions, h, kv_cache, meta, cos_sin) + self.mlp(h) + x, None


class ParallelTwoNormsDecoderLayer(DecoderLayer):
    """GPT-NeoX's parallel residual: attention reads input_layernorm's norm of the stream and the MLP
    post_attention_layernorm's; the two outputs are summed before the stream."""

    def forward(self, positions, x, residual, kv_cache, meta, cos_sin):
        h = self.self_attn(positions, self.input_layernorm(x)[0], kv_cache, meta, cos_sin)
        return self.mlp(self.post_attention_layernorm(x)[0]) + h + x, None


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2 / 3: attention's input and output normalised (input_layernorm,
    post_attention_layernorm), then the MLP's (pre_feedforward_layernorm,
    post_feedforward_layernorm), each output added to the residual stream as it is."""
    # The four norms in the order they apply, by the checkpoint's names.
    NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")

    def __init__(self, arch: LlamaArch, kernels: KernelBackend, tp: "TPGroup | None" = None,
                 index: int = 0) -> None:
        super().__init__(arch, kernels, tp, index)
        for name in self.NORMS[2:] + self.NORMS[:2]:  # (the last two: DecoderLayer's own names)
            if not hasattr(self, name):
                setattr(self, name, make_norm(arch, arch.hidden_size, kernels))
        self._norms = tuple(getattr(self, name) for name in self.NORMS)
        if len(set(map(id, self._norms))) != 4 or len(list(self.children())) != 6:
            raise AssertionError(f"{type(self).__name__}: its norms {self.NORMS} must be four modules of their own")

    def forward(self, positions, x, residual, kv_cache, meta, cos_sin):
        attn_in, attn_out, mlp_in, mlp_out = self._norms
        h = self.self_attn(positions, attn_in(x)[0], kv_cache, meta, cos_sin)
        x = x + attn_out(h)[0]
        h = self.mlp(mlp_in(x)[0])
        return x + mlp_out(h)[0], None


class Glm4DecoderLayer(SandwichDecoderLayer):
    """GLM-4: Gemma 2's sandwich under GLM-4's names (post_attention_layernorm is the MLP's input norm)."""
    NORMS = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


LAYER_NORMS = {"pre": DecoderLayer, "post": PostNormDecoderLayer, "sandwich": SandwichDecoderLayer,
               "glm4": Glm4DecoderLayer, "parallel": ParallelDecoderLayer, "parallel_sum": ParallelSumDecoderLayer,
               "parallel_two_norms": ParallelTwoNormsDecoderLayer}


class LlamaForCausalLM(nn.Module):
    """With tp (tensor parallelism): this rank's shard; the embedding and the LM head are
    vocabulary-parallel (rows vocab_start.. of the vocabulary), norms replicated."""

    def __init__(self, arch: LlamaArch, kernels: KernelBackend, tp: "TPGroup | None" = None) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp
        vocab_rows = arch.vocab_size if tp is None else tp.layout.vocab_per_rank
        self.embed_tokens = nn.Embedding(vocab_rows, arch.hidden_size)
        layer_cls = LAYER_NORMS[arch.layer_norms]
        self.layers = nn.ModuleList(layer_cls(arch, kernels, tp, i) for i in range(arch.num_layers))
        self.norm = make_norm(arch, arch.hidden_size, kernels)
        self.lm_head = nn.Linear(arch.hidden_size, vocab_rows, bias=arch.lm_head_bias)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", rope_table(arch), persistent=False)
        # Gemma 3: the sliding layers' own rotary table.
        self.local_rope_layers = frozenset(arch.local_rope_layers)
        self.register_buffer("cos_sin_local", rope_table(arch, params=arch.rope_local) if arch.rope_local else None,
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if self.tp is None else self._embed_shard(input_ids)
        if self.arch.embedding_multiplier_in_dtype:  # Gemma's normalizer, rounded to the embeddings' dtype
            x = x * _rounded(self.arch.embedding_multiplier, x.dtype)
        elif self.arch.embedding_multiplier != 1.0:
            x = x * self.arch.embedding_multiplier
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            cos_sin = self.cos_sin_local if i in self.local_rope_layers else self.cos_sin
            x, residual = layer(positions, x, residual, kv_cache, meta, cos_sin)
        return self.norm(x, residual)[0]

    def _embed_shard(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of ids in this rank's vocabulary range, zeros elsewhere, summed over the ranks
        (one non-zero term per token: exact)."""
        local = input_ids - self.tp.layout.vocab_start
        outside = (local < 0) | (local >= self.tp.layout.vocab_per_rank)
        x = self.embed_tokens(local.masked_fill(outside, 0)).masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab]; with tp the full logits on rank 0 (each rank computes its vocabulary
        shard) and None on the other ranks."""
        logits = self.lm_head(hidden)
        if self.arch.logits_scaling != 1.0:  # Granite
            logits = logits / self.arch.logits_scaling
        elif self.arch.logit_scale != 1.0:  # Cohere
            logits = logits * self.arch.logit_scale
        if self.arch.final_softcap:  # Gemma 2
            logits = torch.tanh(logits / self.arch.final_softcap) * self.arch.final_softcap
        return logits if self.tp is None else self.tp.gather_logits(logits)
