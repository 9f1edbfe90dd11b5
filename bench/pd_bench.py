"""`make bench-pd`: disaggregated vs colocated pdserve vs vLLM's CPU server, same workload.

(a) disaggregated: one prefill service on core 0, one decode service on core 1;
(b) colocated: two colocated services, one per core, behind the same router (least load);
(c) vLLM's CPU build serving the same checkpoint on both cores (its OpenAI server).
Long prompts, moderate outputs, Poisson arrivals at several rates; TTFT/ITL/TPOT/goodput.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.metrics import parse_slos  # noqa: E402
from bench.procs import Proc, allowed_cpus, ensure_tiny_model, exit_on_signals, free_port, grpc_serving, http_ok, pdserve_cmd, wait_until  # noqa: E402
from bench.serve import run_benchmark  # noqa: E402
from bench.workloads import synthetic  # noqa: E402

BUILD = os.path.join(ROOT, "build", "bench-pd")
MODEL_SHAPE = dict(arch="llama", vocab_size=4096, hidden_size=512, intermediate_size=1376, num_layers=8,
                   num_heads=8, num_kv_heads=4, max_position_embeddings=4096, initializer_range=0.02)


def ensure_model() -> str:
    return ensure_tiny_model(os.path.join(BUILD, "model"), **MODEL_SHAPE)


class Config:
    """One serving configuration: start(), its URL, stop()."""

    def __init__(self, name: str, model: str, logs: str) -> None:
        self.name, self.model, self.logs, self.procs = name, model, logs, []

    def spawn(self, name, cmd, cores=None, env=None) -> Proc:
        p = Proc(f"{self.name}-{name}", cmd, cores, env, self.logs)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def start_pdserve(name: str, model: str, logs: str, disaggregated: bool, engine_args: list[str],
                  wide: bool = False) -> tuple[Config, str]:
    """1P+1D or 2C, a core and a thread per instance; wide: one colocated instance, two threads on both."""
    cfg = Config(name, model, logs)
    env = dict(os.environ, PDSERVE_KV_SECRET=secrets.token_hex(8))
    threads = "2" if wide else "1"
    common = ["--model", model, "--num-threads", threads, "--max-model-len", "4096", *engine_args]
    a, b = (allowed_cpus() * 2)[:2]  # the first two allowed CPUs (one, twice, on a one-CPU box)
    roles = ([("colocated", {a, b})] if wide else [("prefill", {a}), ("decode", {b})] if disaggregated
             else [("colocated", {a}), ("colocated", {b})])
    addrs = {}
    for i, (role, cores) in enumerate(roles):
        port = free_port()
        extra = ["--kv-transport", "tcp"] if role != "colocated" else []
        cfg.spawn(f"{role}{i}", pdserve_cmd(role, *common, "--port", str(port), *extra), cores, env)
        addrs.setdefault(role, []).append(f"127.0.0.1:{port}")
    wait_until(lambda: all(grpc_serving(a) for v in addrs.values() for a in v), cfg.procs, f"{name} engines")
    http = free_port()
    router = ["router", "--model", model, "--host", "127.0.0.1", "--port", str(http), "--policy", "least_load",
              "--grpc-port", "-1"]
    if disaggregated:
        router += ["--prefill", addrs["prefill"][0], "--decode", addrs["decode"][0]]
    else:
        router += ["--decode", ",".join(addrs["colocated"])]
    cfg.spawn("router", pdserve_cmd(*router), env=env)
    url = f"http://127.0.0.1:{http}"
    wait_until(lambda: http_ok(f"{url}/health"), cfg.procs, f"{name} router")
    return cfg, url


def start_vllm(model: str, logs: str) -> tuple[Config, str]:
    from bench.vllm_cpu import prepare_venv

    python, env = prepare_venv(os.path.join(ROOT, "build"), "0-1")
    cfg = Config("vllm", model, logs)
    port = free_port()
    cfg.spawn("server", [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                         "--dtype", "float32", "--port", str(port), "--host", "127.0.0.1",
                         "--max-model-len", "4096", "--served-model-name", "bench"], env=env)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_ok(f"{url}/v1/models"), cfg.procs, "vLLM's server", timeout=1200)
    return cfg, url


def row(name: str, s: dict) -> str:
    return (f"{name:<14}{s['p90_ttft_ms']:>12.0f}{s['p99_itl_ms']:>12.1f}{s['median_tpot_ms']:>13.1f}"
            f"{s['request_goodput']:>11.3f}{100 * s['slo_attainment']:>9.0f}%{s['failed']:>7}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rates", default="0.1,0.2,0.3", help="request rates (req/s) to sweep")
    ap.add_argument("--num-prompts", type=int, default=12, help="requests per rate")
    ap.add_argument("--input-len", default="uniform:1024:2048")
    ap.add_argument("--output-len", default="uniform:64:128")
    ap.add_argument("--goodput", nargs="*", default=["ttft:4000", "tpot:100"], help="SLOs (ms)")
    ap.add_argument("--configs", default="disaggregated,colocated,vllm")
    ap.add_argument("--engine-arg", action="append", default=[])
    ap.add_argument("--out", default=os.path.join(BUILD, "results"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    logs = os.path.join(BUILD, "logs")
    os.makedirs(logs, exist_ok=True)
    model = ensure_model()
    slos = parse_slos(args.goodput)
    rates = [float(r) for r in args.rates.split(",")]
    # Fresh prompts for every rate (and for the warm-up): no run may hit another's prefix cache.
    workloads = {rate: synthetic(args.num_prompts, args.input_len, args.output_len, vocab_size=4000, seed=i + 1)
                 for i, rate in enumerate(rates)}
    warmup = synthetic(2, "fixed:64", "fixed:8", vocab_size=4000, seed=0)
    print(f"model: random Llama {MODEL_SHAPE}, float32; {args.num_prompts} requests per rate, prompts "
          f"{args.input_len}, outputs {args.output_len}; SLOs {' '.join(args.goodput)} (ms)", flush=True)
    results: dict[str, dict[float, dict]] = {}
    for name in args.configs.split(","):
        try:
            if name == "vllm":
                cfg, url = start_vllm(model, logs)
            else:
                cfg, url = start_pdserve(name, model, logs, name == "disaggregated", args.engine_arg)
        except Exception as e:  # e.g. vLLM cannot be installed here: report the rest
            print(f"{name}: not measured ({type(e).__name__}: {e})", flush=True)
            continue
        try:
            asyncio.run(run_benchmark(url, None, warmup, progress=False))
            for rate in rates:
                s = asyncio.run(run_benchmark(url, None, workloads[rate], rate=rate, slos=slos, seed=1))
                s["label"] = name
                results.setdefault(name, {})[rate] = s
                print(f"  {name} @ {rate:g} req/s: " + row(name, s), flush=True)
                with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                    json.dump(list(results[name].values()), f)
        finally:
            cfg.stop()
    print(f"\n{'config':<14}{'TTFT p90 ms':>12}{'ITL p99 ms':>12}{'TPOT p50 ms':>13}{'goodput':>11}"
          f"{'in SLO':>10}{'failed':>7}")
    for rate in rates:
        print(f"-- {rate:g} req/s")
        for name, by_rate in results.items():
            if rate in by_rate:
                print(row(name, by_rate[rate]))
    colo = results.get("colocated", {})
    ok = [r for r in rates if r in colo and colo[r]["slo_attainment"] >= 0.5]
    if not ok or "disaggregated" not in results:
        print("no rate where colocated meets the SLO for half of the requests: no ratios", flush=True)
        return 1
    r = max(ok)
    pd = results["disaggregated"][r]
    print(f"\nratios at {r:g} req/s, the highest rate where colocated meets the SLOs for >= 50% of requests:")
    for base in ("colocated", "vllm"):
        b = results.get(base, {}).get(r)
        if b is None:
            print(f"pd_vs_{base}_itl_p99_ratio=nan\npd_vs_{base}_goodput_ratio=nan  ({base} not measured)")
            continue
        tag = "colocated" if base == "colocated" else "vllm"
        itl = pd["p99_itl_ms"] / b["p99_itl_ms"] if b["p99_itl_ms"] > 0 else float("nan")
        good = pd["request_goodput"] / b["request_goodput"] if b["request_goodput"] > 0 else float("inf")
        print(f"pd_vs_{tag}_itl_p99_ratio={itl:.3f}")
        print(f"pd_vs_{tag}_goodput_ratio={good:.3f}")
    return 0


if __name__ == "__main__":
    exit_on_signals()  # SIGTERM stops the stack this started, too
    sys.exit(main())
