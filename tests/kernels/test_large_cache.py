"""Index arithmetic past 2**31 elements: a cache so large that int32 offsets would wrap."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import assert_close, assert_same, make_paged_batch, poisoned, random_block_ids
from kernels import reference

BLOCK_SIZE, KV_HEADS, HEAD_DIM, GROUP = 16, 2, 64, 2
# The K half alone holds more than 2**31 elements: block_id * block_stride overflows int32
# for the last blocks, and the V half starts past 2**31 as well. 8 GiB of float16, of
# which only the blocks a test touches are ever backed by memory (on CPU).
NUM_BLOCKS = 2 ** 31 // (BLOCK_SIZE * KV_HEADS * HEAD_DIM) + 256
HIGH = NUM_BLOCKS - 200  # tests use blocks above this id


@pytest.fixture(scope="module")
def large_cache(device):
    if device.type == "cuda" and torch.cuda.mem_get_info()[0] < 10 * 2 ** 30:
        pytest.skip("needs 10 GiB of free GPU memory")
    try:
        return torch.empty((2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), dtype=torch.float16, device=device)
    except RuntimeError as exc:  # e.g. strict overcommit: no 8 GiB of address space
        pytest.skip(f"cannot reserve an 8 GiB cache: {exc}")


def test_store_kv_past_int32_offsets(triton_kernels, large_cache):
    ids = random_block_ids(NUM_BLOCKS, 4, low=HIGH)
    slots = (ids[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()[torch.randperm(4 * BLOCK_SIZE)[:50]]
    key = torch.randn(50, KV_HEADS, HEAD_DIM, dtype=torch.float16)
    value = torch.randn(50, KV_HEADS, HEAD_DIM, dtype=torch.float16)
    device = large_cache.device
    large_cache[:, ids.to(device)] = float("nan")
    triton_kernels.store_kv(key.to(device), value.to(device), large_cache, slots.to(device))
    got = large_cache[:, ids.to(device)].cpu()
    large_cache[:, ids.to(device)] = float("nan")
    reference.store_kv(key.to(device), value.to(device), large_cache, slots.to(device))
    assert_same(got, large_cache[:, ids.to(device)])


@pytest.mark.parametrize("decode", [False, True], ids=["varlen", "decode"])
def test_attention_past_int32_offsets(triton_kernels, large_cache, decode):
    # Build the batch over a small cache, take the reference there, then move its blocks
    # (context and NaN poison alike) to ids above HIGH in the large cache.
    q_lens = [1, 1] if decode else [20, 1]
    b = make_paged_batch(q_lens, [70, 33], KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, torch.float16)
    device = large_cache.device
    large_cache[:, HIGH:HIGH + b.kv_cache.shape[1]] = b.kv_cache.to(device)
    block_tables = (b.block_tables + HIGH).to(device)
    out = poisoned(b.query.shape, torch.float16, device)
    if decode:
        expected = reference.paged_decode_attention(b.query, b.kv_cache, b.seq_lens, b.block_tables, b.scale)
        triton_kernels.paged_decode_attention(b.query.to(device), large_cache, b.seq_lens.to(device),
                                              block_tables, b.scale, out=out)
    else:
        expected = reference.paged_attention(b.query, b.kv_cache, b.query_start_loc, b.seq_lens,
                                             b.block_tables, b.scale)
        triton_kernels.paged_attention(b.query.to(device), large_cache, b.query_start_loc.to(device),
                                       b.seq_lens.to(device), block_tables, b.scale, out=out)
    assert_close(out, expected, torch.float16)


def test_gather_scatter_past_int32_offsets(triton_kernels, large_cache):
    device = large_cache.device
    ids = random_block_ids(NUM_BLOCKS, 5, low=HIGH).to(device)
    large_cache[:, ids] = torch.randn(2, 5, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.float16).to(device)
    staging = triton_kernels.gather_blocks([large_cache], ids)
    assert_same(staging[0], large_cache[:, ids])

    new = torch.randn_like(staging)
    triton_kernels.scatter_blocks(new, [large_cache], ids)
    assert_same(large_cache[:, ids], new[0])
