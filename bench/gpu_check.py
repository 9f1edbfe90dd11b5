"""make gpu-check: the GPU half of pdserve on one CUDA GPU, in one report file (under 8 minutes).

(a) the GPU test subset: the kernel tests (on the GPU), the engine tests' CUDA variants (CUDA graphs
    and async scheduling included) and KV staging between GPU and CPU caches;
(b) engine throughput on a random-weight 1.1B Llama (hidden 2048, 22 layers, 32/4 heads, vocab
    32000, bf16; 256 requests, prompts 128-1,024, outputs 128-384, ignore_eos) against transformers
    `generate` in static batches of 64 on the same GPU, and the fraction of the workload's floor
    (its FLOPs at the matmul rate plus its bytes at the copy bandwidth, both measured here);
(c) a disaggregated stack on the GPU (`pdserve up --device cuda`, router + prefill + decode) per KV
    transport, greedy completions through the HTTP gateway compared with a colocated stack, and the
    decode's KV transfer rate against the device copy bandwidth;
(d) decode step time at batch 1, 32 and 256 with CUDA graphs and with --enforce-eager, against the
    step's memory-bound floor (the weights and the batch's KV read once at the copy bandwidth);
(e) the fused 8-bit linear (--quantized-weights keep: FP8 weights, 128 x 128 blocks) against bf16
    F.linear on the same shapes (a Llama-8B projection, 1 to 2,048 rows): seconds and the ratio,
    and its largest difference from dequantize-then-F.linear; and INT8 W8A8 (INT8 per channel,
    INT8 activations per token, torch._int_mm): seconds, the ratio, whether cuBLASLt took it, and
    its relative difference from the fake-quantized input times the weight;
(f) the fused mixture-of-experts kernel (kernels.triton_moe) against the torch backend's per-expert
    loop on Mixtral-8x7B's and Qwen3-30B-A3B's expert shapes (bf16, 1 to 2,048 tokens): seconds,
    the ratio, the fraction of the copy bandwidth reading the experts the step touches, the
    largest difference, and the kernel on the same experts kept in FP8 (sm89 and later).
(g) --kv-cache-dtype fp8: decode step time at batch 32 and 256 over 1,024-token contexts with an
    fp8 cache against the model's dtype (the KV a step reads halves), the blocks each fits in the
    same memory, and how many greedy tokens of the workload's first requests match bf16's.
A part whose optional package is missing (ucxx, say) is reported as not run; nothing else is skipped.
Run it with a Python that has the project's dependencies: `make gpu-check` (PYTHON=...), or
`python bench/gpu_check.py --report docs/gpu-check.md`. `--small` runs every part at toy sizes
(also on CPU, to check the script itself).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

FULL = dict(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000, requests=256,
            prompt=(128, 1024), output=(128, 384), hf_batch=64, kv_gib=24.0, dtype="bfloat16")
SMALL = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=2000, requests=8,
             prompt=(8, 32), output=(4, 8), hf_batch=4, kv_gib=0.05, dtype="float32")
# (c): big enough KV per request (about 25 MiB at 800 prompt tokens) for a transfer rate to mean something.
STACK = dict(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=8, vocab=32000, dtype="float32")
TARGETS = {"engine_gpu_vs_hf_ratio": 15.0, "engine_gpu_roofline_fraction": 0.35}


def timed(fn, repeat: int = 5) -> float:
    """Median seconds of fn() on the GPU (synchronised), after one warm-up call."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_rates(device: str, small: bool) -> dict:
    """bf16 matmul FLOP/s and device-to-device copy bandwidth (read + write bytes per second)."""
    import torch

    n = 512 if small else 8192
    dtype = torch.float32 if small else torch.bfloat16
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    mm = timed(lambda: a @ b)
    src = torch.empty((64 if small else 2048) << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = timed(lambda: dst.copy_(src))
    return {"matmul_flops": 2 * n ** 3 / mm, "copy_bytes_per_s": 2 * src.numel() / copy}


def make_model(path: str, size: dict) -> str:
    from engine.tiny import make_tiny_model

    return make_tiny_model(path, vocab_size=size["vocab"], hidden_size=size["hidden"],
                           intermediate_size=size["intermediate"], num_layers=size["layers"],
                           num_heads=size["heads"], num_kv_heads=size["kv_heads"], initializer_range=0.02)


def workload(size: dict, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(10, size["vocab"]) for _ in range(rng.randint(*size["prompt"]))],
             rng.randint(*size["output"])) for _ in range(size["requests"])]


def floor_seconds(size: dict, work, rates: dict) -> float:
    """Prompt FLOPs at the matmul rate, then every decode step reading the weights and the KV."""
    h, layers, vocab = size["hidden"], size["layers"], size["vocab"]
    head_dim = h // size["heads"]
    kv_dim = size["kv_heads"] * head_dim
    params = layers * (h * (h + 2 * kv_dim) + h * h + 3 * h * size["intermediate"]) + 2 * vocab * h
    elem = 2 if size["dtype"] == "bfloat16" else 4
    flops = sum(2 * params * len(p) + 2 * layers * h * len(p) ** 2 for p, _ in work)
    kv_per_token = 2 * layers * kv_dim * elem
    decode_bytes = 0
    for step in range(max(n for _, n in work)):
        active = [(len(p), n) for p, n in work if n > step]
        decode_bytes += params * elem + sum((lp + step) * kv_per_token for lp, _ in active)
    return flops / rates["matmul_flops"] + decode_bytes / rates["copy_bytes_per_s"]


def engine_throughput(model: str, size: dict, device: str, rates: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from hf_baseline import generate_static_batches

    work = workload(size)
    num_out = sum(n for _, n in work)
    llm = LLM(model, device=device, dtype=size["dtype"], max_num_seqs=size["requests"],
              max_num_batched_tokens=8192, kv_cache_memory_bytes=int(size["kv_gib"] * (1 << 30)))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    llm.generate([p for p, _ in work[:4]], params[:4])  # warm-up: Triton compiles here
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    engine_s = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in work]
    del llm
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, size["dtype"])).to(device).eval()
    hf.generation_config.eos_token_id = None
    reqs = [{"prompt_token_ids": p, "output_len": n} for p, n in work]
    pad = hf.config.pad_token_id or 0
    generate_static_batches(hf, reqs[:size["hf_batch"]], size["hf_batch"], pad, max_new_tokens=4, device=device)
    t0 = time.perf_counter()
    generate_static_batches(hf, reqs, size["hf_batch"], pad, device=device)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    hf_s = time.perf_counter() - t0
    floor = floor_seconds(size, work, rates)
    return {"requests": len(work), "prompt_tokens": sum(len(p) for p, _ in work), "output_tokens": num_out,
            "pdserve_s": engine_s, "pdserve_tok_s": num_out / engine_s, "hf_s": hf_s, "hf_tok_s": num_out / hf_s,
            "engine_gpu_vs_hf_ratio": hf_s / engine_s, "floor_s": floor,
            "engine_gpu_roofline_fraction": floor / engine_s}


def decode_step_s(model: str, size: dict, device: str, batch: int, prompt_len: int, **engine_args):
    """Median seconds of one decode-only engine step (schedule, inputs, forward, sampling, copy-back)
    at `batch` requests of prompt_len tokens; and the engine's own account of its graphs."""
    from engine import LLM, SamplingParams
    from engine.request import Request

    llm = LLM(model, device=device, dtype=size["dtype"], max_num_seqs=batch,
              kv_cache_memory_bytes=int(size["kv_gib"] * (1 << 30)), **engine_args)
    params = SamplingParams(temperature=0, max_tokens=10_000 if size is FULL else 200, ignore_eos=True)
    core = llm.engine
    for i in range(batch):
        core.add_request(Request(f"s{i}", [10 + i] * prompt_len, params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()):
        core.step()
    seconds = timed(core.step, repeat=30)
    stats, off = core.stats(), core.runner.cuda_graphs_off_reason
    core.abort_requests([f"s{i}" for i in range(batch)])
    core.shutdown()
    return seconds, stats, off


def decode_steps(model: str, size: dict, device: str, rates: dict) -> dict:
    """Seconds per decode-only step at several batch sizes, CUDA graphs on and off, and the step's
    floor: every weight and the batch's KV read once at the measured copy bandwidth."""
    import torch

    elem = torch.empty((), dtype=getattr(torch, size["dtype"])).element_size()
    h, i, layers, v = size["hidden"], size["intermediate"], size["layers"], size["vocab"]
    kv_dim = h // size["heads"] * size["kv_heads"]
    weight_bytes = (2 * v * h + layers * (h * (h + 2 * kv_dim) + h * h + 3 * h * i)) * elem
    kv_per_token = 2 * layers * kv_dim * elem
    prompt_len = 128
    result: dict = {"batch": {}}
    for batch in ((1, 2, 4) if size is SMALL else (1, 32, 256)):
        graphs_s, stats, off = decode_step_s(model, size, device, batch, prompt_len)
        eager_s, _, _ = decode_step_s(model, size, device, batch, prompt_len, enforce_eager=True)
        floor = (weight_bytes + batch * (prompt_len + 20) * kv_per_token) / rates["copy_bytes_per_s"]
        # padded_s: the default path (padded buffers; a CUDA graph replay where graphs are captured).
        result["batch"][batch] = {"padded_s": graphs_s, "eager_s": eager_s, "speedup": eager_s / graphs_s,
                                  "floor_s": floor, "vs_floor": graphs_s / floor,
                                  "cuda_graph_replays": stats["cuda_graph_replays"]}
        result["cuda_graphs"] = "captured" if off is None else f"not available: {off}"
    return result


def run_stack(model: str, device: str, transport: str | None, prompts: list[list[int]]) -> dict:
    """`pdserve up` (disaggregated over `transport`, or colocated when None); greedy completions."""
    argv = [sys.executable, "-m", "services.cli", "up", "--model", model, "--device", device, "--port", "0",
            "--prefill", "1" if transport else "0", "--decode", "1", "--engine-arg=--dtype=float32"]
    if transport:
        argv += ["--transport", transport]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, url, metrics = [], None, None
    try:
        deadline = time.monotonic() + 300
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("pdserve up exited:\n" + "".join(lines[-30:]))
            lines.append(line)
            m = re.search(r"(decode|colocated) \S+ metrics on (http://\S+)", line)
            metrics = m.group(2) if m else metrics
            m = re.search(r"pdserve is serving at (http://\S+)", line)
            url = m.group(1) if m else None
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
            name = json.load(r)["data"][0]["id"]
        texts = []
        t0 = time.perf_counter()
        for prompt in prompts:
            body = json.dumps({"model": name, "prompt": prompt, "max_tokens": 32, "temperature": 0,
                               "ignore_eos": True}).encode()
            req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                texts.append(json.load(r)["choices"][0]["text"])
        out = {"texts": texts, "seconds": time.perf_counter() - t0}
        if transport and metrics:
            with urllib.request.urlopen(metrics, timeout=10) as r:
                text = r.read().decode()
            def total(name: str) -> float:
                return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name))
            out.update(kv_bytes=total("pdserve:kv_transfer_bytes_total"),
                       kv_seconds=total("pdserve:kv_transfer_time_seconds_sum"),
                       fallbacks=total("pdserve:kv_recomputed_fallbacks_total"))
        return out
    finally:
        proc.terminate()
        proc.wait(60)


def disaggregated(model: str, device: str, rates: dict, prompt_len: int) -> dict:
    import importlib.util

    import torch

    rng = random.Random(1)
    prompts = [[rng.randrange(10, 1000) for _ in range(prompt_len + i)] for i in range(8)]
    reference = run_stack(model, device, None, prompts)["texts"]
    result = {}
    for transport in ("tcp", "ucx", "nccl"):
        if transport == "ucx" and importlib.util.find_spec("ucxx") is None:
            result[transport] = "not run: ucxx is not installed"
            continue
        if transport == "nccl" and device == "cuda" and torch.cuda.device_count() < 2:
            result[transport] = "not run: NCCL refuses two ranks on one GPU (prefill and decode need a GPU each)"
            continue
        try:
            got = run_stack(model, device, transport, prompts)
        except Exception as e:  # reported, not hidden: the other transports still run
            result[transport] = f"FAILED: {type(e).__name__}: {str(e)[-400:]}"
            continue
        rate = got.get("kv_bytes", 0) / got["kv_seconds"] if got.get("kv_seconds") else 0.0
        result[transport] = {"token_exact_vs_colocated": got["texts"] == reference,
                             "fallbacks": got.get("fallbacks"), "kv_gb_s": rate / 1e9,
                             "kv_vs_copy_bandwidth": rate / rates["copy_bytes_per_s"]}
    return result


def gpu_tests(small: bool) -> dict:
    runs = {"kernels": ["tests/kernels"], "engine (cuda)": ["tests/engine", "-k", "cuda"],
            "kv staging (cuda)": ["tests/kvtransfer/test_staging.py"],
            "profile's copied KV (cuda)": ["tests/planner/test_profile.py", "-k", "cuda"]}
    result = {}
    for name, args in runs.items():
        t0 = time.perf_counter()
        try:  # -rfE: pytest's short summary names every failing and erroring test
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *args],
                                  cwd=ROOT, capture_output=True, text=True, timeout=240 if not small else 600)
        except subprocess.TimeoutExpired as e:  # reported, not fatal: the other parts still run
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            result[name] = {"exit": None, "summary": f"timed out after {e.timeout:.0f} s",
                            "failed": failing_tests(out), "seconds": time.perf_counter() - t0}
            continue
        tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
        result[name] = {"exit": proc.returncode, "summary": tail, "failed": failing_tests(proc.stdout),
                        "seconds": time.perf_counter() - t0}
    return result


def fp8_cache(model: str, size: dict, device: str) -> dict:
    """(g): decode steps over an fp8 KV cache against the model's dtype; blocks per memory; and
    the greedy tokens an fp8 cache keeps of the model-dtype cache's."""
    import torch
    from engine import LLM, SamplingParams

    kinds = ["auto", "fp8" if device != "cuda" or torch.cuda.get_device_capability() >= (8, 9) else "fp8_e5m2"]
    prompt_len = 64 if size is SMALL else 1024
    result: dict = {"kv_cache_dtype": kinds[1], "batch": {}}
    for batch in ((1, 4) if size is SMALL else (32, 256)):
        step = {kind: decode_step_s(model, size, device, batch, prompt_len, kv_cache_dtype=kind)[0] for kind in kinds}
        result["batch"][batch] = {"auto_s": step["auto"], "fp8_s": step[kinds[1]],
                                  "speedup": step["auto"] / step[kinds[1]]}
    prompts = [p for p, _ in workload(size)[:8]]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    tokens, blocks = {}, {}
    for kind in kinds:
        llm = LLM(model, device=device, dtype=size["dtype"], kv_cache_dtype=kind,
                  kv_cache_memory_bytes=int(size["kv_gib"] * (1 << 30)))
        blocks[kind] = llm.engine.runner.num_blocks
        tokens[kind] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.engine.shutdown()
    same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(*tokens.values())]
    result.update(blocks_auto=blocks["auto"], blocks_fp8=blocks[kinds[1]],
                  greedy_prefix_matched=sum(same) / sum(len(x) for x in tokens["auto"]))
    return result


def memory_share(model: str, size: dict, device: str) -> dict:
    """--gpu-memory-utilization on the real device: the parts it measured, the blocks it sized,
    and what the engine then holds after a batch, against the share asked for."""
    import torch

    from engine import LLM, SamplingParams

    if device != "cuda":
        return {"skipped": "needs a CUDA GPU (the share is of a GPU's memory)"}
    torch.cuda.empty_cache()
    llm = LLM(model, device=device, dtype=size["dtype"], max_num_seqs=size["requests"], max_num_batched_tokens=8192,
              gpu_memory_utilization=0.5)
    runner = llm.engine.runner
    work = workload(size)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    outs = llm.generate([p for p, _ in work], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in work]
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    b = runner.memory_budget
    held = b.free_at_start - free
    return {"budget": b.describe(), "num_blocks": runner.num_blocks, "kv_gib": b.kv_bytes() / (1 << 30),
            "held_after_batch_gib": held / (1 << 30), "requested_gib": b.requested / (1 << 30),
            "within_share": held <= b.requested}


def quantized_linear(small: bool) -> dict:
    """(e): per shape and row count, the fused FP8 linear's time against bf16 F.linear's."""
    import torch
    import torch.nn.functional as F

    from kernels.quant_linear import QuantizedLinear, w8a16_linear

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = [(128, 64)] if small else [(4096, 4096), (14336, 4096), (4096, 14336)]
    out: dict = {}
    for n, k in shapes:
        w = torch.randn(n, k, device=device) * 0.02
        grid = (-(-n // 128), -(-k // 128))
        padded = torch.zeros(grid[0] * 128, grid[1] * 128, device=device)
        padded[:n, :k] = w
        block_scale = padded.view(grid[0], 128, grid[1], 128).abs().amax(dim=(1, 3)) / 448.0
        full = block_scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        q = (w / full).to(torch.float8_e4m3fn)
        scale = block_scale.repeat_interleave(128, 0)[:n].contiguous()
        dense = (q.float() * full).to(dtype)
        # INT8 W8A8 (an int-quantized checkpoint's): INT8 per channel, INT8 activations per token
        # through torch._int_mm (cuBLASLt), against the fake-quantized input times the weight.
        row_scale = w.abs().amax(dim=1, keepdim=True) / 127.5
        q8 = torch.round(w / row_scale).clamp(-128, 127).to(torch.int8)
        int8 = QuantizedLinear(k, n, "int8", k, False, use_triton=False, activations="token")
        int8.allocate(torch.device(device))
        int8.load_rows(0, q8, row_scale, None)
        for m in ([1, 8] if small else [1, 16, 64, 256, 2048]):
            x = torch.randn(m, k, device=device, dtype=dtype)
            fused = timed(lambda: w8a16_linear(x, q, scale, 128))
            plain = timed(lambda: F.linear(x, dense))
            err = (w8a16_linear(x, q, scale, 128).float() - F.linear(x, dense).float()).abs().max().item()
            w8a8 = timed(lambda: int8(x))
            xs = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-30) / 127.5
            ref = (torch.round(x.float() / xs).clamp(-128, 127) * xs) @ (q8.float() * row_scale).t()
            err8 = (int8(x).float() - ref).abs().max().item() / ref.abs().max().item()
            out[f"{n}x{k} m={m}"] = {"fp8_s": fused, "bf16_s": plain, "bf16_over_fp8": plain / fused,
                                     "max_abs_diff": err, "int8_w8a8_s": w8a8, "bf16_over_int8_w8a8": plain / w8a8,
                                     "int8_w8a8_rel_err": err8, "int8_through_int_mm": not int8._emulate}
    return out


def fused_moe(small: bool, rates: dict) -> dict:
    """(f): per expert shape and token count, the Triton kernel's time against the torch loop's."""
    import torch

    from kernels import moe
    from kernels.triton_moe import fused_moe as triton_fused_moe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = {"toy E8 k2": (8, 2, 64, 32)} if small else {
        "mixtral-8x7b E8 k2": (8, 2, 4096, 14336), "qwen3-30b-a3b E128 k8": (128, 8, 2048, 768)}
    out: dict = {}
    for name, (experts, k, hidden, inter) in shapes.items():
        w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype) * hidden ** -0.5
        w2 = torch.randn(experts, hidden, inter, device=device, dtype=dtype) * inter ** -0.5
        fp8 = device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
        if fp8:  # the same experts in FP8, a scale per row and 128 columns (--quantized-weights keep)
            q13, s13 = _fp8_rows(w13, 128)
            q2, s2 = _fp8_rows(w2, 128)
        for t in ([1, 8] if small else [1, 16, 64, 256, 2048]):
            x = torch.randn(t, hidden, device=device, dtype=dtype)
            weights, ids = torch.topk(torch.softmax(torch.randn(t, experts, device=device), -1), k, -1)
            fused = timed(lambda: triton_fused_moe(x, w13, w2, weights, ids))
            loop = timed(lambda: moe.fused_moe(x, w13, w2, weights, ids))
            touched = int(torch.unique(ids).numel()) * 3 * hidden * inter * w13.element_size()
            err = (triton_fused_moe(x, w13, w2, weights, ids).float() - moe.fused_moe(x, w13, w2, weights, ids).float())
            row = out[f"{name} tokens={t}"] = {"triton_s": fused, "torch_loop_s": loop, "loop_over_triton": loop / fused,
                                               "copy_fraction": touched / rates["copy_bytes_per_s"] / fused,
                                               "max_abs_diff": err.abs().max().item()}
            if fp8:
                row["fp8_triton_s"] = timed(lambda: triton_fused_moe(x, q13, q2, weights, ids, s13, s2))
                row["bf16_over_fp8"] = fused / row["fp8_triton_s"]
    return out


def _fp8_rows(w, group: int):
    """[E, N, K] -> FP8 values and float32 scales [E, N, K / group] (K a multiple of group)."""
    import torch

    e, n, k = w.shape
    scale = (w.float().view(e, n, k // group, group).abs().amax(-1) / 448.0).clamp(min=1e-8)
    q = (w.float().view(e, n, k // group, group) / scale[..., None]).view(e, n, k).to(torch.float8_e4m3fn)
    return q, scale


def failing_tests(pytest_output: str, limit: int = 40) -> list[str]:
    """The FAILED/ERROR lines of pytest's short summary (test id and the error's first line)."""
    lines = [line.strip() for line in pytest_output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return [line[:300] for line in lines[:limit]] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", default=str(ROOT / "build" / "gpu-check" / "report.json"))
    p.add_argument("--small", action="store_true", help="toy sizes (also runs on CPU): checks the script")
    p.add_argument("--parts", default="tests,engine,stack,decode,memory,quant,moe,fp8kv")
    args = p.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.small:
        print("gpu-check needs a CUDA GPU (torch sees none); --small runs it at toy sizes on CPU")
        return 1
    if device == "cpu":  # parts (e) and (f): kernels through Triton's interpreter (before triton is imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    size = SMALL if args.small else FULL
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__, "small": args.small}
    parts = args.parts.split(",")
    t_start = time.perf_counter()
    report["rates"] = rates = device_rates(device, args.small)
    print(f"matmul {rates['matmul_flops'] / 1e12:.0f} TFLOP/s, copy {rates['copy_bytes_per_s'] / 1e9:.0f} GB/s")
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-check-") as tmp:
        model = make_model(os.path.join(tmp, "llama-1b" if not args.small else "tiny"), size)
        steps = {"tests": lambda: gpu_tests(args.small), "engine": lambda: engine_throughput(model, size, device, rates),
                 "decode": lambda: decode_steps(model, size, device, rates),
                 "memory": lambda: memory_share(model, size, device),
                 "quant": lambda: quantized_linear(args.small),
                 "moe": lambda: fused_moe(args.small, rates),
                 "fp8kv": lambda: fp8_cache(model, size, device),
                 "stack": lambda: disaggregated(make_model(os.path.join(tmp, "stack"), SMALL if args.small else STACK),
                                                device, rates, 24 if args.small else 800)}
        for part in parts:
            t0 = time.perf_counter()
            try:
                report[part] = steps[part]()
            except Exception as e:  # one broken part must not hide the others' figures
                report[part] = f"FAILED: {type(e).__name__}: {e}"
            print(f"{part}: {json.dumps(report[part], default=str)[:600]} ({time.perf_counter() - t0:.0f} s)")
            if part == "tests" and isinstance(report[part], dict):  # the failing tests in full, not cut at 600
                for run, got in report[part].items():
                    for line in got.get("failed", []):
                        print(f"  {run}: {line}")
    engine = report.get("engine")
    if isinstance(engine, dict):
        report["targets"] = {k: {"measured": engine[k], "target": v, "met": engine[k] >= v} for k, v in TARGETS.items()}
    report["seconds"] = time.perf_counter() - t_start
    os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
    with open(args.report, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"report: {args.report} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
