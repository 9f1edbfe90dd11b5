"""python -m bench.tp_bench (make bench-tp): tensor parallelism on this machine's CPU cores, in one run.

TP=2 with one torch thread per rank against TP=1 with two threads (the same two cores), on a
random-weight Llama whose matmuls dominate a step (hidden 1024, MLP 4096, 4 layers, ~60M weights).
Each engine core is driven step by step, as a service runs it, and each step timed from schedule()
to the sampled tokens: a prefill of one long prompt, and decode steps at batch 1 and 16. The three
engines live side by side and take turns, round after round, so a burst of other work on the
machine falls on all of them; each figure is the median over the rounds (min-max alongside). Then the cost of one gloo all-reduce of the activations a step all-reduces ([tokens,
hidden] float32) between two processes; a TP=2 step does 2 per layer, plus one for the embedding.

Prints the table and the ratios (TP=2 step time / TP=1 step time: below 1 is a gain), writes them
to build/tp-bench/results.json. One GPU cannot show TP (the ranks need a device each); on a
machine with several, run the engines with --device cuda.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import time

from bench.procs import ensure_tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO, "build", "tp-bench")
MODEL_SPEC = dict(arch="llama", hidden_size=1024, intermediate_size=4096, num_layers=4, num_heads=16,
                  num_kv_heads=4, max_position_embeddings=2048, initializer_range=0.02, seed=0)
MODEL_VERSION = "v1"  # bump when MODEL_SPEC changes
# The third, one core alone, tells a TP gain from TP=1's threads losing to a loaded machine
# (an OpenMP barrier waits for its slowest thread).
SETUPS = [("TP=1, 2 threads", 1, 2), ("TP=2, 1 thread per rank", 2, 1), ("TP=1, 1 thread", 1, 1)]


class Stepper:
    """An engine core driven one step at a time; every prompt fresh (no prefix caching)."""

    def __init__(self, model: str, tp: int, threads: int, device: str) -> None:
        from engine.config import EngineConfig
        from engine.engine_core import EngineCore

        self.threads = threads

        self.core = EngineCore(EngineConfig.create(
            model, device=device, num_threads=threads, tensor_parallel_size=tp, num_blocks=1024,
            max_num_batched_tokens=2048, max_num_seqs=32, enable_prefix_caching=False))
        self.n = 0

    def add(self, prompt_len: int, max_tokens: int) -> None:
        from engine.request import Request, SamplingParams

        self.n += 1
        vocab = self.core.vocab_size
        prompt = [(self.n * 7919 + i * 31) % (vocab - 10) + 10 for i in range(prompt_len)]
        self.core.add_request(Request(f"r{self.n}", prompt,
                                      SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)))

    def measure(self, prompt_len: int, context: int, steps: int) -> dict[str, float]:
        import torch

        torch.set_num_threads(self.threads)  # process-wide: the engines here take turns
        return {"prefill": self.prefill(prompt_len, 1), "decode_b1": self.decode(1, context, steps),
                "decode_b16": self.decode(16, context, steps)}

    def step(self) -> float:
        sched, runner = self.core.scheduler, self.core.runner
        start = time.perf_counter()
        so = sched.schedule()
        sched.update_from_output(so, runner.collect(runner.launch(so)))
        return time.perf_counter() - start

    def finish(self) -> None:
        self.core.abort_requests(list(self.core.scheduler.requests))
        while self.core.has_work():
            self.step()

    def prefill(self, prompt_len: int, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            self.add(prompt_len, 1)
            times.append(self.step())
            self.finish()
        return statistics.median(times)

    def decode(self, batch: int, context: int, steps: int) -> float:
        for _ in range(batch):
            self.add(context, steps + 4)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in self.core.scheduler.requests.values()):
            self.step()
        times = [self.step() for _ in range(steps)]
        self.finish()
        return statistics.median(times)


def _allreduce_peer(port: int, shapes: list[tuple[int, int]], iters: int) -> None:
    import torch

    from engine.parallel.group import make_device_group, make_store

    torch.set_num_threads(1)
    pg = make_device_group(1, 2, make_store(1, 2, port), torch.device("cpu"))
    for shape in shapes:
        x = torch.randn(shape)
        for _ in range(iters + 3):
            pg.allreduce([x]).wait()


def allreduce_seconds(shapes: list[tuple[int, int]], iters: int) -> dict[tuple[int, int], float]:
    """Median seconds of one all-reduce of each [rows, hidden] float32 between two processes."""
    import torch

    from engine.parallel.group import make_device_group, make_store

    torch.set_num_threads(1)
    store = make_store(0, 2)
    peer = multiprocessing.get_context("spawn").Process(target=_allreduce_peer, args=(store.port, shapes, iters))
    peer.start()
    pg = make_device_group(0, 2, store, torch.device("cpu"))
    result = {}
    for shape in shapes:
        x = torch.randn(shape)
        times = []
        for i in range(iters + 3):
            start = time.perf_counter()
            pg.allreduce([x]).wait()
            if i >= 3:  # warm-up: the first exchanges set up the pair's buffers
                times.append(time.perf_counter() - start)
        result[shape] = statistics.median(times)
    peer.join(60)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--decode-context", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3, help="turns of every engine (median over them)")
    args = ap.parse_args()
    os.makedirs(OUT_DIR, exist_ok=True)
    model = ensure_tiny_model(os.path.join(OUT_DIR, f"model-{MODEL_VERSION}"), **MODEL_SPEC)
    load_before = os.getloadavg()
    samples: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in SETUPS}
    engines = {}
    try:
        for name, tp, threads in SETUPS:
            engines[name] = Stepper(model, tp, threads, args.device)
            engines[name].measure(64, 16, 2)  # warm-up
        for r in range(args.rounds):
            for name in engines:
                samples[name].append(engines[name].measure(args.prompt_len, args.decode_context, args.decode_steps))
                print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in
                                                           samples[name][-1].items()), flush=True)
    finally:
        for s in engines.values():
            s.core.shutdown()
    rows = {name: {k: statistics.median(x[k] for x in runs) for k in runs[0]} for name, runs in samples.items()}
    spread = {name: {k: (min(x[k] for x in runs), max(x[k] for x in runs)) for k in runs[0]}
              for name, runs in samples.items()}
    hidden, layers = MODEL_SPEC["hidden_size"], MODEL_SPEC["num_layers"]
    shapes = {"prefill": (args.prompt_len, hidden), "decode_b1": (1, hidden), "decode_b16": (16, hidden)}
    ar = allreduce_seconds(list(shapes.values()), iters=50)
    per_step = 2 * layers + 1
    tp1, tp2, single = (rows[name] for name, _, _ in SETUPS)
    print(f"\nloaded machine: load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after "
          f"({os.cpu_count()} cores, other work may share them)")
    print(f"{'step':<12}{'TP=1 x2 thr':>14}{'TP=2 x1 thr':>14}{'TP=1 x1 thr':>14}{'TP2/TP1':>10}"
          f"{'1 all-reduce':>16}{f'x{per_step} per step':>16}   (medians over {args.rounds} rounds)")
    results = {}
    for kind, shape in shapes.items():
        ratio = tp2[kind] / tp1[kind]
        cost = ar[shape]
        print(f"{kind:<12}{tp1[kind] * 1e3:>11.1f} ms{tp2[kind] * 1e3:>11.1f} ms{single[kind] * 1e3:>11.1f} ms"
              f"{ratio:>10.2f}"
              f"{cost * 1e6:>13.0f} us{cost * per_step * 1e3:>13.2f} ms")
        results[kind] = {"tp1_s": tp1[kind], "tp2_s": tp2[kind], "tp1_one_thread_s": single[kind],
                         "min_max_s": {name: spread[name][kind] for name in spread},
                         "tp2_over_tp1": ratio,
                         "allreduce_shape": list(shape), "allreduce_s": cost,
                         "allreduce_per_step_s": cost * per_step}
    for kind, r in results.items():
        lo_hi = "; ".join(f"{name} {a * 1e3:.1f}-{b * 1e3:.1f} ms" for name, (a, b) in r["min_max_s"].items())
        print(f"tp_{kind}_ratio={r['tp2_over_tp1']:.3f}  (min-max: {lo_hi})")
    out = {"model": MODEL_SPEC, "setups": SETUPS, "args": vars(args), "results": results,
           "load_average": [load_before[0], os.getloadavg()[0]], "cpu_count": os.cpu_count(),
           "platform": platform.platform()}
    with open(os.path.join(OUT_DIR, "results.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
