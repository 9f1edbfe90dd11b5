"""Mixtures of experts beyond greedy exactness (tests/engine/test_hf_exact.py has that): the
checkpoint forms they come in, what a broken one says, FP8 experts, and what is refused."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from test_quantized_checkpoints import FP8_MAX, PROMPTS, pdserve_greedy, transformers_greedy


@pytest.fixture(scope="module")
def qwen3_moe(tiny_model_factory) -> str:
    return tiny_model_factory("qwen3_moe", moe_config={"norm_topk_prob": True})


def _rewrite(path: str, out: str, tensors: dict, config: dict | None = None) -> str:
    os.makedirs(out)
    for name in os.listdir(path):
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy(os.path.join(path, name), out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    if config is not None:
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f)
    return out


def _stacked(path: str, out: str) -> str:
    """The experts as transformers 5 holds them: one [E, 2I, H] gate-up and one [E, H, I] down
    tensor per layer."""
    tensors = load_file(os.path.join(path, "model.safetensors"))
    layers = {k.split(".experts.")[0] for k in tensors if ".experts." in k}
    for layer in layers:
        experts = sorted({int(k.split(".experts.")[1].split(".")[0]) for k in tensors if k.startswith(layer + ".experts.")})
        take = {p: [tensors.pop(f"{layer}.experts.{e}.{p}.weight") for e in experts]
                for p in ("gate_proj", "up_proj", "down_proj")}
        tensors[f"{layer}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(take["gate_proj"], take["up_proj"])])
        tensors[f"{layer}.experts.down_proj"] = torch.stack(take["down_proj"])
    return _rewrite(path, out, tensors)


def test_stacked_experts_load_as_per_expert_ones(qwen3_moe, tmp_path):
    assert pdserve_greedy(_stacked(qwen3_moe, str(tmp_path / "stacked"))) == pdserve_greedy(qwen3_moe) == \
        transformers_greedy(qwen3_moe)


def test_a_missing_expert_is_named(qwen3_moe, tmp_path):
    tensors = load_file(os.path.join(qwen3_moe, "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks weights: layers\.1\.mlp\.w13\[5\]\.1"):
        LLM(_rewrite(qwen3_moe, str(tmp_path / "broken"), tensors))


def test_an_expert_beyond_the_configs_count_is_refused(qwen3_moe, tmp_path):
    with open(os.path.join(qwen3_moe, "config.json")) as f:
        config = json.load(f)
    config["num_experts"] = config.pop("num_local_experts", config.get("num_experts")) - 1
    tensors = load_file(os.path.join(qwen3_moe, "model.safetensors"))
    with pytest.raises(ValueError, match="expert 7, but the config has 7 experts"):
        LLM(_rewrite(qwen3_moe, str(tmp_path / "fewer"), tensors, config))


def test_routing_more_experts_than_there_are_is_refused(qwen3_moe, tmp_path):
    with open(os.path.join(qwen3_moe, "config.json")) as f:
        config = json.load(f)
    config["num_experts_per_tok"] = 9
    tensors = load_file(os.path.join(qwen3_moe, "model.safetensors"))
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) must be between 1 and the experts \(8\)"):
        LLM(_rewrite(qwen3_moe, str(tmp_path / "k9"), tensors, config))


@pytest.mark.parametrize("quantized_weights", ["dequantize", "keep"])
def test_fp8_experts_answer_as_their_dequantized_weights(qwen3_moe, quantized_weights, tmp_path):
    """Every projection block-scaled FP8 (quant_method fp8, 32x32 blocks): the attention's kept
    (W8A16) or dequantized, the experts always dequantized into their stacks."""
    tensors = load_file(os.path.join(qwen3_moe, "model.safetensors"))
    quantized, dense = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            rows, cols = w.shape
            grid = (w.view(rows // 32, 32, cols // 32, 32).abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
            full = grid.repeat_interleave(32, 0).repeat_interleave(32, 1)
            q = (w / full).to(torch.float8_e4m3fn)
            quantized[name], quantized[name + "_scale_inv"] = q, grid.float()
            dense[name] = q.float() * full
    with open(os.path.join(qwen3_moe, "config.json")) as f:
        config = json.load(f)
    reference = transformers_greedy(_rewrite(qwen3_moe, str(tmp_path / "dense"), dense))
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [32, 32]}
    path = _rewrite(qwen3_moe, str(tmp_path / "fp8"), quantized, config)
    llm = LLM(path, quantized_weights=quantized_weights)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == reference
    moe = llm.engine.runner.model.layers[0].mlp
    if quantized_weights == "keep":  # one byte an expert weight, a float32 scale per row and 32 columns
        assert moe.w13.dtype == moe.w2.dtype == torch.float8_e4m3fn
        assert moe.w13_scale.shape == (8, 128, 2) and moe.w2_scale.shape == (8, 64, 2)
    else:
        assert moe.w13.dtype == torch.float32 and moe.w13_scale is None


@pytest.mark.parametrize("kind,strategy", [("int", "channel"), ("float", "channel"), ("int", "group")])
def test_compressed_tensors_experts_kept_answer_as_dequantized(qwen3_moe, kind, strategy, tmp_path, caplog):
    """llm-compressor's 8-bit experts (INT8 / FP8 per channel, INT8 in groups of 32) kept in 8 bits
    answer as the same weights dequantized at load."""
    from test_quantized_checkpoints import compressed

    path = compressed(qwen3_moe, str(tmp_path / "ct"), kind, strategy, bits=8)
    caplog.set_level("INFO")
    kept = LLM(path, quantized_weights="keep")
    moe = kept.engine.runner.model.layers[1].mlp
    assert moe.w13.dtype == (torch.int8 if kind == "int" else torch.float8_e4m3fn)
    assert "the experts of 2 layers kept as stored" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path).generate(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in kept.generate(PROMPTS, params)] == want


def test_4bit_experts_are_dequantized_under_keep_with_a_warning(qwen3_moe, tmp_path, caplog):
    from test_quantized_checkpoints import compressed

    path = compressed(qwen3_moe, str(tmp_path / "w4"), "int", "group", bits=4)
    caplog.set_level("WARNING")
    llm = LLM(path, quantized_weights="keep")
    assert llm.engine.runner.model.layers[0].mlp.w13.dtype == torch.float32
    assert "layers.0's experts are dequantized as they load (kept experts are 8-bit FP8 or INT8, these are 4-bit)" \
        in caplog.text


def test_a_missing_kept_expert_is_named(qwen3_moe, tmp_path):
    from test_quantized_checkpoints import compressed

    path = compressed(qwen3_moe, str(tmp_path / "ct"), "int", "channel", bits=8)
    tensors = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    for k in [k for k in tensors if ".layers.1.mlp.experts.2.down_proj." in k]:
        del tensors[k]
    with pytest.raises(ValueError, match=r"lacks weights: layers\.1\.mlp\.w2\[2\]"):
        LLM(_rewrite(path, str(tmp_path / "broken"), tensors), quantized_weights="keep")


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_adapters_on_a_mixtures_attention(qwen3_moe, tiny_lora_factory, tp, tmp_path):
    """LoRA on a mixture of experts (its attention projections, as most MoE adapters are trained):
    token-exact against transformers + PEFT, beside the base model in one batch, at TP=1 and 2; an
    adapter of a sparse layer's MLP is refused by name (experts take no adapter here)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = tiny_lora_factory(qwen3_moe, 7, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qwen3_moe, dtype=torch.float32),
                                      adapter).eval()
    want = []
    for ids in PROMPTS:
        with torch.no_grad():
            t = torch.tensor([ids])
            gen = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=12, min_new_tokens=12,
                                 do_sample=False)
        want.append(gen[0, len(ids):].tolist())
    llm = LLM(qwen3_moe, enable_lora=True, lora_modules=[f"attn={adapter}"], tensor_parallel_size=tp)
    try:
        params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, lora_name=name)
                  for name in ("attn", None) for _ in PROMPTS]
        outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, params)]
        assert outs[:len(PROMPTS)] == want and outs[len(PROMPTS):] == transformers_greedy(qwen3_moe)
        assert want != outs[len(PROMPTS):]  # the adapter changes the answers
    finally:
        llm.engine.shutdown()
    experts = shutil.copytree(adapter, tmp_path / "experts")
    tensors = load_file(os.path.join(experts, "adapter_model.safetensors"))
    a = next(v for k, v in tensors.items() if "q_proj.lora_A" in k)
    tensors["base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight"] = a.clone()
    tensors["base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight"] = torch.zeros(64, a.shape[0])
    save_file(tensors, os.path.join(experts, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="layer 1's MLP is a mixture of experts; LoRA is served on the attention"):
        LLM(qwen3_moe, enable_lora=True, lora_modules=[f"x={experts}"])
    # PEFT's own form for stacked experts: LoRA on parameters (target_parameters), named as such.
    stacked = shutil.copytree(adapter, tmp_path / "stacked")
    config = json.loads((stacked / "adapter_config.json").read_text())
    (stacked / "adapter_config.json").write_text(json.dumps({**config, "target_parameters": ["gate_up_proj"]}))
    with pytest.raises(ValueError, match=r"target_parameters \['gate_up_proj'\] \(LoRA on parameters, such as a "
                                         "mixture's experts\) is not served"):
        LLM(qwen3_moe, enable_lora=True, lora_modules=[f"x={stacked}"])


def test_what_a_mixture_is_not_served_with_is_refused_at_start(qwen3_moe):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        LLM(qwen3_moe, tensor_parallel_size=3)


def test_an_expert_size_tensor_parallelism_cannot_split_is_named():
    from engine.parallel import check_tensor_parallel_size

    with pytest.raises(ValueError, match="does not divide the model's expert intermediate size 30"):
        check_tensor_parallel_size(4, 8, 4, 64, moe_intermediate_size=30)
    with pytest.raises(ValueError, match="shared expert intermediate size 6"):
        check_tensor_parallel_size(4, 8, 4, 64, moe_intermediate_size=32, shared_expert_intermediate_size=6)


def test_stacked_experts_split_over_two_ranks(qwen3_moe, tmp_path):
    """Each rank reads its slice of the stacked [E, 2I, H] / [E, H, I] tensors: its gate rows and
    its up rows, its down columns."""
    stacked = _stacked(qwen3_moe, str(tmp_path / "stacked"))
    llm = LLM(stacked, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True))] == transformers_greedy(qwen3_moe)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("kind", ["int", "float"])
def test_kept_experts_split_over_two_ranks(qwen3_moe, kind, tmp_path):
    """8-bit experts (INT8 in groups of 32, FP8 per channel) kept under TP=2: each rank holds its
    gate and up rows and its down columns of every expert as stored, with their scales, and
    answers as one rank does."""
    from test_quantized_checkpoints import compressed

    path = compressed(qwen3_moe, str(tmp_path / "ct"), kind, "group" if kind == "int" else "channel", bits=8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, quantized_weights="keep").generate(PROMPTS, params)]
    llm = LLM(path, tensor_parallel_size=2, quantized_weights="keep")
    try:
        moe = llm.engine.runner.model.local.layers[0].mlp
        assert moe.w13.dtype == (torch.int8 if kind == "int" else torch.float8_e4m3fn)
        assert moe.w13.shape == (8, 64, 64) and moe.w2.shape == (8, 64, 32)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
    finally:
        llm.engine.shutdown()


def test_prefill_and_decode_in_one_step_route_each_token_alone(qwen3_moe):
    """A prompt prefilled in chunks beside decoding rows answers as it does alone: routing is per
    token, whatever else the step holds."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = [LLM(qwen3_moe).generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    llm = LLM(qwen3_moe, max_num_batched_tokens=8)
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert together == alone
    llm.engine.check_integrity(expect_all_free=True)


def test_a_config_that_does_not_match_the_weights_is_refused_by_name(qwen3_moe, tmp_path):
    """The config makes every layer dense while the weights hold experts (and the other way)."""
    with open(os.path.join(qwen3_moe, "config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(qwen3_moe, "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.mlp\.experts\.0\..*layer layers\.0 is dense"):
        LLM(_rewrite(qwen3_moe, str(tmp_path / "dense"), tensors, {**config, "mlp_only_layers": [0, 1]}))
    dense = {k: v for k, v in tensors.items() if ".mlp." not in k or not k.startswith("model.layers.1.")}
    dense.update({f"model.layers.1.mlp.{p}_proj.weight": torch.zeros(64, 64) for p in ("gate", "up", "down")})
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.1\.mlp\.(gate|up|down)_proj\.weight'"):
        LLM(_rewrite(qwen3_moe, str(tmp_path / "sparse"), dense))


def test_transformers_defaults_fill_what_a_config_leaves_out():
    from engine.models.llama import LlamaArch

    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
    qwen2 = LlamaArch.from_hf_config({**base, "model_type": "qwen2_moe", "decoder_sparse_step": 2})
    assert (qwen2.num_experts, qwen2.num_experts_per_tok, qwen2.moe_intermediate_size) == (60, 4, 1408)
    assert qwen2.shared_expert_intermediate_size == 5632 and qwen2.sparse_layers == (1, 3) and qwen2.qkv_bias
    qwen3 = LlamaArch.from_hf_config({**base, "model_type": "qwen3_moe", "norm_topk_prob": True})
    assert (qwen3.num_experts, qwen3.num_experts_per_tok, qwen3.norm_topk_prob) == (128, 8, True)
    assert qwen3.route_in_model_dtype and qwen3.qk_norm and qwen3.shared_expert_intermediate_size == 0
    mixtral = LlamaArch.from_hf_config({**base, "model_type": "mixtral"})
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 128)
    assert mixtral.norm_topk_prob and not mixtral.route_in_model_dtype and mixtral.sparse_layers == (0, 1, 2, 3)
    dense = LlamaArch.from_hf_config({**base, "model_type": "qwen2", "qkv_bias": False})
    assert dense.qkv_bias and dense.num_experts == 0  # Qwen2's attention has its biases whatever the config says


def test_kept_experts_in_a_layer_the_config_makes_dense_are_named(qwen3_moe, tmp_path):
    from test_quantized_checkpoints import compressed

    path = compressed(qwen3_moe, str(tmp_path / "ct"), "int", "channel", bits=8)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["mlp_only_layers"] = [1]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.1\.mlp\.experts\..*layer layers\.1 is dense"):
        LLM(path, quantized_weights="keep")
