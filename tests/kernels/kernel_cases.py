"""Inputs and checks shared by the kernel tests: paged batches, NaN poison, the one tolerance table."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import reference

# The one tolerance table: Triton vs the torch reference, per dtype of the inputs.
# bfloat16 is loose enough for the interpreter, which truncates float32 -> bfloat16
# instead of rounding to nearest (the GPU rounds), so results may differ by one ulp.
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
DTYPES = tuple(TOLERANCES)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # --kv-cache-dtype fp8 (= fp8_e4m3), fp8_e5m2
FP8_IDS = ["e4m3", "e5m2"]
DTYPE_IDS = [str(t).removeprefix("torch.") for t in DTYPES]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Within the tolerance of `dtype`; a NaN left by the poison fails."""
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype}, reference {expected.dtype}"
    torch.testing.assert_close(actual.cpu().float(), expected.cpu().float(), **TOLERANCES[dtype])


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-for-bit (data movement); NaN only where the reference has NaN too."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.element_size() == 1:  # fp8: its bytes
        actual, expected = actual.view(torch.uint8), expected.view(torch.uint8)
    torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=0, rtol=0, equal_nan=True)


def poisoned(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer full of NaN: any element a kernel forgets to write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def random_block_ids(num_blocks: int, count: int, low: int = 0) -> torch.Tensor:
    """`count` distinct block ids from [low, num_blocks), neither contiguous nor sorted."""
    ids = low + torch.randperm(num_blocks - low)[:count]
    if count > 1 and bool((ids[1:] > ids[:-1]).all()):
        ids = ids.flip(0)
    return ids


@dataclass
class PagedBatch:
    """A varlen batch over a paged cache; sequence i has q_lens[i] new tokens out of seq_lens[i]."""
    query: torch.Tensor
    kv_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    scale: float

    def to(self, device) -> "PagedBatch":
        return PagedBatch(self.query.to(device), self.kv_cache.to(device), self.query_start_loc.to(device),
                          self.seq_lens.to(device), self.block_tables.to(device), self.scale)


def make_paged_batch(q_lens: list[int], seq_lens: list[int], num_kv_heads: int, group: int,
                     head_dim: int, block_size: int, dtype: torch.dtype,
                     cache_dtype: torch.dtype | None = None) -> PagedBatch:
    """Random queries and context on CPU; the cache in `cache_dtype` (default: `dtype`).

    Every cache slot that is not context (free blocks, the tail of a last block, the block
    that pads the block tables) holds NaN, so a kernel that reads one fails.
    """
    assert all(0 < q <= s for q, s in zip(q_lens, seq_lens))
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    needed = sum(blocks_per_seq) + 1  # + the NaN block that pads the tables
    kv_cache = torch.full((2, 2 * needed + 3, block_size, num_kv_heads, head_dim), float("nan"),
                          dtype=cache_dtype or dtype)
    ids = random_block_ids(kv_cache.shape[1], needed)
    pad_block = int(ids[-1])
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 2), pad_block, dtype=torch.int32)
    start = 0
    for i, (n, seq_len) in enumerate(zip(blocks_per_seq, seq_lens)):
        row = ids[start:start + n]
        block_tables[i, :n] = row
        positions = torch.arange(seq_len)
        slots = row[positions // block_size] * block_size + positions % block_size
        reference.store_kv(torch.randn(seq_len, num_kv_heads, head_dim, dtype=dtype),
                           torch.randn(seq_len, num_kv_heads, head_dim, dtype=dtype), kv_cache, slots)
        start += n
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, dtype=dtype)
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    return PagedBatch(query, kv_cache, query_start_loc, torch.tensor(seq_lens, dtype=torch.int32),
                      block_tables, head_dim ** -0.5)
