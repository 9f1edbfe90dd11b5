"""A multimodal checkpoint served as its language model (Gemma 3, Mistral 3, LLaVA, Qwen2.5-VL and
Qwen3-VL: text in, text out): its text config read as transformers fills it in, its language model's weights under
their text names, the vision tower and projector left unread; greedy answers token-exact against
transformers' multimodal model given the same text."""
from __future__ import annotations

import json
import os

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import language_model_config
from test_hf_exact import Reference, mixed_prompts, run


@pytest.fixture(scope="module")
def gemma3_multimodal(tmp_path_factory, tiny_model_factory) -> str:
    import shutil

    import transformers

    text = tiny_model_factory("gemma3_text", config={"sliding_window": 40})
    with open(os.path.join(text, "config.json")) as f:
        text_config = {k: v for k, v in json.load(f).items() if k not in ("architectures", "transformers_version")}
    config = transformers.Gemma3Config(
        text_config=text_config, mm_tokens_per_image=4,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14))
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # transformers starts them at zero: 1 + 0 would hide the offset
                param.normal_(0.0, 0.1)
    path = str(tmp_path_factory.mktemp("gemma3-multimodal"))
    model.save_pretrained(path)
    for name in os.listdir(text):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(text, name), path)
    return path


def test_its_language_model_answers_as_transformers_multimodal_model(gemma3_multimodal):
    with open(os.path.join(gemma3_multimodal, "config.json")) as f:
        stored = json.load(f)
    assert stored["architectures"] == ["Gemma3ForConditionalGeneration"] and "vision_config" in stored
    config = language_model_config(stored)
    assert config["model_type"] == "gemma3_text" and config["num_hidden_layers"] == 2
    ref = Reference(gemma3_multimodal)
    assert type(ref.model).__name__ == "Gemma3ForConditionalGeneration"
    prompts = mixed_prompts(config["vocab_size"])
    llm = LLM(gemma3_multimodal, max_num_batched_tokens=64)
    assert run(llm, prompts) == [ref.generate(p) for p in prompts]
    assert not any("vision" in name or "projector" in name for name, _ in llm.engine.runner.model.named_parameters())


def test_a_published_sparse_text_config_gets_transformers_defaults():
    """gemma-3-4b-it's text_config names six keys; the rest are Gemma3TextConfig's defaults."""
    config = language_model_config({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model"}})
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 4, 256)
    assert config["vocab_size"] == 262208 and config["query_pre_attn_scalar"] == 256
    assert config["torch_dtype"] == "bfloat16" and config["architectures"] == ["Gemma3ForConditionalGeneration"]
    from engine.models.llama import LlamaArch

    arch = LlamaArch.from_hf_config(config)
    assert arch.rope["rope_type"] == "linear" and arch.rope["factor"] == 8.0 and arch.rope_local["rope_theta"] == 10000.0
    assert arch.layer_windows[:6] == (1024,) * 5 + (0,)


# Other multimodal checkpoints whose language model is a served family: (the text model's tiny
# architecture, its config, the vision config), small.
VISION_LANGUAGE = {
    "Mistral3ForConditionalGeneration": ("mistral", {}, dict(
        model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14, head_dim=16)),
    "LlavaForConditionalGeneration": ("qwen2", {}, dict(
        model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, image_size=28, patch_size=14)),
    # Qwen2.5-VL / Qwen3-VL: their multimodal rotary sections (all one position for text).
    "Qwen2_5_VLForConditionalGeneration": ("qwen2", {"model_type": "qwen2_5_vl_text", "rope_parameters": {
        "rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}}, dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[0])),
    "Qwen3VLForConditionalGeneration": ("qwen3", {"model_type": "qwen3_vl_text", "rope_parameters": {
        "rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True, "rope_theta": 10000.0}},
        dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
             deepstack_visual_indexes=[0], num_position_embeddings=16)),
}


def _vision_language_model(arch: str, tmp_path_factory, tiny_model_factory) -> str:
    """A tiny vision-language checkpoint as transformers saves it, its language model a tiny text
    model's config with random weights, and that model's tokenizer."""
    import shutil

    import transformers

    text_arch, text_overrides, vision = VISION_LANGUAGE[arch]
    text = tiny_model_factory(text_arch)
    with open(os.path.join(text, "config.json")) as f:
        text_config = {k: v for k, v in json.load(f).items() if k not in ("architectures", "transformers_version")}
    text_config.update(text_overrides)
    config_cls = getattr(transformers, arch.replace("ForConditionalGeneration", "Config"))
    config = config_cls(text_config=text_config, vision_config=vision)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).to(torch.float32)
    path = str(tmp_path_factory.mktemp(arch))
    model.save_pretrained(path)
    for name in os.listdir(text):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(text, name), path)
    return path


@pytest.mark.parametrize("arch", list(VISION_LANGUAGE))
def test_vision_language_checkpoints_answer_as_their_multimodal_model(arch, tmp_path_factory, tiny_model_factory):
    """Served as their language model, token-exact against transformers' multimodal model given the
    same text (greedy, run on past an end token as ignore_eos), no vision weight read."""
    import transformers

    path = _vision_language_model(arch, tmp_path_factory, tiny_model_factory)
    with open(os.path.join(path, "config.json")) as f:
        stored = json.load(f)
    assert stored["architectures"] == [arch] and "vision_config" in stored
    ref = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    config = language_model_config(stored)
    prompts = mixed_prompts(config["vocab_size"])[:6]
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                               pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    llm = LLM(path, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    names = [name for name, _ in llm.engine.runner.model.named_parameters()]
    assert not any("vision" in n or "visual" in n or "projector" in n for n in names)


def test_qwen25_vls_first_flat_config_form_is_read():
    """Qwen2.5-VL's config.json as published: the language model's keys at the top level, its
    multimodal rotary as rope_scaling {"type": "mrope"}."""
    config = language_model_config({
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "torch_dtype": "bfloat16",
        "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
        "num_key_value_heads": 2, "vocab_size": 151936, "rope_theta": 1000000.0, "max_position_embeddings": 128000,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "tie_word_embeddings": True,
        "vision_config": {"depth": 32, "hidden_size": 1280, "out_hidden_size": 2048}})
    assert config["model_type"] == "qwen2_5_vl_text" and config["num_hidden_layers"] == 36
    from engine.models.llama import LlamaArch

    arch = LlamaArch.from_hf_config(config)
    assert (arch.hidden_size, arch.num_kv_heads, arch.head_dim) == (2048, 2, 128)
    assert arch.rope["rope_type"] == "default" and arch.rope["rope_theta"] == 1000000.0
    assert arch.qkv_bias and not arch.o_bias and arch.tie_word_embeddings and arch.layer_windows == (0,) * 36
