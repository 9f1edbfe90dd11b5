"""make bench-engine: pdserve's engine against vLLM's CPU build and transformers, same model, same requests.

Each engine runs in its own subprocess (its own peak RSS, and vLLM in its own virtualenv).
The orchestrator and the helpers the workers share import only the standard library at
module level, because vLLM's worker (bench/vllm_cpu.py) imports them from a different venv.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(REPO, "build", "bench-engine")

# The model: a random Llama, float32.
MODEL_SPEC = dict(arch="llama", vocab_size=4096, hidden_size=256, intermediate_size=688,
                  num_layers=4, num_heads=8, num_kv_heads=4, seed=0)
MODEL_VERSION = "v1"  # bump when MODEL_SPEC or the way the checkpoint is made changes
# `--moe`: a random Qwen3-MoE of the same attention, 16 experts of 128, 4 routed per token
# (renormalised), every layer sparse: the active MLP a token runs is about the dense model's.
MOE_MODEL_SPEC = dict(arch="qwen3_moe", vocab_size=4096, hidden_size=256, intermediate_size=688,
                      num_layers=4, num_heads=8, num_kv_heads=4, num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=128, moe_config={"norm_topk_prob": True}, seed=0)


# -- shared with the workers (stdlib only) ------------------------------------------------------
def parse_cpu_list(spec: str) -> list[int]:
    """"0-1" / "0,2,4-5" -> [0, 1] / [0, 2, 4, 5] (the syntax of VLLM_CPU_OMP_THREADS_BIND)."""
    cpus: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_cpus(spec: str, num_threads: int) -> None:
    """The pdserve and transformers workers: the cores vLLM binds, and as many torch threads."""
    import torch

    os.sched_setaffinity(0, parse_cpu_list(spec))
    torch.set_num_threads(num_threads)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            kids.append(int(entry))
    return kids


def _vm_hwm_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss_mib() -> float:
    """Peak RSS of this process plus every live descendant (vLLM runs its engine core and
    model worker as child processes). A sum of per-process peaks: pages the processes share
    (libraries) count once per process, as `ps` would show them."""
    total, stack, seen = 0, [os.getpid()], set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += _vm_hwm_kib(pid)
        stack.extend(_children(pid))
    return total / 1024


def timed_passes(run_pass, passes: int, warmup) -> tuple[list[float], object]:
    """Run warmup() once, then `passes` timed calls of run_pass(); wall times and the last result."""
    warmup()
    walls, result = [], None
    for _ in range(passes):
        t0 = time.perf_counter()
        result = run_pass()
        walls.append(time.perf_counter() - t0)
    return walls, result


def load_spec(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--spec", required=True)
    args, _ = p.parse_known_args(argv)
    with open(args.spec) as f:
        return json.load(f)


def write_result(spec: dict, result: dict) -> None:
    result.setdefault("peak_rss_mib", peak_rss_mib())
    tmp = spec["out"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, spec["out"])


# -- workload and checkpoint --------------------------------------------------------------------
def make_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  vocab_size: int, seed: int = 0) -> list[dict]:
    """Fixed-seed requests: uniform prompt and output lengths, prompt tokens uniform over the
    ordinary vocabulary (ids below 16 are left out: the tokenizer's specials live there)."""
    rng = random.Random(seed)
    lengths = [(rng.randint(*prompt_len), rng.randint(*output_len)) for _ in range(num_requests)]
    return [{"prompt_token_ids": [rng.randrange(16, vocab_size) for _ in range(p)], "output_len": o}
            for p, o in lengths]


def ensure_checkpoint(python: str, moe: bool = False) -> str:
    """The benchmark model, written once by engine.tiny (transformers' save_pretrained + a tokenizer)."""
    spec = MOE_MODEL_SPEC if moe else MODEL_SPEC
    path = os.path.join(BENCH_DIR, f"model-{'moe-' if moe else ''}{MODEL_VERSION}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    tmp = path + f".tmp{os.getpid()}"
    code = ("import sys, json; from engine.tiny import make_tiny_model; "
            "make_tiny_model(sys.argv[1], **json.loads(sys.argv[2]))")
    os.makedirs(os.path.join(BENCH_DIR, "logs"), exist_ok=True)
    with open(os.path.join(BENCH_DIR, "logs", "checkpoint.log"), "w") as log:
        subprocess.run([python, "-c", code, tmp, json.dumps(spec)], check=True, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=REPO), stdout=log, stderr=subprocess.STDOUT)
    with open(os.path.join(tmp, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    if vocab != spec["vocab_size"]:
        raise RuntimeError(f"tiny checkpoint has vocab {vocab}, expected {spec['vocab_size']}")
    os.replace(tmp, path)
    return path


def ensure_adapters(model: str, count: int, rank: int) -> list[str]:
    """`--lora N`: N random PEFT adapters of the checkpoint (every attention and MLP projection at
    `rank`, A and B drawn so they change the answers), written once by peft's save_pretrained."""
    root = os.path.join(BENCH_DIR, f"lora-{os.path.basename(model)}-r{rank}")
    paths = [os.path.join(root, f"a{i}") for i in range(count)]
    missing = [(i, p) for i, p in enumerate(paths) if not os.path.isfile(os.path.join(p, "adapter_config.json"))]
    if missing:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        for i, path in missing:
            torch.manual_seed(1000 + i)
            peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), LoraConfig(
                r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                              "gate_proj", "up_proj", "down_proj"]))
            with torch.no_grad():
                for name, param in peft_model.named_parameters():
                    if "lora_" in name:
                        param.normal_(0.0, 0.02)
            peft_model.save_pretrained(path)
    return paths


def length_range(text: str) -> tuple[int, int]:
    """"32:512" -> (32, 512); "128" -> (128, 128)."""
    lo, _, hi = text.partition(":")
    try:
        bounds = int(lo), int(hi or lo)
    except ValueError:
        raise SystemExit(f"a length range is MIN:MAX or N, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise SystemExit(f"a length range needs 1 <= MIN <= MAX, got {text!r}")
    return bounds


def checkpoint(path: str | None, moe: bool = False) -> tuple[str, int]:
    """The checkpoint to measure and its vocab size: `path` if given, else the benchmark's own."""
    if path is None:
        return ensure_checkpoint(sys.executable, moe), (MOE_MODEL_SPEC if moe else MODEL_SPEC)["vocab_size"]
    path = os.path.abspath(path)
    try:
        with open(os.path.join(path, "config.json")) as f:
            return path, json.load(f)["vocab_size"]
    except (OSError, KeyError, ValueError) as e:
        raise SystemExit(f"--model {path}: not a checkpoint with a config.json naming vocab_size ({e})") from None


# -- pdserve's engine (worker) ------------------------------------------------------------------
def pdserve_worker(spec: dict) -> None:
    pin_cpus(spec["cpus"], spec["threads"])
    from engine import LLM, SamplingParams

    with open(spec["workload"]) as f:
        workload = json.load(f)
    prompts = [r["prompt_token_ids"] for r in workload]
    adapters = spec.get("lora") or []
    params = [SamplingParams(temperature=0.0, max_tokens=r["output_len"], min_tokens=r["output_len"],
                             ignore_eos=True, lora_name=f"a{r['lora']}" if adapters else None) for r in workload]
    lora = dict(enable_lora=True, lora_modules=[f"a{i}={path}" for i, path in enumerate(adapters)],
                max_lora_rank=spec["lora_rank"]) if adapters else {}
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", num_threads=spec["threads"], **spec["engine_kwargs"], **lora)
    load_s = time.perf_counter() - t0

    def run_pass():
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]

    if spec.get("profile"):
        return profile_pass(run_pass)
    walls, outputs = timed_passes(run_pass, spec["passes"], warmup=run_pass)
    write_result(spec, {"pass_wall_s": walls, "outputs": outputs, "load_s": load_s})


def profile_pass(run_pass) -> None:
    """`--profile`: one warm pass under cProfile, then under torch's profiler."""
    import cProfile
    import pstats

    import torch

    run_pass()
    prof = cProfile.Profile()
    prof.runcall(run_pass)
    stats = pstats.Stats(prof, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tprof:
        run_pass()
    print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


# -- scheduler_step_us_256 ----------------------------------------------------------------------
def scheduler_step_us(num_running: int = 256, steps: int = 300, seed: int = 0) -> float:
    """Mean CPU time of one schedule() + update_from_output() with num_running requests decoding,
    driven by fake model outputs (the scheduler imports no torch)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from engine.config import SchedulerConfig
    from engine.kv_cache_manager import KVCacheManager
    from engine.request import Request, SamplingParams
    from engine.scheduler import ModelOutput, Scheduler

    rng = random.Random(seed)
    block_size, max_prompt = 16, 512
    blocks_per_request = -(-(max_prompt + steps + 64) // block_size)
    kv = KVCacheManager(num_blocks=num_running * blocks_per_request, block_size=block_size)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=num_running), kv, max_model_len=1 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    for i in range(num_running):
        prompt = [rng.randrange(16, 4096) for _ in range(rng.randint(32, max_prompt))]
        scheduler.add_request(Request(str(i), prompt, params))

    def fake_output(out) -> ModelOutput:
        num_sampled = sum(1 for r, n in zip(out.scheduled, out.num_scheduled_tokens)
                          if r.num_computed_tokens + n >= r.num_tokens)
        return ModelOutput([rng.randrange(16, 4096) for _ in range(num_sampled)])

    while True:  # prefill everything; stop at the first pure decode step of all requests
        out = scheduler.schedule()
        if len(out.scheduled) == num_running and out.total_num_scheduled_tokens == num_running:
            scheduler.update_from_output(out, fake_output(out))
            break
        scheduler.update_from_output(out, fake_output(out))
    cpu_ns = 0
    for _ in range(steps):
        t0 = time.process_time_ns()
        out = scheduler.schedule()
        cpu_ns += time.process_time_ns() - t0
        assert len(out.scheduled) == num_running, "a request left the running batch"
        model_output = fake_output(out)
        t0 = time.process_time_ns()
        scheduler.update_from_output(out, model_output)
        cpu_ns += time.process_time_ns() - t0
    return cpu_ns / steps / 1000


# -- the orchestrator ---------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passes", type=int, default=3, help="timed passes per engine (median reported)")
    p.add_argument("--engines", default="pdserve,vllm,hf", help="subset of pdserve,vllm,hf")
    p.add_argument("--cpus", default="0-1", help="cores for every engine (VLLM_CPU_OMP_THREADS_BIND syntax)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: one per core)")
    p.add_argument("--hf-batch-sizes", default="16,64")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra pdserve LLM(...) keyword (value parsed as JSON when it parses)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra vLLM LLM(...) keyword, e.g. distributed_executor_backend=uni")
    p.add_argument("--model", default=None,
                   help="a checkpoint directory to measure instead of the benchmark's random Llama "
                        "(prompts are token ids below its vocab_size)")
    p.add_argument("--moe", action="store_true",
                   help="measure the benchmark's random Qwen3-MoE (16 experts, 4 per token) instead of its Llama")
    p.add_argument("--requests", type=int, default=64, help="requests, all submitted at once")
    p.add_argument("--prompt-len", default="32:512", help="prompt lengths, uniform MIN:MAX (or one N)")
    p.add_argument("--output-len", default="16:256", help="output lengths, uniform MIN:MAX (or one N)")
    p.add_argument("--quick", action="store_true",
                   help="a small smoke workload (8 requests, short prompts, 1 pass): not the benchmark")
    p.add_argument("--profile", action="store_true",
                   help="profile one pdserve pass (cProfile + torch profiler) instead of benchmarking")
    p.add_argument("--prefix-caching", action="store_true",
                   help="leave prefix caching on in pdserve and vLLM: every pass repeats the same "
                        "prompts, so passes after the warm-up skip nearly all prefill")
    p.add_argument("--lora", type=int, default=0, metavar="N",
                   help="N random LoRA adapters (every projection), request i runs with adapter i %% N, in "
                        "pdserve and vLLM alike (transformers is not run)")
    p.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per engine subprocess")
    p.add_argument("--worker", choices=["pdserve"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def engine_kwargs(pairs: list[str], prefix_caching: bool) -> dict:
    """LLM(...) keywords: prefix caching as asked, then KEY=VALUE pairs (JSON values when they parse)."""
    kwargs: dict = {"enable_prefix_caching": prefix_caching}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    return kwargs


def run_worker(name: str, cmd: list[str], spec: dict, env: dict, timeout: int) -> dict | str:
    """Run one engine in its own process; its result dict, or a one-line reason it failed."""
    spec = dict(spec, out=os.path.join(BENCH_DIR, f"result-{name}.json"))
    spec_path = os.path.join(BENCH_DIR, f"spec-{name}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    if os.path.exists(spec["out"]):
        os.remove(spec["out"])
    log = os.path.join(BENCH_DIR, "logs", f"{name}.log")
    print(f"  running {name} (log: {os.path.relpath(log, REPO)})", flush=True)
    with open(log, "w") as f:
        # Its own session: on a timeout the whole group goes (vLLM's engine core and worker too).
        proc = subprocess.Popen(cmd + ["--spec", spec_path], stdout=f, stderr=subprocess.STDOUT,
                                env=env, cwd=REPO, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"timed out after {timeout} s; see {os.path.relpath(log, REPO)}"
    if rc != 0 or not os.path.exists(spec["out"]):
        with open(log) as f:
            last = [line.strip() for line in f if line.strip()][-1:] or ["(no output)"]
        return f"exit {rc}: {last[0][:200]}; see {os.path.relpath(log, REPO)}"
    with open(spec["out"]) as f:
        return json.load(f)


def summarize(result: dict, workload: list[dict]) -> dict:
    wanted = [r["output_len"] for r in workload]
    got = result["outputs"]
    useful = sum(min(len(o), n) for o, n in zip(got, wanted))
    tps = [useful / w for w in result["pass_wall_s"]]
    return dict(result, useful_tokens=useful, tokens_per_s=statistics.median(tps), pass_tokens_per_s=tps,
                wall_s=statistics.median(result["pass_wall_s"]),
                wrong_lengths=sum(len(o) != n for o, n in zip(got, wanted)))


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(k / max(len(x), 1))
    return f"{same}/{len(a)} identical (mean matching prefix {statistics.mean(prefix):.0%})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker == "pdserve":
        pdserve_worker(load_spec(["--spec", args.spec]))
        return 0
    import vllm_cpu  # bench/vllm_cpu.py: its virtualenv and its worker

    os.makedirs(os.path.join(BENCH_DIR, "logs"), exist_ok=True)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    threads = args.threads or len(parse_cpu_list(args.cpus))
    passes, hf_batches = args.passes, [int(b) for b in args.hf_batch_sizes.split(",")]
    prompt_len, output_len, num_requests = length_range(args.prompt_len), length_range(args.output_len), args.requests
    if args.quick:
        prompt_len, output_len, num_requests, passes = (32, 128), (8, 32), 8, 1
        hf_batches = [4, 8]
    if args.profile:
        engines = ["pdserve"]

    if args.moe and args.model:
        raise SystemExit("--moe measures the benchmark's own mixture of experts; leave --model out")
    if args.moe and args.lora:
        raise SystemExit("--moe: LoRA adapters on a mixture of experts are not served yet; leave --lora out")
    model, vocab_size = checkpoint(args.model, args.moe)
    workload = make_workload(num_requests, prompt_len, output_len, vocab_size, seed=0)
    adapters = ensure_adapters(model, args.lora, args.lora_rank) if args.lora > 0 else []
    for i, r in enumerate(workload):
        r["lora"] = i % len(adapters) if adapters else None
    if adapters:
        engines = [e for e in engines if e != "hf"]
    workload_path = os.path.join(BENCH_DIR, "workload.json")
    with open(workload_path, "w") as f:
        json.dump(workload, f)
    spec = dict(model=model, workload=workload_path, passes=passes, cpus=args.cpus, threads=threads,
                lora=adapters, lora_rank=args.lora_rank)
    pd_env = dict(os.environ, PYTHONPATH=REPO)

    if args.profile:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "pdserve", "--spec"]
        spec = dict(spec, engine_kwargs=engine_kwargs(args.engine_arg, args.prefix_caching), profile=True,
                    out=os.path.join(BENCH_DIR, "result-profile.json"))
        with open(os.path.join(BENCH_DIR, "spec-profile.json"), "w") as f:
            json.dump(spec, f)
        return subprocess.run(cmd + [os.path.join(BENCH_DIR, "spec-profile.json")], env=pd_env,
                              cwd=REPO).returncode

    total_out = sum(r["output_len"] for r in workload)
    print(f"engine benchmark: {num_requests} requests, prompt lengths {prompt_len[0]}..{prompt_len[1]}, "
          f"output lengths {output_len[0]}..{output_len[1]} ({total_out} output tokens), fixed seeds, "
          f"token-id prompts, every request generates exactly its output length")
    if adapters:
        print(f"LoRA: {len(adapters)} adapters of rank {args.lora_rank} on every projection, request i runs with "
              f"adapter i % {len(adapters)} (pdserve: --enable-lora; vLLM: enable_lora, max_loras={len(adapters)})")
    if args.moe:
        m = MOE_MODEL_SPEC
        print(f"model: random Qwen3-MoE (vocab {m['vocab_size']}, hidden {m['hidden_size']}, {m['num_experts']} experts "
              f"of {m['moe_intermediate_size']}, {m['num_experts_per_tok']} per token, {m['num_layers']} layers, "
              f"{m['num_heads']} heads, {m['num_kv_heads']} KV heads), float32, CPU; checkpoint "
              f"{os.path.relpath(model, REPO)}", flush=True)
    elif args.model is None:
        m = MODEL_SPEC
        print(f"model: random Llama (vocab {m['vocab_size']}, hidden {m['hidden_size']}, intermediate "
              f"{m['intermediate_size']}, {m['num_layers']} layers, {m['num_heads']} heads, {m['num_kv_heads']} "
              f"KV heads), float32, CPU; checkpoint {os.path.relpath(model, REPO)}", flush=True)
    else:
        print(f"model: {model} (vocab {vocab_size}), float32, CPU", flush=True)

    results: dict[str, dict | str] = {}
    if "vllm" in engines:
        try:
            python, env = vllm_cpu.prepare_venv(os.path.join(REPO, "build"), args.cpus)
            vllm_spec = dict(spec, engine_kwargs=engine_kwargs(args.vllm_arg, args.prefix_caching))
            results["vllm-cpu"] = run_worker("vllm-cpu", [python, vllm_cpu.__file__], vllm_spec, env,
                                             args.timeout)
        except vllm_cpu.VllmUnavailable as e:
            results["vllm-cpu"] = f"unavailable: {e}"
    if "pdserve" in engines:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "pdserve"]
        pd_spec = dict(spec, engine_kwargs=engine_kwargs(args.engine_arg, args.prefix_caching))
        results["pdserve"] = run_worker("pdserve", cmd, pd_spec, pd_env, args.timeout)
    if "hf" in engines:
        hf_script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_baseline.py")
        for b in hf_batches:
            results[f"transformers b{b}"] = run_worker(f"transformers-b{b}", [sys.executable, hf_script],
                                                       dict(spec, batch_size=b), pd_env, args.timeout)
    step_us = scheduler_step_us() if "pdserve" in engines else None
    return report(results, workload, args, threads, passes, step_us)


def report(results: dict, workload: list[dict], args, threads: int, passes: int, step_us) -> int:
    ok = {name: summarize(r, workload) for name, r in results.items() if isinstance(r, dict)}
    print(f"\ncores and threads: every engine on CPUs {args.cpus} with {threads} threads "
          f"(vLLM: VLLM_CPU_OMP_THREADS_BIND={args.cpus}; pdserve and transformers: "
          f"torch.set_num_threads({threads}) and affinity {args.cpus})")
    caching = ("ON in pdserve and vLLM: passes after the warm-up hit the prefix cache for every prompt"
               if args.prefix_caching else
               "off in pdserve and vLLM (every pass repeats the same prompts: it would skip their prefill)")
    print(f"prefix caching {caching}")
    print(f"median of {passes} timed passes after one full warm-up pass "
          "(transformers: a short warm-up generate)")
    print(f"\n{'engine':<24}{'tokens/s':>10}{'wall s':>9}{'peak RSS MiB':>14}   tokens/s per pass")
    for name, r in results.items():
        if isinstance(r, str):
            print(f"{name:<24}  {r}")
            continue
        s = ok[name]
        per_pass = " ".join(f"{t:.1f}" for t in s["pass_tokens_per_s"])
        label = name + (f" {s['version']}" if s.get("version") else "")
        print(f"{label:<24}{s['tokens_per_s']:>10.1f}{s['wall_s']:>9.2f}"
              f"{s['peak_rss_mib']:>14.0f}   {per_pass}")
        if s["wrong_lengths"]:
            print(f"{'':<24}  WARNING: {s['wrong_lengths']} requests did not generate exactly their length")
    hf = {n: s for n, s in ok.items() if n.startswith("transformers")}
    best_hf = max(hf.values(), key=lambda s: s["tokens_per_s"]) if hf else None
    if best_hf is not None:
        name = next(n for n, s in hf.items() if s is best_hf)
        print(f"transformers at its best: {name} ({best_hf['tokens_per_s']:.1f} tokens/s)")

    pd, vl = ok.get("pdserve"), ok.get("vllm-cpu")
    print()
    if pd and vl:
        print(f"greedy check, pdserve vs vLLM CPU: {agreement(pd['outputs'], vl['outputs'])}")
    if best_hf is not None:
        for other, s in (("pdserve", pd), ("vLLM CPU", vl)):
            if s:
                print(f"greedy check, {other} vs transformers: {agreement(s['outputs'], best_hf['outputs'])}")
    summary = {n: {k: v for k, v in s.items() if k != "outputs"} for n, s in ok.items()}
    summary["failed"] = {n: r for n, r in results.items() if isinstance(r, str)}
    summary["scheduler_step_us_256"] = step_us
    with open(os.path.join(BENCH_DIR, "results.json"), "w") as f:
        json.dump(summary, f, indent=1)

    if step_us is not None:
        print(f"scheduler_step_us_256={step_us:.1f}")
    no_pd = "pdserve failed" if "pdserve" in results else "pdserve not run"
    vllm_ratio = f"{pd['tokens_per_s'] / vl['tokens_per_s']:.2f}" if pd and vl else \
        f"n/a ({results.get('vllm-cpu', 'vllm not run') if not vl else no_pd})"
    hf_ratio = f"{pd['tokens_per_s'] / best_hf['tokens_per_s']:.2f}" if pd and best_hf else \
        f"n/a ({'transformers not run or failed' if pd else no_pd})"
    print(f"engine_vs_vllm_cpu_throughput_ratio={vllm_ratio}")
    print(f"engine_vs_hf_throughput_ratio={hf_ratio}")
    return 0 if pd or "pdserve" not in results else 1


if __name__ == "__main__":
    sys.exit(main())
