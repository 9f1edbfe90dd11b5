"""A multimodal checkpoint served as its language model (Gemma3ForConditionalGeneration: text in,
text out): its text config read as transformers fills it in, its language model's weights under
their text names, the vision tower and projector left unread; greedy answers token-exact against
transformers' multimodal model given the same text."""
from __future__ import annotations

import json
import os

import pytest
import torch

from engine import LLM
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
