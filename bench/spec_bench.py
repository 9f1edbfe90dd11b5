"""python -m bench.spec_bench: pdserve's engine with and without n-gram speculation, in the same run.

A random-weight Llama with tied embeddings whose layers write weakly into the residual stream
(o_proj and down_proj scaled by RESIDUAL_SCALE) falls into repeating cycles under greedy decoding
(mostly one token again and again), which n-gram lookup over the prompt and output predicts: the
speed case. Sampling at temperature 1 from the same model is close to uniform over its 4,096
tokens, so proposals are (almost) never accepted: the back-off case, where speculation must cost
next to nothing.

Prints ITL (mean time between a request's tokens, its median over requests) at batch 1 and 8,
`spec_itl_speedup_b1` (target >= 1.8), `spec_itl_speedup_b8`, and `spec_noaccept_throughput_ratio`
(target >= 0.95), and writes them with the acceptance figures to build/spec-bench/results.json.
The model is large enough that a forward pass costs more than the engine's Python around it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from bench.procs import ensure_tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO, "build", "spec-bench")
MODEL_SPEC = dict(arch="llama", vocab_size=4096, hidden_size=640, intermediate_size=1728, num_layers=4,
                  num_heads=10, num_kv_heads=5, tie_word_embeddings=True, initializer_range=0.02, seed=0)
RESIDUAL_SCALE = 0.5
MODEL_VERSION = "v2"  # bump when MODEL_SPEC, RESIDUAL_SCALE or the way the checkpoint is made changes


def ensure_model() -> str:
    path = os.path.join(OUT_DIR, f"model-{MODEL_VERSION}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import glob

    from safetensors.torch import load_file, save_file

    tmp = path + ".tmp"
    ensure_tiny_model(tmp, **MODEL_SPEC)
    for file in glob.glob(os.path.join(tmp, "*.safetensors")):
        weights = load_file(file)
        for name in weights:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weights[name] = weights[name] * RESIDUAL_SCALE
        save_file(weights, file, metadata={"format": "pt"})
    os.rename(tmp, path)
    return path


def run(core_factory, prompts: list[list[int]], params) -> dict:
    """Every prompt at once on a fresh engine; per-request ITL from the tokens' arrival times."""
    from engine.request import Request

    core = core_factory()
    arrivals: dict[str, list[float]] = {}
    for i, prompt in enumerate(prompts):
        core.add_request(Request(str(i), list(prompt), params, eos_token_id=None))
        arrivals[str(i)] = []
    start = time.perf_counter()
    num_tokens = 0
    while core.has_work():
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            arrivals[out.request_id] += [now] * len(out.new_token_ids)
            num_tokens += len(out.new_token_ids)
    elapsed = time.perf_counter() - start
    # Mean gap between consecutive tokens of a request after its first (a burst of accepted
    # tokens arrives at once: its gaps are zero, which is what a reader of the stream sees).
    itls = [(t[-1] - t[0]) / (len(t) - 1) for t in arrivals.values() if len(t) > 1]
    stats = core.stats()
    core.shutdown()
    return {"itl_ms": 1000 * statistics.median(itls), "tokens_per_s": num_tokens / elapsed,
            "acceptance_rate": stats.get("spec_decode_acceptance_rate"),
            "mean_accepted_length": stats.get("spec_decode_mean_accepted_length"),
            "drafts": stats.get("spec_decode_num_drafts"), "backed_off": stats.get("spec_decode_num_backed_off")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of both engines (1: on a busy CPU box, OpenMP barriers in multi-row "
                        "matmuls stall behind other processes and swamp what is measured)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each side, alternating; each side's best run counts (noise only slows a run)")
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)

    from engine.config import EngineConfig
    from engine.engine_core import EngineCore
    from engine.request import SamplingParams

    model = ensure_model()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}

    def factory(speculative: bool):
        kwargs = dict(device=args.device, num_threads=args.threads, num_blocks=2048, max_model_len=1024)
        if speculative:
            kwargs["speculative_config"] = spec
        return lambda: EngineCore(EngineConfig.create(model, **kwargs))

    rng = random.Random(0)
    vocab = MODEL_SPEC["vocab_size"]
    prompts = [[rng.randrange(10, vocab - 100) for _ in range(args.prompt_len)] for _ in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=None)
    run(factory(False), prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up (kernels, caches)

    def best(runs: list[dict]) -> dict:
        return min(runs, key=lambda r: r["itl_ms"])

    results = {}
    for name, batch, params in (("b1", 1, greedy), ("b8", 8, greedy), ("noaccept_b8", 8, sampled)):
        base_runs, fast_runs = [], []
        for _ in range(args.repeats):
            base_runs.append(run(factory(False), prompts[:batch], params))
            fast_runs.append(run(factory(True), prompts[:batch], params))
        base, fast = best(base_runs), best(fast_runs)
        results[name] = {"baseline": base, "ngram": fast}
        print(f"{name}: ITL {base['itl_ms']:.1f} ms -> {fast['itl_ms']:.1f} ms, "
              f"{base['tokens_per_s']:.1f} -> {fast['tokens_per_s']:.1f} tok/s, acceptance "
              f"{fast['acceptance_rate']:.3f}, mean accepted length {fast['mean_accepted_length']:.2f}, "
              f"{fast['drafts']} drafts, {fast['backed_off']} backed off", flush=True)
    figures = {
        "spec_itl_speedup_b1": results["b1"]["baseline"]["itl_ms"] / results["b1"]["ngram"]["itl_ms"],
        "spec_itl_speedup_b8": results["b8"]["baseline"]["itl_ms"] / results["b8"]["ngram"]["itl_ms"],
        "spec_noaccept_throughput_ratio": (results["noaccept_b8"]["ngram"]["tokens_per_s"]
                                           / results["noaccept_b8"]["baseline"]["tokens_per_s"]),
    }
    for key, value in figures.items():
        print(f"{key} {value:.3f}")
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, "results.json"), "w") as f:
        json.dump({"model": {**MODEL_SPEC, "residual_scale": RESIDUAL_SCALE}, "args": vars(args), "runs": results,
                   **figures}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
