"""The CPU attention path (C++ decode kernel + torch prefill) against kernels.reference."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops, reference, torch_attention


def make_case(q_lens, ctx_lens, heads, kv_heads, head_dim=64, block_size=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(sum(q_lens) + heads)
    max_blocks = max(-(-c // block_size) for c in ctx_lens)
    num_blocks = len(ctx_lens) * max_blocks + 7
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:len(ctx_lens) * max_blocks].view(len(ctx_lens), -1).int()
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    return q, kv, qsl, torch.tensor(ctx_lens, dtype=torch.int32), tables


def test_cpu_extension_builds():
    assert cpu_ops.load() is not None, "the C++ decode kernel should build here (gcc is installed)"


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_decode_matches_reference(heads, kv_heads, head_dim):
    ctx = [1, 5, 16, 17, 129, 411]
    q, kv, qsl, lens, tables = make_case([1] * len(ctx), ctx, heads, kv_heads, head_dim)
    expected = reference.paged_decode_attention(q, kv, lens, tables, 0.1)
    out = torch.full_like(q, float("nan"))
    torch_attention.paged_decode_attention(q, kv, lens, tables, 0.1, out)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_decode_half_precision(dtype, tol):
    q, kv, qsl, lens, tables = make_case([1] * 4, [3, 16, 40, 200], 8, 2, dtype=dtype)
    expected = reference.paged_decode_attention(q, kv, lens, tables, 0.125)
    out = torch_attention.paged_decode_attention(q, kv, lens, tables, 0.125)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def test_mixed_decode_and_prefill_batch():
    q_lens = [1, 7, 1, 16, 33, 1]
    ctx = [20, 7, 1, 40, 100, 257]  # chunks with earlier context, fresh prompts, decodes
    q, kv, qsl, lens, tables = make_case(q_lens, ctx, 8, 2, block_size=32)
    expected = reference.paged_attention(q, kv, qsl, lens, tables, 0.125)
    out = torch.full_like(q, float("nan"))
    torch_attention.paged_attention(q, kv, qsl, lens, tables, 0.125, out)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
