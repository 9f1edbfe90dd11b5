"""Load a Hugging Face checkpoint directory (config.json + safetensors) into our modules."""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import sys
from collections.abc import Callable

import torch
from safetensors import safe_open
from torch import nn

from engine.config import serves_language_model_of
from engine.models.llama import LlamaArch, LlamaForCausalLM
from engine.models.moe import SparseMoE
from engine.models.quantization import KeptWeight, QuantizedWeights
from engine.models.rope import rope_table
from kernels import KernelBackend
from kernels.cpu_linear import pack_linears

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    # Multimodal checkpoints served as their language model (engine.config.TEXT_OF_MULTIMODAL);
    # None: the model type of its text config.
    "Gemma3ForConditionalGeneration": "gemma3_text",
    "Mistral3ForConditionalGeneration": "mistral",
    "LlavaForConditionalGeneration": None,
    "Qwen2VLForConditionalGeneration": "qwen2_vl_text",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl_text",
    "Qwen3VLForConditionalGeneration": "qwen3_vl_text",
    "Phi3ForCausalLM": "phi3",
    "GraniteForCausalLM": "granite",
    "SmolLM3ForCausalLM": "smollm3",
    "SeedOssForCausalLM": "seed_oss",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "Exaone4ForCausalLM": "exaone4",
    "GlmForCausalLM": "glm",
    "Glm4ForCausalLM": "glm4",
    "MinistralForCausalLM": "ministral",
    "HeliumForCausalLM": "helium",
    "Ernie4_5ForCausalLM": "ernie4_5",
    "CohereForCausalLM": "cohere",
    "Cohere2ForCausalLM": "cohere2",
    "HunYuanDenseV1ForCausalLM": "hunyuan_v1_dense",
    "ArceeForCausalLM": "arcee",
    "NemotronForCausalLM": "nemotron",
    "Starcoder2ForCausalLM": "starcoder2",
    "ApertusForCausalLM": "apertus",
    "StableLmForCausalLM": "stablelm",
    "PhiForCausalLM": "phi",
    "GPTNeoXForCausalLM": "gpt_neox",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GraniteMoeForCausalLM": "granitemoe",
    "OlmoeForCausalLM": "olmoe",
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# An expert's projection (per-expert checkpoints, as published and as transformers saves them):
# layers.L.{mlp,block_sparse_moe}.experts.E.{gate_proj|w1, up_proj|w3, down_proj|w2}.weight; and
# transformers 5's stacked form in memory, layers.L.mlp.experts.{gate_up_proj, down_proj}.
_EXPERT = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?:(\d+)\.(\w+)\.weight|(gate_up_proj|down_proj))$")
_EXPERT_SHARD = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
                 "down_proj": ("w2", None), "w2": ("w2", None)}
# HF name fragment -> (our parameter, shard index within the fused parameter)
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# Other families' names for the tensors this model holds, as (pattern, its name here: a function of
# the match, None for a tensor not read). Every checkpoint's names go through them (each pattern is
# one family's own spelling); the first that matches renames.
_GRANITE_MOE_NAMES = {"input_linear.weight": "mlp.experts.gate_up_proj", "output_linear.weight": "mlp.experts.down_proj",
                      "router.layer.weight": "mlp.gate.weight"}
_PHI_NAMES = {"self_attn.dense": "self_attn.o_proj", "mlp.fc1": "mlp.up_proj", "mlp.fc2": "mlp.down_proj",
              "final_layernorm": "norm"}
_NEOX_NAMES = {"attention.dense": "self_attn.o_proj", "attention.query_key_value": "self_attn.query_key_value",
               "mlp.dense_h_to_4h": "mlp.up_proj", "mlp.dense_4h_to_h": "mlp.down_proj"}
_RENAMES: list[tuple[re.Pattern, Callable[[re.Match], str | None]]] = [
    # Granite-MoE: a layer's stacked experts ([E, 2I, H] gate and up, [E, H, I] down) and router, read
    # as transformers 5 holds Mixtral's (mlp.experts.gate_up_proj, down_proj; mlp.gate)
    (re.compile(r"^(.*\.)block_sparse_moe\.(input_linear\.weight|output_linear\.weight|router\.layer\.weight)$"),
     lambda m: m.group(1) + _GRANITE_MOE_NAMES[m.group(2)]),
    # HunYuan's per-head q / k norms
    (re.compile(r"^(.*\.self_attn\.)(query|key)_layernorm\.(weight)$"),
     lambda m: f"{m.group(1)}{m.group(2)[0]}_norm.{m.group(3)}"),
    # Apertus's layers' two norms
    (re.compile(r"^(.*\.layers\.\d+\.)(attention|feedforward)_layernorm\.(weight)$"),
     lambda m: f"{m.group(1)}{'input' if m.group(2) == 'attention' else 'post_attention'}_layernorm.{m.group(3)}"),
    # Phi's attention output, MLP and final norm
    # (a quantized weight's companions, weight_scale, qweight, ..., renamed with it)
    (re.compile(r"^(.*\.)(self_attn\.dense|mlp\.fc1|mlp\.fc2|final_layernorm)\.(\w+)$"),
     lambda m: f"{m.group(1)}{_PHI_NAMES[m.group(2)]}.{m.group(3)}"),
    # StarCoder 2's MLP
    (re.compile(r"^(.*\.mlp\.)(c_fc|c_proj)\.(\w+)$"),
     lambda m: f"{m.group(1)}{'up_proj' if m.group(2) == 'c_fc' else 'down_proj'}.{m.group(3)}"),
    # GPT-NeoX (Pythia): gpt_neox.* and embed_out; its older checkpoints' causal-mask buffers not read
    (re.compile(r"^gpt_neox\.layers\.\d+\.attention\.(?:bias|masked_bias)$"), lambda m: None),
    (re.compile(r"^gpt_neox\.(layers\.\d+\.)(attention\.dense|attention\.query_key_value|mlp\.dense_h_to_4h|"
                r"mlp\.dense_4h_to_h)\.(\w+)$"),
     lambda m: f"model.{m.group(1)}{_NEOX_NAMES[m.group(2)]}.{m.group(3)}"),
    (re.compile(r"^gpt_neox\.(embed_in|final_layer_norm|layers\.\d+\.\w+_layernorm)\.(weight|bias)$"),
     lambda m: f"model.{ {'embed_in': 'embed_tokens', 'final_layer_norm': 'norm'}.get(m.group(1), m.group(1)) }."
               f"{m.group(2)}"),
    (re.compile(r"^embed_out\.weight$"), lambda m: "lm_head.weight"),
]


def canonical_name(hf_name: str) -> str | None:
    """A checkpoint tensor's name as the loader reads it (_RENAMES); None: a tensor not read."""
    for pattern, renamed in _RENAMES:
        m = pattern.match(hf_name)
        if m is not None:
            return renamed(m)
    return hf_name


def _load_parts(model, params, hf_name: str, tensor: torch.Tensor, arch: LlamaArch, tp, loaded: set[str]) -> None:
    """A whole weight (a pre-fused one as its parts: unfuse), this rank's rows of each under TP."""
    for name, part in unfuse(hf_name, tensor, arch):
        part = part if tp is None else tp.layout.read(name, part)
        if part is not None:
            _load_one(model, params, name, part, loaded)


# A checkpoint that stores them fused already (Phi-3): read as its parts, so that tensor parallelism
# and LoRA see the q / k / v and gate / up projections every other member of the family has.
_PREFUSED = re.compile(r"^(.*\.)(self_attn\.qkv_proj|self_attn\.query_key_value|mlp\.gate_up_proj)\.(weight|bias)$")


def unfuse(hf_name: str, tensor: torch.Tensor, arch: LlamaArch) -> list[tuple[str, torch.Tensor]]:
    """A pre-fused qkv_proj or dense gate_up_proj weight (or bias) as its parts' names and rows;
    any other weight as itself."""
    m = _PREFUSED.match(hf_name)
    if m is None:
        return [(hf_name, tensor)]
    prefix, module, suffix = m.groups()
    if module.endswith("query_key_value"):  # GPT-NeoX: each head's q, k and v rows in turn ([heads, 3, head_dim])
        heads, hd = arch.num_heads, arch.head_dim
        if tensor.shape[0] != 3 * heads * hd:
            raise ValueError(f"weight {hf_name!r} has {tensor.shape[0]} rows; the config's 3 x {heads} heads x "
                             f"{hd} make {3 * heads * hd}")
        by_head = tensor.reshape(heads, 3, hd, *tensor.shape[1:])
        return [(f"{prefix}self_attn.{part}.{suffix}", by_head[:, i].reshape(heads * hd, *tensor.shape[1:]))
                for i, part in enumerate(("q_proj", "k_proj", "v_proj"))]
    if module.endswith("qkv_proj"):
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        parts, sizes = ("q_proj", "k_proj", "v_proj"), (q, kv, kv)
    else:
        parts, sizes = ("gate_proj", "up_proj"), (arch.intermediate_size,) * 2
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"weight {hf_name!r} has {tensor.shape[0]} rows; the config's "
                         f"{' + '.join(parts)} make {sum(sizes)}")
    scope = prefix + module.split(".")[0] + "."
    return [(f"{scope}{part}.{suffix}", rows) for part, rows in zip(parts, tensor.split(sizes))]


# A multimodal checkpoint's language model tensors, by the names a text checkpoint gives them
# (published: language_model.model.*, language_model.lm_head; transformers 5 in memory:
# model.language_model.*; Qwen2-VL's: model.* and lm_head as a text checkpoint's); the rest
# (vision tower, projector) is not read.
_LANGUAGE_MODEL = re.compile(r"^(?:language_model\.(model\.|lm_head\.)|model\.language_model\.|(lm_head\.))(.*)$")
_NOT_TEXT = re.compile(r"^(?:model\.)?(?:visual|vision_tower|vision_model|multi_modal_projector|mm_projector)\.")


def _language_model_name(name: str) -> str | None:
    m = _LANGUAGE_MODEL.match(name)
    if m is not None:
        return (m.group(1) or m.group(2) or "model.") + m.group(3)
    if name.startswith("model.") and not _NOT_TEXT.match(name):  # already its text name (Qwen2-VL's)
        return name
    return None


class _RenamedWeights:
    """One shard under the names the loader reads (safe_open's interface): canonical_name's, and a
    multimodal checkpoint's language model tensors under their text names (the rest left out)."""

    def __init__(self, f, language_model: bool) -> None:
        self.f = f
        rename = _language_model_name if language_model else str
        self.names = {canonical: name for name in f.keys()
                      if (new := rename(name)) is not None and (canonical := canonical_name(new)) is not None}

    def keys(self) -> list[str]:
        return list(self.names)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.f.get_tensor(self.names[name])

    def get_slice(self, name: str):
        return self.f.get_slice(self.names[name])


@contextlib.contextmanager
def open_weights(file: str, hf_config: dict):
    """A safetensors shard (safe_open, on the CPU) under the names the loader reads (_RenamedWeights)."""
    with safe_open(file, framework="pt", device="cpu") as f:
        yield _RenamedWeights(f, serves_language_model_of(hf_config))


def check_architecture(hf_config: dict) -> str:
    archs = hf_config.get("architectures") or []
    for name in archs:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    shown = ", ".join(archs) or f"model_type={hf_config.get('model_type')!r}"
    raise ValueError(f"unsupported model architecture {shown}; pdserve supports "
                     f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")


def resolve_max_model_len(hf_config: dict, wanted: int | None) -> int:
    """The served context: `wanted` (--max-model-len; None: the checkpoint's), within the model's limit."""
    arch = LlamaArch.from_hf_config(hf_config)
    limit = arch.max_position_embeddings
    if arch.rope["rope_type"] == "yarn":  # YaRN extends the pretraining context by its factor (vLLM's rule)
        limit = max(limit, int(arch.rope["original_max_position_embeddings"] * float(arch.rope.get("factor") or 1.0)))
    if wanted is None:
        return limit
    if wanted > limit:
        raise ValueError(f"max_model_len={wanted} exceeds the model's limit of {limit} tokens")
    return wanted


def resolve_dtype(name: str, hf_config: dict) -> torch.dtype:
    if name == "auto":
        name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    return _DTYPES[name]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for --kv-cache-dtype `name` (auto: the model's)."""
    from engine.config import KV_CACHE_DTYPES

    stored = KV_CACHE_DTYPES[name]
    return model_dtype if stored is None else getattr(torch, stored)


def _shard_sizes(module: torch.nn.Module, name: str) -> list[int]:
    """The rows of each part of a fused projection (a plain MLP's gate_up_proj: no gate rows)."""
    if name == "qkv_proj":
        return [module.q_size, module.kv_size, module.kv_size]
    return list(module.gate_up_sizes)


def safetensors_files(path: str) -> list[str]:
    """The checkpoint's weight files, in name order; FileNotFoundError when it has none."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path!r}")
    return files


def load_model(path: str, hf_config: dict, kernels: KernelBackend, dtype: torch.dtype,
               device: torch.device | str = "cpu", show_progress: bool = False, tp=None,
               linear_backend: str = "auto", quantized_weights: str = "dequantize",
               max_model_len: int | None = None) -> LlamaForCausalLM:
    """tp (an engine.parallel TPGroup): load only this rank's shard, sliced in the file.
    max_model_len: the served context, which picks LongRoPE's table (None: the checkpoint's).
    linear_backend (kernels.cpu_linear): on the CPU, "auto" packs the linear weights for oneDNN.
    quantized_weights: a quantized checkpoint's weights "dequantize"d to `dtype` as they load, or
    kept as stored ("keep": 8-bit and packed 4-bit projections, kernels.quant_linear)."""
    check_architecture(hf_config)
    arch = LlamaArch.from_hf_config(hf_config)
    quant = check_quantization(hf_config)
    files = safetensors_files(path)
    companions = _companions(files, quant, hf_config) if quant is not None else {}
    if quantized_weights not in QUANTIZED_WEIGHTS:
        raise ValueError(f"quantized_weights must be one of {', '.join(QUANTIZED_WEIGHTS)}, got {quantized_weights!r}")
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, kernels, tp)
        kept, kept_experts = _keep_quantized(model, quant, companions, kernels, torch.device(device)) \
            if quantized_weights == "keep" else ({}, {})
    if quant is not None and not kept and not kept_experts:
        logger.info("%s checkpoint: weights dequantized as they load (activations not quantized)", quant.describe())
    model = model.to_empty(device=device).to(dtype)
    for module in [*kept.values(), *kept_experts.values()]:
        module.allocate(torch.device(device))
    # Buffers made on the meta device hold no data: compute the rotary table for real.
    model.cos_sin = rope_table(arch, max_model_len).to(device)
    if arch.rope_local is not None:
        model.cos_sin_local = rope_table(arch, max_model_len, arch.rope_local).to(device)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    kv_scales: dict[int, dict[str, float | torch.Tensor]] = {}
    unused_scales: set[str] = set()
    for i, file in enumerate(files):
        if show_progress:
            print(f"\rloading weights: shard {i + 1}/{len(files)}", end="", file=sys.stderr, flush=True)
        with open_weights(file, hf_config) as f:
            for hf_name in f.keys():
                kv = _KV_SCALE.match(hf_name)
                if kv is not None:  # a calibrated KV cache's scale (an fp8 cache's: Attention.kv_scales)
                    _read_kv_scale(kv_scales, hf_name, kv, f.get_tensor(hf_name))
                    continue
                if _FP8_ATTENTION_SCALE.match(hf_name):
                    unused_scales.add("prob_scale" if ".prob_" in hf_name else "q_scale")
                    continue
                expert = _EXPERT.match(quant.main_name(hf_name).removeprefix("model.")) \
                    if kept_experts and not quant.is_companion(hf_name) else None
                if expert is not None and expert.group(1) in kept_experts and expert.group(2) is not None:
                    _load_kept_expert(kept_experts[expert.group(1)], quant, hf_name, expert, f.get_tensor(hf_name),
                                      companions, tp)
                    continue
                if kept and hf_name.endswith((".weight", ".weight_packed", ".qweight")) and \
                        _target(hf_name)[0] in kept:  # a kept projection's weight (its bias loads as any)
                    module_name = hf_name.rsplit(".", 1)[0]
                    target, shard = _target(hf_name)
                    linear = kept[target]
                    w = _kept_shard(quant, module_name, f.get_tensor(hf_name), companions.get(module_name, {}),
                                    linear.in_features, tp)
                    start = 0 if shard is None else sum(_shard_sizes(model.get_submodule(target.rsplit(".", 1)[0]),
                                                                     target.rsplit(".", 1)[1])[:shard])
                    linear.load_rows(start, w.q, w.scale, w.zero)
                    continue
                if quant is not None:
                    if not quant.is_companion(hf_name):
                        tensor = quant.dequantize(hf_name, f.get_tensor(hf_name),
                                                  companions.get(hf_name.rsplit(".", 1)[0], {}), dtype)
                        # dequantized whole (its scales' grid is the whole weight's), then split
                        _load_parts(model, params, quant.main_name(hf_name), tensor, arch, tp, loaded)
                    continue
                if _PREFUSED.match(hf_name):  # read whole, then as its parts (a rank's rows of each)
                    _load_parts(model, params, hf_name, f.get_tensor(hf_name), arch, tp, loaded)
                    continue
                tensor = f.get_tensor(hf_name) if tp is None else tp.layout.read(hf_name, f.get_slice(hf_name))
                if tensor is not None:
                    _load_one(model, params, hf_name, tensor, loaded)
    if show_progress:
        print(file=sys.stderr)
    if unused_scales:
        logger.info("the checkpoint's %s (FP8 attention's) are not used: attention takes queries and "
                    "probabilities in %s, not rounded to fp8 (vLLM uses them only on its FP8-attention backends)",
                    " and ".join(sorted(unused_scales)), str(dtype).removeprefix("torch."))
    if arch.tie_word_embeddings or "lm_head.weight" not in loaded:
        model.lm_head.weight = model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = [n for n in params if n not in loaded and not n.endswith((".mlp.w13", ".mlp.w2"))]
    missing += [part for n, p in params.items() if n.endswith((".mlp.w13", ".mlp.w2"))
                for part in _expert_parts(n, p.shape[0]) if part not in loaded]
    missing += [f"{name}.weight" for name, m in kept.items() if m.rows_loaded != m.out_features]
    missing += [f"{layer}.mlp.{part}" for layer, m in kept_experts.items() for stack in ("w13", "w2")
                for part in _expert_parts(stack, m.num_experts) if part not in m.loaded_parts]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights: {', '.join(missing[:6])}")
    del params
    for i, scales in kv_scales.items():
        if i >= len(model.layers):
            raise ValueError(f"KV cache scales for layer {i}, but the model has {len(model.layers)} layers")
        model.layers[i].self_attn.set_kv_scales(*(_kv_scale_of(scales.get(part, 1.0), arch, tp, path, i)
                                                  for part in ("k", "v")), dtype, torch.device(device))
    pack_linears(model, linear_backend)
    return model.eval()


QUANTIZED_WEIGHTS = ("dequantize", "keep")


def _load_expert(params, hf_name: str, match: re.Match, tensor: torch.Tensor, loaded: set[str]) -> None:
    """One expert's projection into its layer's stacked w13 / w2 (or a stacked one whole)."""
    layer, index, proj, stacked = match.groups()
    if stacked is not None:
        target = f"{layer}.mlp.{'w13' if stacked == 'gate_up_proj' else 'w2'}"
        if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"weight {hf_name!r}: stacked experts stored as {tensor.dtype} are not read (a quantized "
                             "checkpoint's experts are read one expert a tensor, as published)")
        if target not in params or params[target].shape != tensor.shape:
            raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(params[target].shape) if target in params else 'no such weight (a dense layer)'}")
        with torch.no_grad():
            params[target].copy_(tensor)
        experts = params[target].shape[0]
        loaded.update(_expert_parts(target, experts))
        return
    if proj not in _EXPERT_SHARD:
        raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
    param, shard = _EXPERT_SHARD[proj]
    target = f"{layer}.mlp.{param}"
    if target not in params:
        raise ValueError(f"unexpected weight {hf_name!r} in checkpoint (layer {layer} is dense here)")
    e = int(index)
    stack = params[target]
    if e >= stack.shape[0]:
        raise ValueError(f"weight {hf_name!r}: expert {e}, but the config has {stack.shape[0]} experts")
    rows = stack[e] if shard is None else stack[e].chunk(2)[shard]
    if rows.shape != tensor.shape:
        raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(rows.shape)}")
    with torch.no_grad():
        rows.copy_(tensor)
    loaded.add(f"{target}[{e}]" + ("" if shard is None else f".{shard}"))


def _kept_shard(quant: QuantizedWeights, module: str, stored: torch.Tensor, companions: dict[str, torch.Tensor],
                in_features: int, tp) -> KeptWeight:
    """--quantized-weights keep: a stored weight as the kept linear reads it (quant.kept), and
    under tensor parallelism this rank's rows or columns of it (in_features: the rank's)."""
    split = None if tp is None else tp.layout.split_of(module + ".weight")
    if split is None:
        return quant.kept(module, stored, companions, in_features)
    dim, start, end = split
    whole = in_features * tp.layout.size if dim == 1 else in_features  # row parallel: a rank's share of the columns
    return quant.kept(module, stored, companions, whole).part(dim, start, end, module)


def _load_kept_expert(moe, quant: QuantizedWeights, hf_name: str, match: re.Match, stored: torch.Tensor,
                      companions: dict, tp) -> None:
    """--quantized-weights keep: one expert's 8-bit projection and its scales into the layer's stacks."""
    _, index, proj, _ = match.groups()
    if proj not in _EXPERT_SHARD:
        raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
    stack, shard = _EXPERT_SHARD[proj]
    module = hf_name.rsplit(".", 1)[0]
    in_features = moe.gate.in_features if stack == "w13" else moe.intermediate_size
    w = _kept_shard(quant, module, stored, companions.get(module, {}), in_features, tp)
    if w.zero is not None:
        raise ValueError(f"{module}: kept experts have no zero points (use --quantized-weights dequantize)")
    moe.load_8bit(int(index), stack, shard, w.q, w.scale, hf_name)


def _expert_parts(target: str, experts: int) -> list[str]:
    """What `loaded` must hold for a stacked expert weight to be complete."""
    if target.endswith("w13"):
        return [f"{target}[{e}].{s}" for e in range(experts) for s in (0, 1)]
    return [f"{target}[{e}]" for e in range(experts)]


def _target(hf_name: str) -> tuple[str, int | None]:
    """A checkpoint weight's module here, and its shard in a fused one (None: the whole)."""
    name = hf_name.removeprefix("model.").rsplit(".", 1)[0]
    for frag, (fused, shard) in _FUSED.items():
        if name.endswith(f".{frag}"):
            return name[:-len(frag)] + fused, shard
    return name, None


def _keep_quantized(model, quant: QuantizedWeights | None, companions: dict, kernels: KernelBackend,
                    device: torch.device) -> dict:
    """--quantized-weights keep: each attention and MLP projection the checkpoint quantized becomes
    a QuantizedLinear (on the meta device, before anything is allocated); {module name: it}. The
    LM head, quantized or not, is dequantized (a tied one is the embedding's)."""
    from kernels.quant_linear import QuantizedLinear

    if quant is None:
        raise ValueError("--quantized-weights keep: the checkpoint is not quantized")
    shards: dict[str, set] = {}
    experts: dict[str, list[str]] = {}  # layer -> its quantized expert modules
    for module in companions:
        target, shard = _target(module + ".weight")
        if ".experts." in target:
            experts.setdefault(target.split(".mlp.")[0].split(".block_sparse_moe.")[0], []).append(module)
            continue
        if target.rsplit(".", 1)[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            shards.setdefault(target, set()).add(shard)
    kept = {}
    for target, have in sorted(shards.items()):
        linear = model.get_submodule(target)
        fused = target.rsplit(".", 1)[1]
        need = {None} if fused not in ("qkv_proj", "gate_up_proj") else \
            {i for i, rows in enumerate(_shard_sizes(model.get_submodule(target.rsplit(".", 1)[0]), fused)) if rows}
        if have == {None} and fused in ("qkv_proj", "gate_up_proj") and model.tp is not None:
            raise _fused_kept_under_tp(target)
        if have == {None}:  # stored fused (Phi-3): kept as stored, its rows whole
            need = {None}
        if have != need:
            raise ValueError(f"--quantized-weights keep: {target} is quantized in part (shards {sorted(map(str, have))}); "
                             "use --quantized-weights dequantize")
        parts = [m for m in companions if _target(m + ".weight")[0] == target]
        bits = {quant.bits_of(m) for m in parts}
        kinds = {"fp8" if quant.is_float(m) else "int4" if quant.bits_of(m) == 4 else "int8" for m in parts}
        groups = {quant.group_of(m, linear.in_features) for m in parts}
        if len(kinds) != 1 or len(groups) != 1 or bits - {4, 8}:
            raise ValueError(f"--quantized-weights keep: {target}'s parts are quantized differently ({sorted(kinds)}, "
                             f"groups {sorted(groups)}); use --quantized-weights dequantize")
        kind = kinds.pop()
        if kind == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"--quantized-weights keep: FP8 weights need a GPU of compute capability 8.9 or later "
                             f"(Ada, Hopper); this one is {torch.cuda.get_device_capability(device)}: use "
                             "--quantized-weights dequantize")
        has_zero = any(quant.has_zero_points(companions[m]) for m in parts)
        group = groups.pop()
        # W8A8: FP8 or INT8 activations as the checkpoint quantizes them, where the weight's scales
        # are per channel or tensor (torch._scaled_mm's / _int_mm's row-wise scaling); block-scaled
        # FP8 and grouped INT8 run W8A16.
        acts = {quant.activations_of(m) for m in parts}
        if len(acts) > 1:
            logger.warning("%s: its shards quantize activations differently (%s): served W8A16", target,
                           sorted(map(str, acts)))
        activations = acts.pop() if kind in ("fp8", "int8") and group == linear.in_features and len(acts) == 1 and \
            not has_zero else None
        input_scale = None
        if activations == "static":  # one input for the fused shards: the largest of their scales, as vLLM
            scales = [companions[m].get("input_scale") for m in parts]
            if any(s is None for s in scales):
                raise ValueError(f"{target}: static {kind.upper()} activations without an input_scale in the checkpoint")
            input_scale = max(float(s.float().max()) for s in scales)
        parent, _, child = target.rpartition(".")
        kept[target] = QuantizedLinear(linear.in_features, linear.out_features, kind, group,
                                       linear.bias is not None, use_triton=kernels.name == "triton", has_zero=has_zero,
                                       activations=activations, input_scale=input_scale,
                                       activation_ub=quant.activation_ub_of(parts[0]) if activations else None)
        setattr(model.get_submodule(parent), child, kept[target])
    kept_experts = {}
    for layer, modules in sorted(experts.items()):
        moe = model.get_submodule(f"{layer}.mlp") if int(layer.split(".")[1]) < len(model.layers) else None
        if not isinstance(moe, SparseMoE):
            raise ValueError(f"unexpected weight {modules[0]!r} in checkpoint (layer {layer} is dense here)")
        why = _why_experts_not_kept(moe, quant, modules, companions)
        if why is not None:
            logger.warning("--quantized-weights keep: %s's experts are dequantized as they load (%s): they take "
                           "--dtype's memory", layer, why)
            continue
        kind = "fp8" if quant.is_float(modules[0]) else "int8"
        if kind == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"--quantized-weights keep: FP8 experts need a GPU of compute capability 8.9 or later; "
                             f"this one is {torch.cuda.get_device_capability(device)}: use --quantized-weights dequantize")
        hidden, inter = moe.gate.in_features, moe.intermediate_size
        g13 = {quant.group_of(m, hidden) for m in modules if not _is_down(m)}.pop()
        g2 = {quant.group_of(m, inter) for m in modules if _is_down(m)}.pop()
        moe.keep_8bit(kind, -(-hidden // g13), -(-inter // g2))
        kept_experts[layer] = moe
    w8a8 = sum(1 for m in kept.values() if m.activations is not None)
    logger.info("%s checkpoint: %d projections kept as stored (%d W8A8 through torch._scaled_mm / _int_mm; the rest "
                "%s)%s",
                quant.describe(), len(kept), w8a8,
                "through the fused Triton kernel" if kernels.name == "triton" else "dequantized per call",
                f"; the experts of {len(kept_experts)} layers kept as stored (W8A16)" if kept_experts else "")
    return kept, kept_experts


def _fused_kept_under_tp(module: str) -> ValueError:
    return ValueError(f"--quantized-weights keep: the checkpoint stores {module} fused (Phi-3's form); under tensor "
                      "parallelism it is read through --quantized-weights dequantize")


def check_keep_under_tp(path: str, hf_config: dict, quantized_weights: str, tp_size: int) -> None:
    """Before any worker starts: a kept quantized projection stored fused cannot be split by rank
    (its parts' rows interleave in each rank's share), so keep under TP is refused for it by name."""
    quant = QuantizedWeights.from_hf_config(hf_config)
    if quant is None or quantized_weights != "keep" or tp_size == 1:
        return
    for file in safetensors_files(path):
        with open_weights(file, hf_config) as f:
            for name in f.keys():
                module = name.rsplit(".", 1)[0]
                if quant.is_companion(name) and _PREFUSED.match(module + ".weight"):
                    raise _fused_kept_under_tp(module.removeprefix("model."))


def _is_down(module: str) -> bool:
    return module.endswith((".down_proj", ".w2"))


def _why_experts_not_kept(moe, quant: QuantizedWeights, modules: list[str], companions: dict) -> str | None:
    """None when a layer's experts can be kept in 8 bits (the fused MoE kernel's W8A16): every
    expert's three projections quantized, all FP8 or all INT8, without zero points, one column
    group width for gate and up and one for down; else why not."""
    if len(modules) != 3 * moe.num_experts:
        return f"{len(modules)} of its {3 * moe.num_experts} expert projections are quantized"
    kinds = {("fp8" if quant.is_float(m) else "int8") if quant.bits_of(m) == 8 else f"{quant.bits_of(m)}-bit"
             for m in modules}
    if len(kinds) != 1 or not kinds <= {"fp8", "int8"}:
        return f"kept experts are 8-bit FP8 or INT8, these are {', '.join(sorted(kinds))}"
    if any(quant.has_zero_points(companions[m]) for m in modules):
        return "zero points"
    hidden, inter = moe.gate.in_features, moe.intermediate_size
    up_groups = {quant.group_of(m, hidden) for m in modules if not _is_down(m)}
    down_groups = {quant.group_of(m, inter) for m in modules if _is_down(m)}
    if len(up_groups) != 1 or len(down_groups) != 1:
        return "its experts' column groups differ"
    if hidden % up_groups.pop() or inter % down_groups.pop():  # the kernels take ceil(K / groups) as the width
        return "column groups that do not divide the rows"
    if quant.method in ("awq", "gptq"):
        return f"{quant.method} experts"
    return None


def check_quantization(hf_config: dict, requested: str | None = None) -> QuantizedWeights | None:
    """A quantized checkpoint's scheme (None: not quantized); ValueError, at start, for what is
    not served. `requested`: vLLM's --quantization, which must name the checkpoint's method."""
    quant = QuantizedWeights.from_hf_config(hf_config)
    if requested is not None and requested.lower() != (quant.method if quant is not None else None):
        if quant is None:
            raise ValueError(f"--quantization {requested}: the checkpoint is not quantized, and pdserve does not "
                             "quantize weights as they load; serve a quantized checkpoint (its quantization_config "
                             "is read), or leave --quantization out")
        raise ValueError(f"--quantization {requested} does not match the checkpoint's quant_method "
                         f"{quant.method!r}; leave it out to read the checkpoint's")
    scheme = (hf_config.get("quantization_config") or {}).get("kv_cache_scheme")
    if scheme and (scheme.get("type", "float") != "float" or scheme.get("num_bits") != 8
                   or scheme.get("strategy", "tensor") not in ("tensor", "attn_head") or scheme.get("dynamic")):
        raise ValueError(f"the checkpoint's kv_cache_scheme {scheme} is not served: its KV cache scales are read "
                         "as static FP8 ones, one a layer or one a KV head (vLLM's), used with --kv-cache-dtype fp8")
    return quant


def _companions(files: list[str], quant: QuantizedWeights, hf_config: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Every quantized weight's scales (and zero points, shapes), by module, from any shard."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for file in files:
        with open_weights(file, hf_config) as f:
            for name in f.keys():
                if quant.is_companion(name):
                    module, suffix = name.rsplit(".", 1)
                    found.setdefault(module, {})[suffix] = f.get_tensor(name)
    return found


# A calibrated KV cache's scales (per layer, or per KV head), by the names vLLM reads: llm-compressor's
# self_attn.k_scale / v_scale (also under attn. or qkv_proj.), k_proj.k_scale / v_proj.v_scale,
# older checkpoints' k_proj.output_scale / v_proj.output_scale, and the deprecated kv_scale (both).
_KV_SCALE = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.(?:(?:attn\.|qkv_proj\.)?(?P<own>[kv])_scale"
                       r"|(?P<k>k)_proj\.(?:output|k)_scale|(?P<v>v)_proj\.(?:output|v)_scale|(?P<both>kv)_scale)$")

# FP8 attention's other scales (llm-compressor's attention scheme, ModelOpt's; q_proj.output_scale
# and prob_output_scale as vLLM's fp8 and Quark configs name them): the query's and the softmax
# probabilities'. Attention here takes queries in the model's dtype, so they are not used.
_FP8_ATTENTION_SCALE = re.compile(r"^(?:model\.)?layers\.\d+\.self_attn\.(?:(?:attn\.|qkv_proj\.)?(?:q|prob)_scale"
                                  r"|q_proj\.(?:q|output)_scale|prob_output_scale)$")


def _read_kv_scale(found: dict[int, dict[str, float | torch.Tensor]], hf_name: str, match: re.Match,
                   tensor: torch.Tensor) -> None:
    """A K or V dequantization scale (the cache holds fp8(k / k_scale)): one a layer, or one a KV
    head (llm-compressor's attn_head strategy; their count is checked against the model's after)."""
    values = tensor.float().reshape(-1)
    bad = values[~((values > 0) & (values < float("inf")))]
    if bad.numel() or not values.numel():
        raise ValueError(f"{hf_name!r}: a KV cache scale must be a finite number > 0, got "
                         f"{float(bad[0]) if bad.numel() else 'none'}")
    value = float(values[0]) if values.numel() == 1 else values
    which = match.group("own") or match.group("k") or match.group("v") or "kv"
    for part in ("k", "v") if which == "kv" else (which,):
        found.setdefault(int(match.group(1)), {})[part] = value


def _kv_scale_of(value: float | torch.Tensor, arch: LlamaArch, tp, path: str, layer: int) -> float | torch.Tensor:
    """A layer's K or V scale for this rank: a float, or its KV heads' slice of a per-head one."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() != arch.num_kv_heads:
        raise ValueError(f"checkpoint {path!r}: layer {layer} has {value.numel()} KV cache scales; one a layer, or "
                         f"one a KV head ({arch.num_kv_heads}), are read (per channel is not served)")
    if tp is None:
        return value
    start = tp.layout.kv_head_start
    return value[start:start + tp.layout.local_kv_heads]


def has_kv_scales(model) -> bool:
    """Whether the checkpoint gave the model calibrated KV cache scales."""
    return any(layer.self_attn.has_kv_scales for layer in model.layers)


def _load_one(model, params, hf_name: str, tensor: torch.Tensor, loaded: set[str]) -> None:
    name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
    if "rotary_emb" in name:
        return
    expert = _EXPERT.match(hf_name.removeprefix("model."))
    if expert is not None:
        return _load_expert(params, hf_name, expert, tensor, loaded)
    for frag, (fused, shard) in _FUSED.items():
        if f".{frag}." in name:
            target = name.replace(f".{frag}.", f".{fused}.")
            if target not in params:  # e.g. a dense layer's MLP where the config makes the layer sparse
                raise ValueError(f"unexpected weight {hf_name!r} in checkpoint (does its config match its weights?)")
            module = model.get_submodule(target.rsplit(".", 2)[0])
            sizes = _shard_sizes(module, fused)
            start = sum(sizes[:shard])
            with torch.no_grad():
                params[target][start:start + sizes[shard]].copy_(tensor)
            loaded.add(target)  # complete once every shard is copied; shapes are checked by copy_
            return
    if name not in params:
        raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
    with torch.no_grad():
        if params[name].shape != tensor.shape:
            raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(params[name].shape)}")
        params[name].copy_(tensor)
    loaded.add(name)
