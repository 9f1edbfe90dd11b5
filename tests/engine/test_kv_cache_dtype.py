"""--kv-cache-dtype fp8 / fp8_e5m2 (vLLM's flag): K and V stored in 8 bits (scale 1, saturating),
read back in the model's dtype. The same memory holds more tokens; the backends agree on what is
stored and read; the answers stay close to a full-precision cache's."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

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
def test_the_torch_path_answers_as_the_reference_over_an_fp8_cache(tiny_llama, prompts, kv_cache_dtype):
    """Greedy tokens and logprobs of the CPU path (C++ kernels where the cache is the query's
    dtype, the torch path here) against kernels.reference, which stores and widens plainly."""
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
