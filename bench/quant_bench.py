"""INT8 W8A8 on the CPU: the same random Llama served dense (float32) and as an INT8 W8A8
checkpoint (compressed-tensors int-quantized: weights per output channel, activations per token,
as llm-compressor's W8A8 scheme writes it), the quantized one kept (`--quantized-weights keep`:
INT8 activations, torch._int_mm) and dequantized at load (W8A16 in float32), in turns, the same
requests each time. Prints tokens/s per configuration (median of the passes) and the ratios to the
dense model. (The answers' correctness is the tests': tests/engine/test_quantized_checkpoints.py;
on random weights any rounding moves a greedy answer, so they are not compared here.)

    python -m bench.quant_bench [--passes 3] [--requests 32] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "build", "bench-quant")
# Matmuls large enough to dominate a step on a CPU (the projections are what W8A8 changes).
MODEL_SPEC = dict(arch="llama", vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_layers=4,
                  num_heads=16, num_kv_heads=8, seed=0)


def int8_w8a8(dense: str, out: str) -> str:
    """A copy of `dense` whose attention and MLP projections are INT8 per output channel
    (symmetric, amax / 127.5 as compressed-tensors computes it), with dynamic per-token INT8
    activations in the config."""
    import shutil

    from safetensors.torch import load_file, save_file

    if os.path.exists(os.path.join(out, "config.json")):
        return out
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(dense):
        if not name.endswith(".safetensors") and os.path.isfile(os.path.join(dense, name)):
            shutil.copy(os.path.join(dense, name), out)
    tensors = load_file(os.path.join(dense, "model.safetensors"))
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        w = tensors.pop(name).float()
        scale = (w.abs().amax(dim=1, keepdim=True) / 127.5).clamp(min=1e-12)
        tensors[name] = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
        tensors[name[:-len("weight")] + "weight_scale"] = scale
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True,
                                  "dynamic": True}}}}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from engine import LLM, SamplingParams
    from engine.tiny import make_tiny_model

    dense = os.path.join(OUT, "dense")
    if not os.path.exists(os.path.join(dense, "config.json")):
        make_tiny_model(dense, **MODEL_SPEC)
    quantized = int8_w8a8(dense, os.path.join(OUT, "int8-w8a8"))
    rng = random.Random(0)
    prompts = [[rng.randrange(10, MODEL_SPEC["vocab_size"]) for _ in range(args.prompt_len)]
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    configs = {"dense float32": (dense, {}), "int8 w8a8 keep": (quantized, {"quantized_weights": "keep"}),
               "int8 dequantized": (quantized, {})}
    engines = {name: LLM(path, num_threads=args.threads, enable_prefix_caching=False, **kw)
               for name, (path, kw) in configs.items()}
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for llm in engines.values():  # a warm-up pass each
        llm.generate(prompts[:4], params)
    for i in range(args.passes):
        for name, llm in engines.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            took = time.perf_counter() - start
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / took)
            print(f"pass {i + 1} {name}: {rates[name][-1]:.1f} tokens/s", flush=True)
    base = statistics.median(rates["dense float32"])
    print(f"\n{args.requests} requests of {args.prompt_len} prompt + {args.output_len} output tokens, "
          f"{args.threads} threads, hidden {MODEL_SPEC['hidden_size']}, {MODEL_SPEC['num_layers']} layers")
    print("| configuration | tokens/s (median) | vs dense |")
    print("|---|---|---|")
    for name in configs:
        rate = statistics.median(rates[name])
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x |")
    print(f"int8_w8a8_keep_vs_dense_throughput_ratio={statistics.median(rates['int8 w8a8 keep']) / base:.2f}")
    print(f"int8_w8a8_keep_vs_dequantized_throughput_ratio="
          f"{statistics.median(rates['int8 w8a8 keep']) / statistics.median(rates['int8 dequantized']):.2f}")


if __name__ == "__main__":
    main()
