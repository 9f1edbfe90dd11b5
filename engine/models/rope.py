"""Rotary embedding tables (default, linear, Llama-3, YaRN, Phi-3's LongRoPE and HunYuan's NTK-alpha
scaling), as transformers computes them."""
from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "ntk_alpha")
# The share of head_dim rotated where a config leaves partial_rotary_factor out (transformers' defaults).
PARTIAL_ROTARY_DEFAULTS = {"glm": 0.5, "glm4": 0.5, "nemotron": 0.5, "phi": 0.5, "stablelm": 0.25, "gpt_neox": 0.25}


def rope_parameters(hf_config: dict) -> dict:
    """Normalise transformers 4.x (rope_theta + rope_scaling) and 5.x (rope_parameters) configs.
    The dict also carries partial_rotary_factor (the share of head_dim rotated) and, for YaRN and
    LongRoPE, original_max_position_embeddings (the pretraining context) and max_position_embeddings."""
    params = dict(hf_config.get("rope_parameters") or {})
    if not params:
        params = dict(hf_config.get("rope_scaling") or {})
        # (GPT-NeoX's first configs: rotary_emb_base)
        params.setdefault("rope_theta", hf_config.get("rope_theta", hf_config.get("rotary_emb_base", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "su":  # Phi-3's first name for LongRoPE
        rope_type = "longrope"
    if rope_type == "mrope":  # Qwen2-VL's: sections of the default rotary over (time, height, width)
        rope_type = "default"
    if rope_type == "dynamic" and params.get("alpha"):  # HunYuan's: a fixed alpha makes the frequencies static
        rope_type = "ntk_alpha"
    params["rope_type"] = rope_type
    # (some families' configs leave it out for their default: transformers')
    # (GPT-NeoX's first configs: rotary_pct)
    params.setdefault("partial_rotary_factor", hf_config.get("partial_rotary_factor", hf_config.get(
        "rotary_pct", PARTIAL_ROTARY_DEFAULTS.get(hf_config.get("model_type"), 1.0))))
    if rope_type in ("yarn", "longrope"):
        params.setdefault("max_position_embeddings", hf_config.get("max_position_embeddings", 2048))
        # Phi-3 saves the pretraining context at the top level, and it takes priority (transformers' rule).
        original = hf_config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = original or params["max_position_embeddings"]
    return params


def rotary_dim(head_dim: int, params: dict) -> int:
    """How many of a head's dimensions are rotated (Phi-4-mini's partial_rotary_factor 0.75: 3/4)."""
    return int(head_dim * float(params.get("partial_rotary_factor", 1.0)))


def uses_long_factors(params: dict, max_model_len: int) -> bool:
    """LongRoPE: the long factors when the served context passes the pretraining one, for every
    position (vLLM's rule: a sequence never changes tables mid-way, so its cached keys stay valid;
    transformers switches a whole sequence to them once it passes that length)."""
    return params["rope_type"] == "longrope" and max_model_len > params["original_max_position_embeddings"]


def inv_frequencies(rot_dim: int, params: dict, long: bool = False) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and the factor cos and sin are scaled by (YaRN's, LongRoPE's)."""
    base = float(params.get("rope_theta", 10000.0))
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    inv_freq = 1.0 / (base ** exponents)
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "ntk_alpha":  # the base scaled by alpha ** (d / (d - 2)) (transformers' HunYuan: d = head_dim)
        alpha = float(params["alpha"])
        return 1.0 / ((base * alpha ** (rot_dim / (rot_dim - 2))) ** exponents), 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(params["factor"])
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = params["max_position_embeddings"] / original
    factor = float(factor)
    if rope_type == "yarn":
        return _yarn(rot_dim, base, factor, original, params)
    attention = params.get("attention_factor")  # LongRoPE's
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = params["long_factor" if long else "short_factor"]
    if len(factors) != rot_dim // 2:
        raise ValueError(f"rope_scaling's {'long' if long else 'short'}_factor has {len(factors)} values; "
                         f"the rotated dimensions need {rot_dim // 2}")
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** exponents), float(attention)


def _yarn(rot_dim: int, base: float, factor: float, original: int, params: dict) -> tuple[torch.Tensor, float]:
    """YaRN: high frequencies kept, low ones interpolated by `factor`, a linear ramp between
    (beta_fast / beta_slow rotations over the pretraining context); cos and sin scaled by
    0.1 ln(factor) + 1 (or mscale / mscale_all_dim's ratio, DeepSeek's form)."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rot_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    extrapolation = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, float(attention)


def cos_sin_cache(rot_dim: int, max_positions: int, params: dict, long: bool = False) -> torch.Tensor:
    """[max_positions, rot_dim]: cos of each frequency, then sin (kernels.reference layout), times
    the rope type's attention factor where it has one. long: LongRoPE's long factors."""
    inv_freq, scale = inv_frequencies(rot_dim, params, long)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    if scale == 1.0:
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)


def rope_table(arch, max_model_len: int | None = None, params: dict | None = None) -> torch.Tensor:
    """The model's rotary table (arch: engine.models.llama.LlamaArch) for a served context of
    max_model_len tokens (None: the checkpoint's max_position_embeddings); params: other rotary
    parameters than arch.rope (Gemma 3's sliding layers')."""
    params = arch.rope if params is None else params
    served = arch.max_position_embeddings if max_model_len is None else max_model_len
    return cos_sin_cache(rotary_dim(arch.head_dim, params), max(arch.max_position_embeddings, served), params,
                         long=uses_long_factors(params, served))
