"""Quantized checkpoints (vLLM's quant_method fp8, fbgemm_fp8 and compressed-tensors): greedy
outputs token-exact against transformers loading the same checkpoint (its FP8 dequantization and
the compressed-tensors library's decompression are the references), and what is not served
refused at start, by name.

The checkpoints are a tiny random model's projections quantized here into each format: FP8 in
128 x 128 blocks (DeepSeek's and Qwen3-FP8's layout), FP8 and INT8 per output channel or per
tensor, INT4 in groups of 32 packed into int32 by compressed-tensors' own packer (symmetric, and
with zero points)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from engine import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 100, 200], list(range(30, 60)), [400, 3, 77, 12, 9, 250, 251, 252, 11]]
MAX_TOKENS = 12
FP8_MAX = 448.0


@pytest.fixture(scope="module")
def base(tiny_model_factory) -> str:
    """Dimensions that fill 128-wide blocks (hidden 128, MLP 384) and one that does not (k and v: 64)."""
    return tiny_model_factory("llama", hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=2)


def _projections(base: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(base, "model.safetensors"))
    return tensors, {k: w for k, w in tensors.items() if k.endswith("_proj.weight")}


def _write(base: str, out: str, tensors: dict, quantization_config: dict) -> str:
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    for name in os.listdir(base):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(base, name), out)
    # Two shards, a weight's scale in the other one than the weight: read from any shard.
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, os.path.join(out, file), metadata={"format": "pt"})
        weight_map.update((k, file) for k in part)
    if os.path.exists(os.path.join(out, "model.safetensors")):
        os.remove(os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out


def fp8_blocks(base: str, out: str, block: int = 128) -> str:
    """quant_method fp8 with weight_block_size: float8_e4m3fn weights, weight_scale_inv per block."""
    tensors, projections = _projections(base)
    for name, w in projections.items():
        rows, cols = w.shape
        grid = (-(-rows // block), -(-cols // block))
        padded = torch.zeros(grid[0] * block, grid[1] * block)
        padded[:rows, :cols] = w
        scale = (padded.view(grid[0], block, grid[1], block).abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
        tensors[name] = (w / full).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale
    return _write(base, out, tensors, {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                       "weight_block_size": [block, block]})


def _quantize(module: str, w: torch.Tensor, kind: str, strategy: str, bits: int, group_size: int, symmetric: bool,
              packed: bool) -> tuple[dict, dict]:
    """One module's tensors as compressed-tensors stores them, and its weights' config."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    top = FP8_MAX if kind == "float" else float((1 << (bits - 1)) - 1)
    rows, cols = w.shape
    if strategy == "tensor":
        lo, hi = w.min().reshape(1), w.max().reshape(1)
    elif strategy == "channel":
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    else:
        view = w.view(rows, cols // group_size, group_size)
        lo, hi = view.amin(dim=2), view.amax(dim=2)
    if symmetric:
        scale, zero = torch.maximum(hi.abs(), lo.abs()) / top, torch.zeros_like(hi)
    else:  # the range [lo, hi] onto [-2^(b-1), 2^(b-1) - 1]
        scale = (hi - lo) / (2 * top + 1)
        zero = torch.round(-(1 << (bits - 1)) - lo / scale)
    weights = {"num_bits": bits, "type": kind, "strategy": strategy, "symmetric": symmetric, "dynamic": False}
    if strategy == "group":
        weights["group_size"] = group_size
    if packed:  # compressed-tensors' own compressor: its rounding, its packing (zero points too)
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
        state = {"weight": w, "weight_scale": scale.float(), "weight_zero_point": zero.to(torch.int8)}
        return {f"{module}.{k}": v for k, v in PackedQuantizationCompressor.compress(state, scheme).items()}, weights
    expand = (lambda t: t.repeat_interleave(group_size, 1)) if strategy == "group" else (lambda t: t)
    q = w / expand(scale) + expand(zero)
    out = {f"{module}.weight_scale": scale.float()}
    if kind == "float":
        out[f"{module}.weight"] = q.to(torch.float8_e4m3fn)
    else:
        out[f"{module}.weight"] = torch.round(q).clamp(-(1 << (bits - 1)), (1 << (bits - 1)) - 1).to(torch.int8)
    if not symmetric:
        out[f"{module}.weight_zero_point"] = zero.to(torch.int8)
    return out, weights


def compressed(base: str, out: str, kind: str, strategy: str, bits: int = 8, group_size: int = 32,
               symmetric: bool = True, activations: bool | str = False, lm_head: bool = False,
               down: dict | None = None) -> str:
    """compressed-tensors: float-quantized FP8, pack-quantized INT4 / INT8 (weight-only), or
    int-quantized INT8 (with activations). `lm_head`: quantized too; `down`: another scheme for
    the down projections (bits, strategy), a second config group targeting them by pattern."""
    tensors, projections = _projections(base)
    if lm_head:
        projections["lm_head.weight"] = tensors["lm_head.weight"]
    packed = kind == "int" and not activations  # llm-compressor's W4A16 / W8A16; W8A8 INT8 is int-quantized
    groups = {}
    for name, w in projections.items():
        module = name[:-len(".weight")]
        args = dict(kind=kind, strategy=strategy, bits=bits, group_size=group_size, symmetric=symmetric)
        key = "group_0"
        if down is not None and module.endswith("down_proj"):
            args.update(down)
            key = "group_1"
        del tensors[name]
        stored, weights = _quantize(module, w, packed=packed, **args)
        tensors.update(stored)
        groups[key] = {"targets": ["re:.*down_proj$"] if key == "group_1" else ["Linear"], "weights": weights}
    if activations:  # W8A8: per-token (True), per-tensor or static activation scales
        strategy = "token" if activations is True else "tensor" if activations == "static" else activations
        groups["group_0"]["input_activations"] = {"num_bits": 8, "type": kind, "strategy": strategy,
                                                  "symmetric": True, "dynamic": activations != "static"}
        if activations == "static":  # calibrated per input: q, k and v share theirs, as gate and up do
            amax = {"q_proj": 3.0, "k_proj": 3.0, "v_proj": 3.0, "o_proj": 2.0, "gate_proj": 4.0, "up_proj": 4.0,
                    "down_proj": 6.0}
            for name in projections:
                module = name[:-len(".weight")]
                top = FP8_MAX if kind == "float" else 127.5  # the format's scale rule (compressed-tensors')
                tensors[module + ".input_scale"] = torch.tensor([amax[module.rsplit(".", 1)[1]] / top])
    fmt = "pack-quantized" if packed else f"{kind}-quantized"
    return _write(base, out, tensors, {"quant_method": "compressed-tensors", "format": fmt,
                                       "quantization_status": "compressed", "config_groups": groups,
                                       "ignore": [] if lm_head else ["lm_head"], "kv_cache_scheme": None})


def decompressed(path: str, out: str) -> str:
    """A dense checkpoint of the weights compressed-tensors' own decompressor reads from a
    pack-quantized one (transformers cannot load packed zero points yet)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file, save_file

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    schemes = {key: QuantizationScheme(targets=g["targets"], weights=QuantizationArgs(**g["weights"]))
               for key, g in config.pop("quantization_config")["config_groups"].items()}
    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    dense, modules = {}, {}
    for name, t in tensors.items():
        module, suffix = name.rsplit(".", 1)
        if suffix in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"):
            modules.setdefault(module, {})[suffix] = t
        else:
            dense[name] = t
    for module, state in modules.items():
        scheme = schemes["group_1" if "group_1" in schemes and module.endswith("down_proj") else "group_0"]
        dense[module + ".weight"] = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    os.makedirs(out)
    for name in os.listdir(path):
        if not name.endswith(".safetensors") and name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(os.path.join(path, name), out)
    save_file(dense, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def transformers_greedy(path: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: an end token is a token like any
    out = []
    for ids in PROMPTS:
        with torch.no_grad():
            t = torch.tensor([ids])
            gen = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(gen[0, len(ids):].tolist())
    return out


def reference_greedy(case: str, path: str, tmp_path) -> list[list[int]]:
    """transformers on the checkpoint; on compressed-tensors' own decompression of it where
    transformers cannot load it (packed zero points)."""
    return transformers_greedy(decompressed(path, str(tmp_path / "dense")) if case.endswith("zero-points") else path)


def pdserve_greedy(path: str, **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in LLM(path, **kwargs).generate(PROMPTS, params)]


CASES = {
    "fp8-block-128": lambda base, out: fp8_blocks(base, out),
    "fp8-channel": lambda base, out: compressed(base, out, "float", "channel"),
    "fp8-tensor": lambda base, out: compressed(base, out, "float", "tensor"),
    "int8-channel": lambda base, out: compressed(base, out, "int", "channel"),
    "int4-group-32": lambda base, out: compressed(base, out, "int", "group", bits=4),
    "int4-group-32-zero-points": lambda base, out: compressed(base, out, "int", "group", bits=4, symmetric=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_is_token_exact_against_transformers(base, case, tmp_path):
    path = CASES[case](base, str(tmp_path / case))
    want = reference_greedy(case, path, tmp_path)
    assert pdserve_greedy(path) == want
    if case.startswith("int4"):  # four bits do change this model's answers: the weights were not read as they were
        assert want != pdserve_greedy(base)


def test_the_same_weights_in_other_formats_answer_the_same(base, tmp_path):
    """FBGEMM's FP8 (per-channel weight_scale) and W8A8 compressed-tensors checkpoints (FP8, and
    int-quantized INT8) hold the same weights as the W8A16 ones: the same answers (activations
    are not quantized)."""
    int8 = compressed(base, str(tmp_path / "int8-w8a16"), "int", "channel")
    assert pdserve_greedy(compressed(base, str(tmp_path / "int8-w8a8"), "int", "channel", activations=True)) == \
        pdserve_greedy(int8)
    w8a16 = compressed(base, str(tmp_path / "w8a16"), "float", "channel")
    w8a8 = compressed(base, str(tmp_path / "w8a8"), "float", "channel", activations=True)
    fbgemm = _with_config(w8a16, str(tmp_path / "fbgemm"), {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                                            "modules_to_not_convert": ["lm_head"]})
    want = pdserve_greedy(w8a16)
    assert pdserve_greedy(w8a8) == want and pdserve_greedy(fbgemm) == want


def _with_config(base: str, out: str, quantization_config: dict) -> str:
    shutil.copytree(base, out)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method 'bitsandbytes'\) is not served; "
                                                              r"pdserve serves fp8, fbgemm_fp8, compressed-tensors, awq, gptq"),
    ({"quant_method": "gguf"}, r"quant_method 'gguf'\) is not served"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     "AWQ checkpoint .* is not served; pdserve serves AutoAWQ's GEMM layout"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"GPTQ checkpoint \(3 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*down_proj": {}}},
     "per-module `dynamic` overrides is not served"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "pack_dtype": "int16"}, "packed in int16 words"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, "Marlin layout is not served"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {}},
     "format 'marlin-24' is not served"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                           "group_size": 16}}}}, "4-bit float weights are not served"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {},
      "sparsity_config": {"format": "sparse-24-bitmask"}}, "'sparse-24-bitmask' sparsity is not served"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {},
      "transform_config": {"config_groups": {"u": {}}}}, "transform_config .* is not served"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "channel"},
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                 "strategy": "channel"}}}},
     "kv_cache_scheme .* is not served"),
])
def test_what_is_not_served_is_refused_at_start(base, tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(_with_config(base, str(tmp_path / "ckpt"), config))


def test_an_fp8_checkpoint_calibrated_for_an_fp8_kv_cache(base, tmp_path):
    """llm-compressor's kv_cache_scheme (static, per tensor) with its self_attn.k_scale / v_scale
    beside FP8 weights: --kv-cache-dtype fp8 stores K / k_scale and V / v_scale, auto reads the
    scales and leaves them unused; either answers close to the other."""
    from safetensors.torch import load_file, save_file

    path = compressed(base, str(tmp_path / "ct"), "float", "channel")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shard = sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(os.path.join(path, shard))
    for i in range(2):
        for kv, value in (("k", 0.25), ("v", 0.125)):
            name = f"model.layers.{i}.self_attn.{kv}_scale"
            tensors[name] = torch.tensor(value)
            index["weight_map"][name] = shard
    save_file(tensors, os.path.join(path, shard), metadata={"format": "pt"})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                        "dynamic": False, "symmetric": True}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompts = [list(range(3, 40)), list(range(50, 120, 2))]
    got = {}
    for kv in ("auto", "fp8"):
        llm = LLM(path, kv_cache_dtype=kv)
        assert all(layer.self_attn.kv_scales == (0.25, 0.125) for layer in llm.engine.runner.model.layers)
        got[kv] = [next(iter(p.values())) for o in llm.generate(prompts, params) for p in o.prompt_logprobs]
    diffs = [abs(a - b) for a, b in zip(got["auto"], got["fp8"])]
    assert 0 < sum(diffs) / len(diffs) < 0.06


# Under tensor parallelism each rank reads its rows (q, k, v, gate, up) or columns (o, down) of
# every weight: dequantized whole and split, or kept and split with its scales and zero points.
# On the base model at TP=2 a rank's o_proj takes 64 of 128 input columns (one FP8 block of 64,
# two INT4 groups of 32) and its down_proj 192 of 384. (FP8 in blocks of 128 splits under
# dequantize; kept, a rank's 192 columns would cut a block: refused, as vLLM does.) W8A8 with the
# checkpoint's static input scales is exact too; with dynamic ones a row-parallel rank scales its
# own columns (vLLM's too), which moves a float32 answer here and there.
TP_CASES = [("fp8-block-128", "dequantize"), ("int4-group-32-zero-points", "dequantize"),
            ("fp8-block-64", "keep"), ("fp8-channel", "keep"), ("int8-channel", "keep"),
            ("int4-group-32-zero-points", "keep"), ("awq-w4-g32", "keep"), ("qwen2-biases-w4a16", "keep"),
            ("fp8-w8a8-static", "keep")]


@pytest.mark.parametrize("case, quantized_weights", TP_CASES)
def test_tensor_parallel_ranks_read_their_shards_of_quantized_weights(base, qwen2, case, quantized_weights,
                                                                     tmp_path):
    """TP=2 on a quantized checkpoint (vLLM serves them so): greedy token-exact against
    transformers on the checkpoint (or on the dense weights the integers were made from); under
    keep, each rank holds its half of every projection as stored, so each rank's weights take
    about half a TP=1 engine's."""
    from kernels.quant_linear import QuantizedLinear

    if case in AWQ_GPTQ:
        path, dense = awq_or_gptq(base, str(tmp_path / case), **AWQ_GPTQ[case])
        want = transformers_greedy(dense)
    else:
        out = str(tmp_path / case)
        path = SHAPES[case](base, qwen2, out) if case in SHAPES else fp8_blocks(base, out, block=64) \
            if case == "fp8-block-64" else compressed(base, out, "float", "channel", activations="static") \
            if case == "fp8-w8a8-static" else CASES[case](base, out)
        want = reference_greedy(case, path, tmp_path)
    llm = LLM(path, tensor_parallel_size=2, quantized_weights=quantized_weights)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
        local = llm.engine.runner.model.local  # rank 0's model
        o_proj = local.layers[0].self_attn.o_proj
        assert isinstance(o_proj, QuantizedLinear) == (quantized_weights == "keep")
        assert (o_proj.in_features, o_proj.out_features) == (64, 128)
        (rank1,) = llm.engine.runner.tp.call("info")
    finally:
        llm.engine.shutdown()
    from engine.memory import module_bytes

    whole = LLM(path, quantized_weights=quantized_weights).engine.runner.model
    assert rank1["weight_bytes"] == module_bytes(local)
    # The projections split by rows or columns (scales a row kept whole), the norms every rank's.
    assert 0.5 * module_bytes(whole.layers) < module_bytes(local.layers) < 0.52 * module_bytes(whole.layers)


def test_a_tensor_parallel_split_that_cuts_quantization_groups_is_named(base, tmp_path):
    """INT4 in groups of 128 down the MLP: TP=2 gives a rank 192 of down_proj's 384 columns,
    one group and a half; keep refuses it at load, by name (dequantize splits any weight)."""
    path = compressed(base, str(tmp_path / "int4"), "int", "group", bits=4, group_size=128)
    with pytest.raises(ValueError, match=r"down_proj: tensor parallelism gives each rank 192 of its input "
                                           r"columns, which cuts its quantization groups of 128"):
        LLM(path, tensor_parallel_size=2, quantized_weights="keep")
    llm = LLM(path, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == transformers_greedy(path)
    finally:
        llm.engine.shutdown()


def test_kept_weight_shards_keep_their_scales_groups_and_words():
    """KeptWeight.part: rows take their scale rows; columns their groups (or the one group they
    fall in) and INT4 their words; values dequantized from a shard are the whole's."""
    from engine.models.quantization import KeptWeight, pack_int4
    from kernels.quant_linear import unpack_signed

    torch.manual_seed(0)
    values = torch.randint(-8, 8, (6, 64))
    scale = torch.rand(6, 4) + 0.5  # groups of 16
    zero = torch.randint(-2, 3, (6, 4)).to(torch.int8)
    whole = KeptWeight(pack_int4(values), "int4", scale, zero, 16)

    def dense(w: KeptWeight, cols: int) -> torch.Tensor:
        q = unpack_signed(w.q, 4, cols).float() - w.zero.float().repeat_interleave(16, 1)[:, :cols]
        return q * w.scale.repeat_interleave(16, 1)[:, :cols] if w.scale.shape[1] > 1 else q * w.scale
    full = dense(whole, 64)
    rows = whole.part(0, 2, 5, "m")
    assert torch.equal(dense(rows, 64), full[2:5])
    for start, end in ((0, 32), (32, 64), (16, 32), (48, 64)):
        cols = whole.part(1, start, end, "m")
        assert cols.q.shape == (6, (end - start) // 8) and torch.equal(dense(cols, end - start), full[:, start:end])
    inside = KeptWeight(values.to(torch.int8), "int8", scale[:, :1], None, 64).part(1, 8, 24, "m")
    assert torch.equal(inside.q, values[:, 8:24].to(torch.int8)) and torch.equal(inside.scale, scale[:, :1])
    with pytest.raises(ValueError, match="m: tensor parallelism gives each rank 24 of its input columns, which "
                                         "cuts its quantization groups of 16"):
        whole.part(1, 24, 48, "m")
    with pytest.raises(ValueError, match="cuts its INT4 words of 8"):
        KeptWeight(pack_int4(values), "int4", scale[:, :1], None, 64).part(1, 4, 8, "m")


def test_a_weight_whose_scale_is_missing_is_named(base, tmp_path):
    path = fp8_blocks(base, str(tmp_path / "fp8"))
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file, save_file

            tensors = load_file(os.path.join(path, name))
            tensors.pop("model.layers.1.mlp.down_proj.weight_scale_inv", None)
            save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.layers.1.mlp.down_proj.weight' has no weight_scale"):
        LLM(path)


def test_vllms_quantization_flag_must_name_the_checkpoints_method(base, tmp_path):
    """--quantization (vLLM's): the checkpoint's own method is accepted; another, or one for an
    unquantized checkpoint (on-the-fly quantization), is refused at start."""
    path = fp8_blocks(base, str(tmp_path / "fp8"))
    assert pdserve_greedy(path, quantization="fp8") == pdserve_greedy(path)
    with pytest.raises(ValueError, match="--quantization compressed-tensors does not match the checkpoint's "
                                         "quant_method 'fp8'"):
        LLM(path, quantization="compressed-tensors")
    with pytest.raises(ValueError, match="the checkpoint is not quantized, and pdserve does not quantize weights"):
        LLM(base, quantization="fp8")


# Every layout through the per-call torch path; through the fused kernel (Triton's interpreter
# here: about 15 s a model) FP8 blocks and INT4 with zero points, the two ends of what it reads
# (tests/kernels/test_quant_linear.py runs the kernel on every kind, zero points and dtype).
KEPT = [(case, "torch") for case in CASES] + [("fp8-block-128", "triton"), ("int4-group-32-zero-points", "triton")]


@pytest.mark.parametrize("case, kernel_backend", KEPT)
def test_kept_weights_answer_as_transformers(base, case, kernel_backend, tmp_path):
    """--quantized-weights keep: the projections stay as stored, FP8 / INT8 one byte a weight,
    INT4 half a byte (the fused Triton kernel on the triton backend, run here by its
    interpreter; dequantized per call on torch), and the answers are still transformers'."""
    from kernels.quant_linear import QuantizedLinear

    path = CASES[case](base, str(tmp_path / case))
    llm = LLM(path, quantized_weights="keep", kernel_backend=kernel_backend)
    layer = llm.engine.runner.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear, QuantizedLinear) and linear.use_triton == (kernel_backend == "triton")
        stored = linear.qweight.numel() * linear.qweight.element_size()
        assert stored == linear.out_features * linear.in_features // (2 if case.startswith("int4") else 1)
        assert (linear.zero is not None) == case.endswith("zero-points")
    assert not any(name.endswith("proj.weight") for name, _ in llm.engine.runner.model.named_parameters())
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == reference_greedy(case, path, tmp_path)


def test_keep_is_refused_where_it_cannot_keep(base, tmp_path):
    with pytest.raises(ValueError, match="--quantized-weights keep: the checkpoint is not quantized"):
        LLM(base, quantized_weights="keep")
    with pytest.raises(ValueError, match="quantized_weights must be dequantize or keep"):
        LLM(base, quantized_weights="fp8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantized_weights", ["dequantize", "keep"])
def test_on_cuda_an_fp8_checkpoint_answers_as_transformers(base, tmp_path, quantized_weights):
    """On the GPU (make gpu-check): block-scaled FP8 dequantized at load, and kept in FP8 through
    the fused Triton kernel (CUDA graphs on)."""
    path = fp8_blocks(base, str(tmp_path / "fp8"))
    assert pdserve_greedy(path, device="cuda", quantized_weights=quantized_weights) == transformers_greedy(path)


@pytest.fixture(scope="module")
def qwen2(tiny_model_factory) -> str:
    """Qwen2's q, k and v biases (in every Qwen2 / Qwen2.5 quantized checkpoint)."""
    return tiny_model_factory("qwen2", hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=2)


SHAPES = {
    "qwen2-biases-w4a16": lambda base, qwen2, out: compressed(qwen2, out, "int", "group", bits=4),
    "qwen2-biases-fp8": lambda base, qwen2, out: compressed(qwen2, out, "float", "channel"),
    "quantized-lm-head": lambda base, qwen2, out: compressed(base, out, "float", "channel", lm_head=True),
    # W4A16 with the down projections in 8 bits by a second config group (a pattern outranks Linear).
    "two-config-groups": lambda base, qwen2, out: compressed(base, out, "int", "group", bits=4,
                                                             down={"bits": 8, "strategy": "channel"}),
}


@pytest.mark.parametrize("quantized_weights", ["dequantize", "keep"])
@pytest.mark.parametrize("case", list(SHAPES))
def test_checkpoints_as_they_come(base, qwen2, case, quantized_weights, tmp_path):
    """Biases beside quantized weights, a quantized LM head (dequantized under keep too), and
    config groups whose targets overlap: token-exact against transformers (or, for two groups,
    compressed-tensors' own decompression) in both modes."""
    path = SHAPES[case](base, qwen2, str(tmp_path / case))
    want = transformers_greedy(decompressed(path, str(tmp_path / "dense")) if case == "two-config-groups" else path)
    assert pdserve_greedy(path, quantized_weights=quantized_weights) == want
    if quantized_weights == "keep" and case == "two-config-groups":
        layer = LLM(path, quantized_weights="keep").engine.runner.model.layers[1]
        assert (layer.mlp.down_proj.kind, layer.mlp.gate_up_proj.kind) == ("int8", "int4")


# AutoAWQ's and AutoGPTQ's layouts, packed here as their packers do (AutoAWQ's GEMM
# `WQLinear_GEMM.from_linear`: eight columns a word in the order below; AutoGPTQ's
# `QuantLinear.pack`: 32 / bits rows a word, zero points less one in gptq's v1 format). The
# reference is transformers on the dense weights `(q - zero) * scale` the integers were made from.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _int_quantize(w: torch.Tensor, bits: int, g_idx: torch.Tensor, groups: int):
    """Asymmetric per (row, group): unsigned values, zero points, fp16 scales; and the dense weight."""
    top = (1 << bits) - 1
    lo = torch.stack([w[:, g_idx == g].amin(dim=1) for g in range(groups)], dim=1).clamp(max=0)
    hi = torch.stack([w[:, g_idx == g].amax(dim=1) for g in range(groups)], dim=1).clamp(min=0)
    scale = ((hi - lo) / top).clamp(min=1e-6).half().float()
    zero = torch.round(-lo / scale).clamp(0, top).long()
    q = torch.clamp(torch.round(w / scale[:, g_idx]) + zero[:, g_idx], 0, top).long()
    return q, zero, scale, ((q - zero[:, g_idx]) * scale[:, g_idx]).float()


def _words(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """[R, C] unsigned values -> [R, C * bits / 32] int32, packed along the columns."""
    per = 32 // bits
    v = values.view(values.shape[0], -1, per)
    if order is not None:  # word position i holds column order[i]
        v = v[..., list(order)]
    words = (v << torch.arange(0, 32, bits)).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def awq_or_gptq(base: str, out: str, method: str, bits: int = 4, group: int = 32, act_order: bool = False,
                v1: bool = True) -> tuple[str, str]:
    """(the quantized checkpoint, a dense one of the same weights for the reference)."""
    from safetensors.torch import save_file

    tensors, projections = _projections(base)
    dense = dict(tensors)
    for name, w in projections.items():
        module = name[:-len(".weight")]
        n, k = w.shape
        w = w.clone()
        w[:3] = w[:3].abs()  # rows of only positive weights: a zero point of 0 (GPTQ v1 stores it as -1)
        groups = 1 if group == -1 else k // group
        g_idx = torch.arange(k) // (k if group == -1 else group)
        if act_order:
            g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(n * k))]
        q, zero, scale, dense[name] = _int_quantize(w, bits, g_idx, groups)
        assert int(zero.min()) == 0
        del tensors[name]
        if method == "awq":  # [K, N / 8] and [groups, N / 8], AWQ's column order
            tensors[module + ".qweight"] = _words(q.t().contiguous(), bits, AWQ_ORDER)
            tensors[module + ".qzeros"] = _words(zero.t().contiguous(), bits, AWQ_ORDER)
        else:  # [K * bits / 32, N] along K; zeros [groups, N * bits / 32] along N, v1: less one, word-wise
            tensors[module + ".qweight"] = _words(q.contiguous(), bits).t().contiguous()
            words = _words(zero.t().contiguous(), bits)
            if v1:  # GPTQModel's v1 writer: a zero of 0 borrows from the next one in its word
                words = ((words.to(torch.int64) & 0xFFFFFFFF) - (0x11111111 if bits == 4 else 0x01010101)) % (1 << 32)
                words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
            tensors[module + ".qzeros"] = words
            tensors[module + ".g_idx"] = g_idx.to(torch.int32)
        tensors[module + ".scales"] = scale.t().contiguous().half()
    config = ({"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
              if method == "awq" else
              {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": False,
               "checkpoint_format": "gptq" if v1 else "gptq_v2"})
    path = _write(base, out, tensors, config)
    reference = out + "-dense"
    shutil.copytree(base, reference)
    save_file({k: v.contiguous() for k, v in dense.items()}, os.path.join(reference, "model.safetensors"),
              metadata={"format": "pt"})
    return path, reference


AWQ_GPTQ = {
    "awq-w4-g32": dict(method="awq"),
    "gptq-w4-g32": dict(method="gptq"),
    "gptq-w8-per-row-v2": dict(method="gptq", bits=8, group=-1, v1=False),
    "gptq-w8-g32-v1": dict(method="gptq", bits=8),
    "gptq-w4-g32-act-order": dict(method="gptq", act_order=True),
}


@pytest.mark.parametrize("case, quantized_weights, kernel_backend",
                         [(case, mode, "torch") for case in AWQ_GPTQ for mode in ("dequantize", "keep")]
                         + [("awq-w4-g32", "keep", "triton")])
def test_awq_and_gptq_checkpoints_answer_as_their_dense_weights(base, case, quantized_weights, kernel_backend,
                                                               tmp_path):
    """AutoAWQ's GEMM and AutoGPTQ's layouts, 4 and 8 bits, act-order (dequantized: keep runs
    consecutive groups and says so): token-exact against transformers on the dense weights."""
    path, dense = awq_or_gptq(base, str(tmp_path / case), **AWQ_GPTQ[case])
    if quantized_weights == "keep" and case.endswith("act-order"):
        with pytest.raises(ValueError, match="act-order .* use --quantized-weights dequantize"):
            LLM(path, quantized_weights="keep")
        return
    got = pdserve_greedy(path, quantized_weights=quantized_weights, kernel_backend=kernel_backend)
    assert got == transformers_greedy(dense)


def test_an_older_gptq_checkpoint_with_its_config_beside_config_json(base, tmp_path):
    """AutoGPTQ's quantize_config.json (and AutoAWQ's quant_config.json) beside a config.json
    without quantization_config, as older checkpoints ship: read as vLLM reads them."""
    path, dense = awq_or_gptq(base, str(tmp_path / "gptq"), method="gptq")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    quantize_config = config.pop("quantization_config")
    del quantize_config["quant_method"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "quantize_config.json"), "w") as f:
        json.dump(quantize_config, f)
    assert pdserve_greedy(path) == transformers_greedy(dense)


@pytest.mark.parametrize("activations", ["token", "tensor", "static"])
def test_kept_fp8_quantizes_activations_as_the_checkpoint_says(base, activations, tmp_path):
    """W8A8 (llm-compressor's FP8-dynamic and static schemes) under keep: the input quantized to
    FP8 per token, per tensor or by the checkpoint's input_scale (a fused projection's shards are
    calibrated on one input; were theirs to differ, the largest, as vLLM), both FP8 operands
    through torch._scaled_mm; token-exact against transformers, which quantizes activations the
    same way through compressed-tensors."""
    path = compressed(base, str(tmp_path / activations), "float", "channel", activations=activations)
    llm = LLM(path, quantized_weights="keep")
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.activations == activations
    if activations == "static":
        assert qkv.input_scale == pytest.approx(3.0 / FP8_MAX)
        assert llm.engine.runner.model.layers[0].mlp.down_proj.input_scale == pytest.approx(6.0 / FP8_MAX)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # One prompt at a time, as transformers runs them: a per-tensor scale is the whole step's (a
    # batch's tokens share it, in vLLM too).
    got = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in PROMPTS]
    assert got == transformers_greedy(path)


@pytest.mark.parametrize("activations", ["token", "tensor", "static"])
def test_int8_w8a8_projection_is_compressed_tensors_fake_quantization(activations):
    """One kept INT8 projection with INT8 activations (per token, per tensor, static): the input
    quantized as compressed-tensors does (amax / 127.5, rounded half to even, clamped to [-128,
    127]), the products summed in int32 by torch._int_mm: within float32 rounding of
    compressed-tensors' own fake quantization times the dequantized weight."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    from kernels.quant_linear import QuantizedLinear

    torch.manual_seed(0)
    k, n = 128, 384
    w = torch.randn(n, k) * 0.1
    w_scale = w.abs().amax(dim=1, keepdim=True) / 127.5
    wq = torch.round(w / w_scale).clamp(-128, 127).to(torch.int8)
    x = torch.randn(7, k) * 3
    x[2] = 0  # an all-zero row
    static = 2.5 / 127.5
    linear = QuantizedLinear(k, n, "int8", k, False, use_triton=False, activations=activations,
                             input_scale=static if activations == "static" else None)
    linear.allocate(torch.device("cpu"))
    linear.load_rows(0, wq, w_scale, None)
    got = linear(x)
    assert not linear._emulate  # torch._int_mm ran
    args = QuantizationArgs(num_bits=8, type="int", strategy="token" if activations == "token" else "tensor",
                            symmetric=True, dynamic=activations != "static")
    if activations == "static":
        scale, zero = torch.tensor([static]), torch.zeros(1)
    else:
        lo, hi = (x.amin(1, keepdim=True), x.amax(1, keepdim=True)) if activations == "token" else \
            (x.min().reshape(1), x.max().reshape(1))
        scale, zero = calculate_qparams(lo, hi, args)
    want = fake_quantize(x, scale, zero, args) @ (wq.float() * w_scale).t()
    assert torch.allclose(got, want, rtol=0, atol=2e-5) and got.abs().max() > 1


@pytest.mark.parametrize("activations", ["token", "static"])
def test_kept_int8_w8a8_answers_as_transformers(base, activations, tmp_path):
    """llm-compressor's INT8 W8A8 (int-quantized: weights per channel, activations per token or
    static) under keep runs INT8 activations through torch._int_mm (oneDNN's INT8 GEMM on the
    CPU), token-exact against transformers, which fake-quantizes activations the same way. (Per
    tensor, one scale over the prompt's coarse steps, a last-bit difference upstream moves a
    rounding and, late in this random model's answers, a token: the projection is checked above.)"""
    path = compressed(base, str(tmp_path / activations), "int", "channel", activations=activations)
    llm = LLM(path, quantized_weights="keep")
    layer = llm.engine.runner.model.layers[0]
    assert layer.self_attn.qkv_proj.kind == "int8" and layer.self_attn.qkv_proj.activations == activations
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in PROMPTS]
    assert got == transformers_greedy(path)
    assert not layer.mlp.down_proj._emulate  # torch._int_mm ran


def test_fbgemm_and_autofp8_run_w8a8_under_keep(base, tmp_path):
    """fbgemm_fp8 (per-channel weights, per-token activations, amax bounded by its
    activation_scale_ub) answers as llm-compressor's FP8-dynamic; AutoFP8's per-tensor fp8 with
    dynamic activations (per tensor, as vLLM) as transformers on the same weights in
    compressed-tensors' form; one prompt at a time (a per-tensor scale is the step's)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def one_by_one(llm: LLM) -> list[list[int]]:
        return [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]

    token = compressed(base, str(tmp_path / "token"), "float", "channel", activations="token")
    fbgemm = LLM(_with_config(token, str(tmp_path / "fbgemm"), {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                                           "modules_to_not_convert": ["lm_head"]}),
                 quantized_weights="keep")
    qkv = fbgemm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert (qkv.activations, qkv.activation_ub) == ("token", 1200.0)
    assert one_by_one(fbgemm) == one_by_one(LLM(token, quantized_weights="keep"))
    tensor = compressed(base, str(tmp_path / "tensor"), "float", "tensor", activations="tensor")
    autofp8 = LLM(_with_config(tensor, str(tmp_path / "autofp8"), {"quant_method": "fp8", "activation_scheme": "dynamic"}),
                  quantized_weights="keep")
    assert autofp8.engine.runner.model.layers[1].mlp.down_proj.activations == "tensor"
    assert one_by_one(autofp8) == transformers_greedy(tensor)


def test_per_tensor_activation_scales_turn_decode_padding_off(base, tmp_path):
    """A padded decode row (a CUDA graph's fixed batch) would move a per-tensor dynamic scale
    and so the real rows' answers: such an engine decodes at the batch's own size; per-token
    scales keep the padded buffers."""
    tensor = compressed(base, str(tmp_path / "tensor"), "float", "tensor", activations="tensor")
    token = compressed(base, str(tmp_path / "token"), "float", "channel", activations="token")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for path, padded in ((tensor, False), (token, True)):
        llm = LLM(path, quantized_weights="keep", cuda_graph_sizes=[4])
        assert bool(llm.engine.runner.decode_graphs.sizes) == padded
        llm.generate(PROMPTS[:3], params)
        assert llm.engine.stats()["decode_buffer_steps"] > 0  # the buffers, at the batch's own size or padded
    assert llm.engine.runner.cuda_graphs_off_reason == "no CUDA device"
    assert LLM(tensor, quantized_weights="keep").engine.runner.cuda_graphs_off_reason == \
        "per-tensor dynamic 8-bit activation scales"
    sharded = LLM(tensor, quantized_weights="keep", cuda_graph_sizes=[4], tensor_parallel_size=2)
    try:  # rank 0's shard is read for the scheme
        assert not sharded.engine.runner.decode_graphs.sizes
    finally:
        sharded.engine.shutdown()


@pytest.mark.parametrize("quantized_weights", ["dequantize", "keep"])
def test_lora_adapters_on_a_quantized_base(base, tiny_lora_factory, quantized_weights, tmp_path):
    """An adapter's deltas add to a quantized projection's output as to a full-precision one's:
    the same answers as PEFT on transformers' view of the checkpoint (W4A16 with zero points,
    kept packed or dequantized)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = compressed(base, str(tmp_path / "w4a16"), "int", "group", bits=4, symmetric=False)
    adapter = tiny_lora_factory(base, 5)
    dense = decompressed(path, str(tmp_path / "dense"))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32), adapter).eval()
    model.generation_config.eos_token_id = None
    want = []
    for ids in PROMPTS:
        with torch.no_grad():
            t = torch.tensor([ids])
            want.append(model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=MAX_TOKENS,
                                       do_sample=False)[0, len(ids):].tolist())
    llm = LLM(path, quantized_weights=quantized_weights, enable_lora=True, lora_modules=[f"a={adapter}"])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, lora_name="a")
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want


@pytest.fixture(scope="module")
def phi3(tiny_model_factory) -> str:
    """Phi-3's fused qkv_proj (rows 128 + 64 + 64) and gate_up_proj (384 + 384), quantized as stored."""
    return tiny_model_factory("phi3", hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("case", ["fp8-block-128", "int8-channel"])
def test_a_phi3_checkpoints_fused_quantized_projections(phi3, case, tmp_path):
    """Dequantized whole and read as their parts (TP=1 and, each rank its rows of every part,
    TP=2), or kept as stored, rows whole, at TP=1; under TP keep names the fused projection."""
    path = CASES[case](phi3, str(tmp_path / case))
    want = reference_greedy(case, path, tmp_path)
    assert pdserve_greedy(path) == want
    assert pdserve_greedy(path, quantized_weights="keep") == want
    llm = LLM(path, tensor_parallel_size=2, num_blocks=256)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
    finally:
        llm.engine.shutdown()
    fused = r"stores layers\.0\.(self_attn\.qkv|mlp\.gate_up)_proj fused.*--quantized-weights dequantize"
    with pytest.raises(ValueError, match=fused):  # said before a worker starts
        LLM(path, tensor_parallel_size=2, quantized_weights="keep")


@pytest.mark.parametrize("case", ["fp8-block-128", "int8-channel"])
def test_a_plain_mlps_quantized_up_projection(tiny_model_factory, case, tmp_path):
    """Arcee's MLP has no gate: its quantized up_proj is the whole of the MLP's input projection,
    dequantized (TP=1 and 2) or kept as stored (TP=1), and the answers are transformers'."""
    from kernels.quant_linear import QuantizedLinear

    arcee = tiny_model_factory("arcee", hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=2)
    path = CASES[case](arcee, str(tmp_path / case))
    want = reference_greedy(case, path, tmp_path)
    assert pdserve_greedy(path) == want
    llm = LLM(path, quantized_weights="keep")
    up = llm.engine.runner.model.layers[0].mlp.gate_up_proj
    assert isinstance(up, QuantizedLinear) and up.out_features == 384
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
    llm = LLM(path, tensor_parallel_size=2, num_blocks=256)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("arch", ["starcoder2", "phi"])
def test_renamed_families_quantized_weights_keep_their_scales(tiny_model_factory, arch, tmp_path):
    """StarCoder 2's c_fc / c_proj and Phi's dense / fc1 / fc2 are read under our names, and so is
    each quantized weight's scale beside them (FP8 blocks of 128, dequantized)."""
    base = tiny_model_factory(arch, hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=2)
    path = CASES["fp8-block-128"](base, str(tmp_path / arch))
    assert pdserve_greedy(path) == reference_greedy("fp8-block-128", path, tmp_path)
