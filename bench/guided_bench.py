"""python -m bench.guided_bench: the cost of structured outputs. pdserve with a JSON schema against
pdserve without it, in the same run, on the engine benchmark's workload and model.

Every guided request is constrained by a schema (an array of objects with integers, bounded
strings and enums) whose documents cannot end within the workload's output lengths, so both
sides generate exactly the same number of tokens and the ratio of throughputs is the cost of
compiling, filling and applying the grammar's bitmask. Target: guided/free >= 0.85.

Both wall time and this process's CPU time are measured per pass. On a quiet machine they tell
the same story; on a shared one, wall time swings with the neighbours' load (passes of the same
side differ by several times) while CPU time per token stays what the work costs, so the ratio
is reported on both, best pass of each side.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from bench.engine_bench import MODEL_SPEC, ensure_checkpoint, make_workload

SCHEMA = {
    "type": "array", "minItems": 400,  # no document closes within 256 tokens
    "items": {"type": "object", "additionalProperties": False, "required": ["id", "name", "kind", "tags"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                             "name": {"type": "string", "maxLength": 12},
                             "kind": {"enum": ["alpha", "beta", "gamma"]},
                             "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                      "maxItems": 3}}},
}
TARGET = 0.85


def run(args) -> dict:
    import torch

    from engine import LLM, SamplingParams
    from engine.structured_output.params import StructuredOutputsParams

    if args.threads:
        torch.set_num_threads(args.threads)
    model = ensure_checkpoint(sys.executable)
    prompt_len, output_len, num_requests = (32, 512), (16, 256), 64
    if args.quick:
        prompt_len, output_len, num_requests = (32, 128), (8, 64), 16
    workload = make_workload(num_requests, prompt_len, output_len, MODEL_SPEC["vocab_size"], seed=0)
    prompts = [r["prompt_token_ids"] for r in workload]
    guided = StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True)

    def params(structured):
        return [SamplingParams(temperature=0.0, max_tokens=r["output_len"], min_tokens=r["output_len"],
                               ignore_eos=True, structured_outputs=structured) for r in workload]

    llm = LLM(model=model, dtype="float32", num_threads=args.threads)
    sides = {"free": params(None), "guided": params(guided)}
    walls: dict[str, list[float]] = {name: [] for name in sides}
    cpus: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, int] = {}
    for name, p in sides.items():  # warm-up: kernels, and the grammar's compile (then cached)
        llm.generate(prompts, p)
    bitmask = llm.engine.runner.grammar_bitmask
    mask_s = []
    for i in range(args.passes):  # interleaved, the order alternating: both sides see the same load
        for name, p in (sides.items() if i % 2 == 0 else reversed(sides.items())):
            t0, c0, m0 = time.perf_counter(), time.process_time(), bitmask.host_seconds
            outs = llm.generate(prompts, p)
            walls[name].append(time.perf_counter() - t0)
            cpus[name].append(time.process_time() - c0)
            if name == "guided":
                mask_s.append(bitmask.host_seconds - m0)
            tokens[name] = sum(len(o.outputs[0].token_ids) for o in outs)
            if name == "guided":
                check_prefixes([o.outputs[0].text for o in outs])
    if tokens["free"] != tokens["guided"]:
        raise RuntimeError(f"the sides generated different token counts: {tokens}")
    best = {name: min(w) for name, w in walls.items()}
    best_cpu = {name: min(c) for name, c in cpus.items()}
    tput = {name: tokens[name] / best[name] for name in sides}
    tput_cpu = {name: tokens[name] / best_cpu[name] for name in sides}
    return {"num_requests": num_requests, "output_tokens": tokens["free"], "passes": args.passes,
            "wall_s": walls, "cpu_s": cpus, "best_wall_s": best, "best_cpu_s": best_cpu,
            "median_wall_s": {n: statistics.median(w) for n, w in walls.items()},
            "throughput_tok_s": tput, "throughput_tok_per_cpu_s": tput_cpu,
            "guided_vs_free_throughput_ratio": tput["guided"] / tput["free"],
            "guided_vs_free_cpu_throughput_ratio": tput_cpu["guided"] / tput_cpu["free"],
            # The grammar's own share of a guided pass (filling and applying the bitmask): the
            # part of the cost no neighbour's load can hide or inflate much.
            "bitmask_share_of_guided_wall": statistics.median(m / w for m, w in zip(mask_s, walls["guided"])),
            "grammar": llm.engine.stats()}


def check_prefixes(texts: list[str]) -> None:
    """Each guided output is the start of an array of the schema's objects (it is cut by length)."""
    for text in texts:
        if not text.startswith("[{\"id\": "):
            raise RuntimeError(f"a guided output is not the schema's document: {text[:80]!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passes", type=int, default=3, help="timed passes per side (best one counts)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="a smaller workload (a smoke test)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    r = run(args)
    print(f"guided decoding benchmark: {r['num_requests']} requests, {r['output_tokens']} output tokens per pass, "
          f"best of {r['passes']} interleaved passes per side")
    print(f"{'side':8} {'best wall s':>12} {'median wall s':>14} {'tok/s':>10} {'best cpu s':>11} {'tok/cpu-s':>10}")
    for name in ("free", "guided"):
        print(f"{name:8} {r['best_wall_s'][name]:12.3f} {r['median_wall_s'][name]:14.3f} "
              f"{r['throughput_tok_s'][name]:10.1f} {r['best_cpu_s'][name]:11.3f} "
              f"{r['throughput_tok_per_cpu_s'][name]:10.1f}")
    for key in ("guided_vs_free_throughput_ratio", "guided_vs_free_cpu_throughput_ratio"):
        ratio = r[key]
        print(f"{key} {ratio:.3f} (target >= {TARGET}: {'met' if ratio >= TARGET else 'NOT met'})")
    print(f"bitmask fill + apply: {100 * r['bitmask_share_of_guided_wall']:.1f}% of a guided pass's wall time")
    print(f"grammar compiles {r['grammar']['grammar_compiles']}, cache hits {r['grammar']['grammar_cache_hits']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
