"""The Triton kernels compile for Hopper (sm_90) without a GPU, as the wrappers launch them.

The interpreter checks what the kernels compute but never compiles them. Here a child
process (no TRITON_INTERPRET) runs each wrapper on CPU tensors with the kernel launch
recorded instead of executed, and compiles every recorded launch to a cubin with Triton's
own specialisation rules (16-byte alignment, ints equal to 1 become constants).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SM90_SHARED_MEMORY = 232448  # bytes one block may use on H100/H200


def test_every_kernel_compiles_for_sm90_and_decode_pipelines_its_kv_loads():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    compiled = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {c["kernel"] for c in compiled} == {
        "_store_kv_kernel", "_copy_blocks_kernel", "_paged_prefill_kernel", "_paged_decode_kernel",
        "_reduce_splits_kernel", "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel"}
    # An fp8 cache's kernels compile too: stores that convert to e4m3 / e5m2, loads that widen.
    assert {c["kernel"] for c in compiled if c["cache"] in ("fp8e4nv", "fp8e5")} == {
        "_store_kv_kernel", "_copy_blocks_kernel", "_paged_prefill_kernel", "_paged_decode_kernel"}
    for c in compiled:
        assert c["shared"] <= SM90_SHARED_MEMORY, c
        if c["kernel"] in ("_paged_decode_kernel", "_paged_prefill_kernel"):
            # K/V tiles stream through shared memory with cp.async, overlapping the math.
            assert c["async_copies"] > 0, c


def _record_launches() -> list:
    """Swap every kernel for a recorder; the returned list fills as the wrappers launch."""
    from kernels import triton_cache, triton_decode, triton_layers, triton_prefill

    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, num_warps=4, num_stages=3, **constexprs):
                launches.append((self.kernel, args, constexprs, num_warps, num_stages))
            return launch

    for module in (triton_cache, triton_decode, triton_layers, triton_prefill):
        for name in dir(module):
            if name.endswith("_kernel"):
                setattr(module, name, Recorder(getattr(module, name)))
    return launches


def _run_wrappers(dtype, cache_dtype=None) -> None:
    """Every wrapper on Llama-3-8B-like CPU tensors (kernels recorded, not run); the KV cache in
    `cache_dtype` (--kv-cache-dtype fp8: the attention and cache kernels only)."""
    import torch

    from kernels import triton_cache, triton_decode, triton_layers, triton_prefill

    heads, kv_heads, dim, block = 32, 8, 128, 16
    cache = torch.zeros(2, 64, block, kv_heads, dim, dtype=cache_dtype or dtype)
    tables = torch.zeros(4, 16, dtype=torch.int32)
    seq_lens = torch.full((4,), 200, dtype=torch.int32)
    q = torch.zeros(4, heads, dim, dtype=dtype)
    triton_decode.decode_attention(q, cache, seq_lens, tables, 0.1, torch.empty_like(q), num_splits=1)
    triton_decode.decode_attention(q, cache, seq_lens, tables, 0.1, torch.empty_like(q), num_splits=3)
    qsl = torch.tensor([0, 1, 2, 3, 64], dtype=torch.int32)
    triton_prefill.paged_attention(torch.zeros(64, heads, dim, dtype=dtype), cache, qsl, seq_lens, tables, 0.1)
    triton_prefill.paged_attention(q, cache, torch.arange(5, dtype=torch.int32), seq_lens, tables, 0.1)
    if dtype == torch.bfloat16:  # the rest does not depend on the dtype's arithmetic
        kv = torch.zeros(8, kv_heads, dim, dtype=dtype)
        triton_cache.store_kv(kv, kv, cache, torch.arange(8))
        staging = triton_cache.gather_blocks([cache, cache.clone()], torch.arange(3))
        triton_cache.scatter_blocks(staging, [cache, cache.clone()], torch.arange(3))
        if cache_dtype is not None:
            return
        triton_layers.rms_norm(torch.zeros(8, 4096, dtype=dtype), torch.ones(4096, dtype=dtype), 1e-5,
                               torch.zeros(8, 4096, dtype=dtype))
        triton_layers.rotary_embedding(torch.arange(8), q[:2].repeat(4, 1, 1), kv, torch.zeros(100, dim))
        triton_layers.silu_and_mul(torch.zeros(8, 2 * 14336, dtype=dtype))


def _compile(kernel, args, constexprs, num_warps, num_stages) -> dict:
    """Compile one launch the way Triton's JIT would specialise it."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    constexprs = dict(constexprs)
    signature, attrs = {}, {}
    for i, (name, value) in enumerate(zip(names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
                                     torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv",
                                     torch.float8_e5m2: "fp8e5"}[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[name], aligned = "i1", False
        elif isinstance(value, int):
            if value == 1:
                constexprs[name] = 1
                continue
            signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
            aligned = value % 16 == 0
        else:
            signature[name], aligned = "fp32", False
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in constexprs:
        signature[name] = "constexpr"
    signature = {name: signature[name] for name in names}
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return {"kernel": kernel.__name__, "shared": compiled.metadata.shared,
            "cache": next((signature[n][1:] for n in ("kv_cache", "cache", "staging") if n in signature), None),
            "async_copies": compiled.asm["ptx"].count("cp.async.cg.shared.global")}


def main() -> None:
    import torch

    sys.path.insert(0, os.getcwd())
    launches = _record_launches()
    for dtype in (torch.bfloat16, torch.float32):  # fp16 lowers as bf16 does; fp32 takes IEEE dots
        _run_wrappers(dtype)
    for cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # --kv-cache-dtype fp8, fp8_e5m2
        _run_wrappers(torch.bfloat16, cache_dtype)
    print(json.dumps([_compile(*launch) for launch in launches]))


if __name__ == "__main__":
    main()
