"""Triton KV data movement (store_kv, gather/scatter of blocks) matches the torch reference exactly."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import DTYPE_IDS, DTYPES, FP8, FP8_IDS, assert_same, poisoned, random_block_ids
from kernels import reference


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("cache_dtype,new_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                   (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)],
                         ids=["fp32", "fp16", "bf16", "fp32-into-fp16"])
def test_store_kv_writes_exactly_the_reference_slots(triton_kernels, device, block_size, cache_dtype, new_dtype):
    num_blocks, kv_heads, head_dim, num_tokens = 40, 3, 48, 37  # 3 heads, 48 dims: padded tiles
    slot_mapping = torch.randperm(num_blocks * block_size)[:num_tokens]
    slot_mapping[[0, 7, 20]] = -1  # padding tokens are skipped
    # K and V as the model produces them: views into one fused projection, not contiguous.
    qkv = torch.randn(num_tokens, 3, kv_heads, head_dim, dtype=new_dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    expected = poisoned((2, num_blocks, block_size, kv_heads, head_dim), cache_dtype, "cpu")
    reference.store_kv(key, value, expected, slot_mapping)

    kv_cache = poisoned(expected.shape, cache_dtype, device)
    triton_kernels.store_kv(key.to(device), value.to(device), kv_cache, slot_mapping.to(device))
    assert_same(kv_cache, expected)  # NaN exactly where no token was stored


@pytest.mark.parametrize("new_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
def test_store_kv_into_an_fp8_cache_rounds_and_saturates_as_the_reference(triton_kernels, device, cache_dtype,
                                                                          new_dtype):
    """--kv-cache-dtype fp8: each value rounded to the nearest fp8 one, out-of-range values
    stored as the largest finite one. On a GPU, any values. Triton's CPU interpreter converts
    some values next to a rounding boundary a binade off (its own float -> fp8 cast, not the
    kernel's), so there the values are ones fp8 holds exactly, out-of-range ones included:
    the addressing, the clamp and the cast are what is checked."""
    num_blocks, block_size, kv_heads, head_dim, num_tokens = 40, 16, 3, 48, 37
    slot_mapping = torch.randperm(num_blocks * block_size)[:num_tokens]
    slot_mapping[[0, 7, 20]] = -1
    qkv = torch.randn(num_tokens, 3, kv_heads, head_dim) * 200  # past e4m3's 448 in places
    qkv[0, 1, 0, :3] = torch.tensor([1e6, -1e6, 7e4])  # past e5m2's 57,344 too
    if device.type == "cpu":
        qkv = torch.where(qkv.abs() > torch.finfo(cache_dtype).max, qkv, qkv.to(cache_dtype).float())
    qkv = qkv.to(new_dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    expected = poisoned((2, num_blocks, block_size, kv_heads, head_dim), cache_dtype, "cpu")
    reference.store_kv(key, value, expected, slot_mapping)
    assert not expected[:, slot_mapping[slot_mapping >= 0] // block_size].float().isinf().any()

    kv_cache = poisoned(expected.shape, cache_dtype, device)
    triton_kernels.store_kv(key.to(device), value.to(device), kv_cache, slot_mapping.to(device))
    assert_same(kv_cache, expected)


@pytest.mark.parametrize("dtype", DTYPES + FP8, ids=DTYPE_IDS + FP8_IDS)
def test_gather_then_scatter_blocks_round_trips_every_layer(triton_kernels, device, dtype):
    num_layers, num_blocks, shape = 3, 50, (16, 2, 40)
    caches = [torch.randn(2, num_blocks, *shape).to(dtype) for _ in range(num_layers)]
    block_ids = random_block_ids(num_blocks, 7)

    expected = reference.gather_blocks(caches, block_ids)
    dev_caches = [c.to(device) for c in caches]
    staging = poisoned(expected.shape, dtype, device)
    assert triton_kernels.gather_blocks(dev_caches, block_ids.to(device), out=staging) is staging
    assert_same(staging, expected)
    assert_same(triton_kernels.gather_blocks(dev_caches, block_ids.to(device)), expected)

    # Scatter new contents into other blocks of poisoned caches: only those blocks change.
    targets = random_block_ids(num_blocks, 7)
    new = torch.randn(expected.shape).to(dtype)
    want = [poisoned(c.shape, dtype, "cpu") for c in caches]
    reference.scatter_blocks(new, want, targets)
    got = [poisoned(c.shape, dtype, device) for c in caches]
    triton_kernels.scatter_blocks(new.to(device), got, targets.to(device))
    for g, w in zip(got, want):
        assert_same(g, w)


def test_gather_blocks_of_no_blocks_is_empty(triton_kernels, device):
    caches = [torch.randn(2, 4, 16, 1, 8, device=device) for _ in range(2)]
    out = triton_kernels.gather_blocks(caches, torch.empty(0, dtype=torch.int64, device=device))
    assert out.shape == (2, 2, 0, 16, 1, 8)
