"""--kv-cache-dtype fp8 / fp8_e5m2 (vLLM's flag): K and V stored in 8 bits (scale 1, saturating),
read back in the model's dtype. The same memory holds more tokens; the backends agree on what is
stored and read; the answers stay close to a full-precision cache's."""
from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest
import torch

from engine import LLM, SamplingParams
from test_quantized_checkpoints import _with_config

MIB = 1 << 20


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(500) for _ in range(n)] for n in (3, 17, 40, 120)]


def test_an_fp8_cache_holds_more_tokens_in_the_same_memory(tiny_llama):
    blocks = {}
    for kv, dtype in (("auto", "float32"), ("fp8", "float32"), ("fp8_e5m2", "bfloat16"), ("auto", "bfloat16")):
        runner = LLM(tiny_llama, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=4 * MIB).engine.runner
        assert runner.kv_caches[0].dtype == {"auto": getattr(torch, dtype), "fp8": torch.float8_e4m3fn,
                                             "fp8_e5m2": torch.float8_e5m2}[kv]
        assert runner.kv_caches[0].shape[1] == runner.num_blocks == 4 * MIB // runner.bytes_per_block()
        blocks[kv, dtype] = runner.num_blocks
    assert blocks["fp8", "float32"] == 4 * blocks["auto", "float32"]  # a byte a value, not four
    assert blocks["fp8_e5m2", "bfloat16"] == 2 * blocks["auto", "bfloat16"]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_the_cpu_path_answers_as_the_reference_over_an_fp8_cache(tiny_llama, prompts, kv_cache_dtype):
    """Greedy tokens and logprobs of the CPU path (the C++ kernels, which read the fp8 cache in
    place) against kernels.reference, which stores and widens plainly."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = {backend: LLM(tiny_llama, kv_cache_dtype=kv_cache_dtype, kernel_backend=backend).generate(prompts, params)
            for backend in ("torch", "reference")}
    for got, want in zip(outs["torch"], outs["reference"]):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


@pytest.mark.parametrize("kv_cache_dtype,mean,worst", [("fp8", 0.06, 0.3), ("fp8_e5m2", 0.1, 0.6)])
def test_an_fp8_cache_stays_close_to_full_precision(tiny_llama, prompts, kv_cache_dtype, mean, worst):
    """Every prompt token's logprob (each read over the cache the tokens before it wrote) within
    a few hundredths of a float32 cache's on average: e4m3 keeps 3 mantissa bits, e5m2 2. A
    cache read as the wrong bytes or the wrong scale lands whole nats away."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def logprobs(kv: str) -> list[float]:
        outs = LLM(tiny_llama, kv_cache_dtype=kv).generate(prompts, params)
        return [next(iter(p.values())) for o in outs for p in o.prompt_logprobs]  # tokens 1.. of each

    full, eight = logprobs("auto"), logprobs(kv_cache_dtype)
    diffs = [abs(a - b) for a, b in zip(full, eight)]
    assert len(diffs) == sum(len(p) - 1 for p in prompts)
    assert sum(diffs) / len(diffs) < mean and max(diffs) < worst
    assert max(diffs) > 0  # it is 8-bit: not the float32 cache under another name


def test_a_bad_cache_dtype_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        LLM(tiny_llama, kv_cache_dtype="int8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)")
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_the_cuda_kernels_answer_as_the_reference_over_an_fp8_cache(tiny_llama, prompts, kv_cache_dtype):
    """On a GPU: the Triton kernels (CUDA graphs on) store what torch's saturating conversion
    stores and read it back as the reference does: the same greedy tokens, logprobs to 1e-3."""
    if kv_cache_dtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(ValueError, match="compute capability 8.9"):
            LLM(tiny_llama, device="cuda", kv_cache_dtype=kv_cache_dtype)
        return
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = {backend: LLM(tiny_llama, device="cuda", kv_cache_dtype=kv_cache_dtype,
                         kernel_backend=backend).generate(prompts, params) for backend in ("triton", "reference")}
    for got, want in zip(outs["triton"], outs["reference"]):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert all(abs(a[t] - b[t]) < 1e-3 for t in a.keys() & b.keys())


def _scaled_checkpoint(base: str, out: str, k_factor: float, v_factor: float, scales: dict[str, float],
                       quantization_config: dict | None = None) -> str:
    """`base` with K made k_factor times larger (q_proj shrunk as much: the same attention) and V
    v_factor times (o_proj shrunk: the same output), far past what fp8 holds at scale 1, plus
    `scales` (tensor name suffix -> value) for every layer, as a calibrated checkpoint has them."""
    import shutil

    from safetensors.torch import load_file, save_file

    if quantization_config is None:
        shutil.copytree(base, out)
    else:
        _with_config(base, out, quantization_config)
    (weights,) = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    tensors = load_file(os.path.join(out, weights))
    layers = {int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")}
    for i in layers:
        a = f"model.layers.{i}.self_attn"
        tensors[f"{a}.k_proj.weight"] = tensors[f"{a}.k_proj.weight"] * k_factor
        tensors[f"{a}.q_proj.weight"] = tensors[f"{a}.q_proj.weight"] / k_factor
        tensors[f"{a}.v_proj.weight"] = tensors[f"{a}.v_proj.weight"] * v_factor
        tensors[f"{a}.o_proj.weight"] = tensors[f"{a}.o_proj.weight"] / v_factor
        for suffix, value in scales.items():
            tensors[f"model.layers.{i}.{suffix}"] = torch.tensor(value, dtype=torch.float32)
    save_file(tensors, os.path.join(out, weights), metadata={"format": "pt"})
    return out


def _kv_amax(path: str, prompts) -> tuple[float, float]:
    """The largest |K| and |V| the prompts put in a float32 cache."""
    llm = LLM(path, kv_cache_dtype="auto", num_blocks=64, enable_prefix_caching=False)
    caches = []
    runner = llm.engine.runner
    original = runner.kernels.store_kv

    def store(k, v, cache, slots):  # every K and V the forward passes store
        caches.append((k.abs().max().item(), v.abs().max().item()))
        return original(k, v, cache, slots)

    for layer in runner.model.layers:
        layer.self_attn.kernels = dataclasses.replace(runner.kernels, store_kv=store)
    llm.generate(prompts, SamplingParams(max_tokens=1))
    return max(k for k, _ in caches), max(v for _, v in caches)


@pytest.mark.parametrize("names", [("self_attn.k_scale", "self_attn.v_scale"),  # llm-compressor's
                                   ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
                                   ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale")],  # ModelOpt's
                         ids=["k_scale", "output_scale", "modelopt"])
def test_a_checkpoints_kv_scales_keep_large_keys_and_values_in_range(tiny_llama, prompts, tmp_path, names):
    """A calibrated checkpoint's scales (vLLM's rule): the fp8 cache holds K / k_scale and
    V / v_scale, attention multiplies them back. Keys and values thousands of times larger than
    fp8 holds then answer as a float32 cache does, where the same weights without their scales
    saturate and answer far off."""
    k0, v0 = _kv_amax(tiny_llama, prompts)
    k_factor, v_factor = 4000.0, 2000.0
    scales = {names[0]: k_factor * k0 / 400, names[1]: v_factor * v0 / 400}  # amax -> 400 (e4m3: 448)
    calibrated = _scaled_checkpoint(tiny_llama, str(tmp_path / "calibrated"), k_factor, v_factor, scales)
    bare = _scaled_checkpoint(tiny_llama, str(tmp_path / "bare"), k_factor, v_factor, {})
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def logprobs(path: str, kv: str) -> list[float]:
        outs = LLM(path, kv_cache_dtype=kv).generate(prompts, params)
        return [next(iter(p.values())) for o in outs for p in o.prompt_logprobs]

    def mean_diff(a, b):
        return sum(abs(x - y) for x, y in zip(a, b)) / len(a)

    full = logprobs(calibrated, "auto")  # the scales unused: the cache is float32
    assert mean_diff(full, logprobs(bare, "auto")) < 1e-4
    assert mean_diff(full, logprobs(calibrated, "fp8")) < 0.06
    assert mean_diff(full, logprobs(bare, "fp8")) > 0.3  # saturated at 448


def test_kv_scales_are_one_a_layer_and_positive(tiny_llama, tmp_path):
    head = _scaled_checkpoint(tiny_llama, str(tmp_path / "head"), 1.0, 1.0, {})
    from safetensors.torch import load_file, save_file

    (weights,) = [f for f in os.listdir(head) if f.endswith(".safetensors")]
    tensors = load_file(os.path.join(head, weights))
    tensors["model.layers.0.self_attn.k_scale"] = torch.ones(3)  # the model has 2 KV heads
    save_file(tensors, os.path.join(head, weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layer 0 has 3 KV cache scales; one a layer, or one a KV head \(2\)"):
        LLM(head, kv_cache_dtype="fp8")
    zero = _scaled_checkpoint(tiny_llama, str(tmp_path / "zero"), 1.0, 1.0, {"self_attn.v_scale": 0.0})
    with pytest.raises(ValueError, match="must be a finite number > 0, got 0.0"):
        LLM(zero, kv_cache_dtype="fp8")
    # The deprecated kv_scale is both K's and V's.
    both = LLM(_scaled_checkpoint(tiny_llama, str(tmp_path / "both"), 1.0, 1.0, {"self_attn.kv_scale": 0.5}),
               kv_cache_dtype="fp8")
    assert all(layer.self_attn.kv_scales == (0.5, 0.5) for layer in both.engine.runner.model.layers)


def _per_head_checkpoint(base: str, out: str, k_factors: list[float], v_factors: list[float], scales: bool) -> str:
    """`base` with each KV head's K (and V) made its own factor larger, its query heads (and
    o_proj's columns) shrunk as much: the same attention; with `scales`, llm-compressor's attn_head
    scales ([KV heads, 1, 1] a layer) bringing each head's largest value to about 400."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    cfg = json.load(open(os.path.join(out, "config.json")))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, group = cfg["hidden_size"] // heads, heads // kv_heads
    if scales:
        cfg["quantization_config"] = {**KV_ONLY, "kv_cache_scheme": {**KV_ONLY["kv_cache_scheme"],
                                                                     "strategy": "attn_head"}}
        json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    (weights,) = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    tensors = load_file(os.path.join(out, weights))
    layers = {int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")}
    kf, vf = torch.tensor(k_factors), torch.tensor(v_factors)
    for i in layers:
        a = f"model.layers.{i}.self_attn"
        tensors[f"{a}.k_proj.weight"] = tensors[f"{a}.k_proj.weight"] * kf.repeat_interleave(d)[:, None]
        tensors[f"{a}.q_proj.weight"] = tensors[f"{a}.q_proj.weight"] / kf.repeat_interleave(group * d)[:, None]
        tensors[f"{a}.v_proj.weight"] = tensors[f"{a}.v_proj.weight"] * vf.repeat_interleave(d)[:, None]
        tensors[f"{a}.o_proj.weight"] = tensors[f"{a}.o_proj.weight"] / vf.repeat_interleave(group * d)[None, :]
        if scales:  # a head's |K| stays below ~4 x its factor here (the tiny model's, measured: _kv_amax)
            tensors[f"{a}.k_scale"] = (kf * 4 / 400).view(kv_heads, 1, 1)
            tensors[f"{a}.v_scale"] = (vf * 4 / 400).view(kv_heads, 1, 1)
    save_file(tensors, os.path.join(out, weights), metadata={"format": "pt"})
    return out


def test_per_kv_head_scales(tiny_llama, prompts, tmp_path):
    """llm-compressor's attn_head KV scheme (vLLM serves it): a scale per KV head, its query
    heads multiplied by it, its output too. KV heads a thousand times apart answer as a float32
    cache does with their scales, where one scale a layer cannot hold both; under tensor
    parallelism each rank takes its own heads' scales."""
    k0, v0 = _kv_amax(tiny_llama, prompts)
    assert k0 < 4 and v0 < 4  # what the scales above assume
    factors_k, factors_v = [3000.0, 3.0], [2.0, 2000.0]
    calibrated = _per_head_checkpoint(tiny_llama, str(tmp_path / "heads"), factors_k, factors_v, scales=True)
    bare = _per_head_checkpoint(tiny_llama, str(tmp_path / "bare"), factors_k, factors_v, scales=False)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def logprobs(path: str, kv: str, **kwargs) -> list[float]:
        outs = LLM(path, kv_cache_dtype=kv, **kwargs).generate(prompts, params)
        return [next(iter(p.values())) for o in outs for p in o.prompt_logprobs]

    def mean_diff(a, b):
        return sum(abs(x - y) for x, y in zip(a, b)) / len(a)

    full = logprobs(calibrated, "auto")
    assert mean_diff(full, logprobs(tiny_llama, "auto")) < 1e-3  # the same model, rescaled
    one = LLM(calibrated, kv_cache_dtype="fp8", num_blocks=64)
    attn = one.engine.runner.model.layers[0].self_attn
    assert attn.kv_scales[0].tolist() == pytest.approx([30.0, 0.03]) and attn.has_kv_scales
    assert mean_diff(full, logprobs(calibrated, "fp8")) < 0.06
    assert mean_diff(full, logprobs(bare, "fp8")) > 0.3  # the large head saturates, the small one rounds away
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    two = LLM(calibrated, kv_cache_dtype="fp8", num_blocks=64, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, greedy)] == \
            [o.outputs[0].token_ids for o in one.generate(prompts, greedy)]
    finally:
        two.engine.shutdown()


def test_per_head_scales_beside_kept_quantized_weights(tiny_llama, tmp_path):
    """llm-compressor's FP8 weights with an attn_head KV scheme, the weights kept 8-bit (their
    projections hold no float weight to read a dtype from): the scales load in the model's dtype
    and the engine answers as with the weights dequantized."""
    from safetensors.torch import load_file, save_file
    from test_quantized_checkpoints import compressed

    path = compressed(tiny_llama, str(tmp_path / "ct"), "float", "channel")
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    shard = sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(os.path.join(path, shard))
    for i in range(2):
        for part, value in (("k", [0.25, 0.01]), ("v", [0.125, 0.02])):
            tensors[f"model.layers.{i}.self_attn.{part}_scale"] = torch.tensor(value).view(2, 1, 1)
            index["weight_map"][f"model.layers.{i}.self_attn.{part}_scale"] = shard
    save_file(tensors, os.path.join(path, shard), metadata={"format": "pt"})
    json.dump(index, open(os.path.join(path, "model.safetensors.index.json"), "w"))
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["quantization_config"]["kv_cache_scheme"] = {**KV_ONLY["kv_cache_scheme"], "strategy": "attn_head"}
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for weights in ("keep", "dequantize"):
        llm = LLM(path, kv_cache_dtype="fp8", quantized_weights=weights, num_blocks=32)
        attn = llm.engine.runner.model.layers[0].self_attn
        assert attn.kv_scales[0].tolist() == pytest.approx([0.25, 0.01])
        assert all(t.dtype == torch.float32 for t in attn._per_head)  # the model's dtype
        outs[weights] = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7, 8], list(range(30, 70))], params)]
    assert outs["keep"] == outs["dequantize"]


def test_fp8_attentions_query_and_probability_scales_load_unused(tiny_llama, prompts, tmp_path, caplog):
    """A checkpoint calibrated for FP8 attention (llm-compressor's attention scheme) also has
    q_scale and prob_scale a layer: it loads, its KV scales used, those two not (attention takes
    queries in the model's dtype), and it answers as the same checkpoint without them."""
    kv = {"self_attn.k_scale": 0.5, "self_attn.v_scale": 0.25}
    plain = _scaled_checkpoint(tiny_llama, str(tmp_path / "kv"), 1.0, 1.0, kv)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    want = LLM(plain, kv_cache_dtype="fp8", num_blocks=64).generate(prompts, params)
    # llm-compressor's names, and the older ones vLLM's fp8 and Quark configs read.
    for i, names in enumerate([("self_attn.q_scale", "self_attn.attn.prob_scale"),
                               ("self_attn.q_proj.output_scale", "self_attn.prob_output_scale")]):
        fp8_attention = _scaled_checkpoint(tiny_llama, str(tmp_path / f"attn{i}"), 1.0, 1.0,
                                           {**kv, names[0]: 0.125, names[1]: 1 / 448})
        caplog.clear()
        with caplog.at_level("INFO", logger="engine.models.loader"):
            llm = LLM(fp8_attention, kv_cache_dtype="fp8", num_blocks=64)
        assert "prob_scale and q_scale (FP8 attention's) are not used" in caplog.text
        assert all(layer.self_attn.kv_scales == (0.5, 0.25) for layer in llm.engine.runner.model.layers)
        got = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]


KV_ONLY = {"quant_method": "compressed-tensors", "format": "dense", "quantization_status": "compressed",
           "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                               "symmetric": True}}


def test_a_checkpoint_that_quantizes_only_its_kv_cache(tiny_llama, tmp_path):
    """llm-compressor's KV-cache-only recipe: dense weights, a kv_cache_scheme, per-layer scales;
    served as vLLM serves it, under tensor parallelism too. A scheme per head or dynamic is
    refused at start."""
    path = _scaled_checkpoint(tiny_llama, str(tmp_path / "kv-only"), 1.0, 1.0,
                              {"self_attn.k_scale": 0.5, "self_attn.v_scale": 0.25}, KV_ONLY)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = LLM(path, kv_cache_dtype="fp8", num_blocks=64)
    assert all(layer.self_attn.kv_scales == (0.5, 0.25) for layer in one.engine.runner.model.layers)
    two = LLM(path, kv_cache_dtype="fp8", num_blocks=64, tensor_parallel_size=2)
    try:
        prompts = [[5, 6, 7, 8, 9] * 7, list(range(40, 90))]
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params)] == \
            [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    finally:
        two.engine.shutdown()
    for scheme in ({"strategy": "channel"}, {"dynamic": True}, {"num_bits": 4}):
        bad = dict(KV_ONLY, kv_cache_scheme={**KV_ONLY["kv_cache_scheme"], **scheme})
        other = _scaled_checkpoint(tiny_llama, str(tmp_path / f"bad-{len(os.listdir(tmp_path))}"), 1.0, 1.0, {}, bad)
        with pytest.raises(ValueError, match="kv_cache_scheme .* is not served"):
            LLM(other, kv_cache_dtype="fp8")
