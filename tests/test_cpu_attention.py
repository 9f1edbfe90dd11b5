"""The CPU attention path (C++ decode and prefill kernels, SDPA prefill without them) against
kernels.reference."""
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
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256, 48])  # unrolled sizes, and a runtime one
def test_decode_matches_reference(heads, kv_heads, head_dim):
    ctx = [1, 5, 16, 17, 129, 411]
    q, kv, qsl, lens, tables = make_case([1] * len(ctx), ctx, heads, kv_heads, head_dim)
    expected = reference.paged_decode_attention(q, kv, lens, tables, 0.1)
    out = torch.full_like(q, float("nan"))
    torch_attention.paged_decode_attention(q, kv, lens, tables, 0.1, out)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_decode_single_sequences_and_small_batches_match_reference(threads):
    """As many sequences as threads or more: whole sequences per thread. Fewer: each sequence's
    blocks cut into slices merged at the end (uneven last slices; at 4 threads, [3, 1500] gives
    the 3-token sequence an empty slice)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for ctx in ([700], [3, 1500], [16, 129, 411]):
            q, kv, qsl, lens, tables = make_case([1] * len(ctx), ctx, 8, 2, head_dim=64)
            expected = reference.paged_decode_attention(q, kv, lens, tables, 0.1)
            out = torch_attention.paged_decode_attention(q, kv, lens, tables, 0.1)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
            half = torch_attention.paged_decode_attention(q.bfloat16(), kv.bfloat16(), lens, tables, 0.1)
            torch.testing.assert_close(half.float(), reference.paged_decode_attention(
                q.bfloat16(), kv.bfloat16(), lens, tables, 0.1).float(), atol=1.6e-2, rtol=1.6e-2)
    finally:
        torch.set_num_threads(before)


def test_decode_kernel_refuses_block_ids_outside_the_cache():
    """A stray block id (or a length past the table) is an error, not a read of memory outside the
    cache; entries past a sequence's keys are never read, so they may hold anything."""
    q, kv, qsl, lens, tables = make_case([1, 1], [40, 20], 8, 4)
    unused = tables.clone()
    unused[1, 2:] = -5  # 20 keys use 2 blocks of 16
    torch.testing.assert_close(torch_attention.paged_decode_attention(q, kv, lens, unused, 0.1),
                               reference.paged_decode_attention(q, kv, lens, tables, 0.1), atol=1e-5, rtol=1e-5)
    bad = tables.clone()
    bad[0, 2] = kv.shape[1]
    with pytest.raises(RuntimeError, match="outside"):
        torch_attention.paged_decode_attention(q, kv, lens, bad, 0.1)
    with pytest.raises(RuntimeError, match="exceed its block table"):
        torch_attention.paged_decode_attention(q, kv, torch.tensor([40, 16 * tables.shape[1] + 1],
                                                                   dtype=torch.int32), tables, 0.1)


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


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("path", ["cpp", "sdpa-split", "sdpa-masked"])
def test_chunks_after_context_match_reference(heads, kv_heads, path, monkeypatch):
    """A prompt's later chunk beside a fresh prompt and a decode: long chunks after short context
    and the reverse, a few speculative tokens after a long context. Through the C++ kernel, and
    through SDPA as without it (the context unmasked plus the chunk's own causal triangle, merged
    by log-sum-exp; or, where torch lacks the flash op with log-sum-exp, an explicit mask)."""
    if path != "cpp":
        monkeypatch.setattr(torch_attention, "_prefill", torch_attention._sdpa_prefill)
    if path == "sdpa-masked":
        monkeypatch.setattr(torch_attention, "_FLASH_LSE", None)
    q_lens = [300, 40, 3, 1, 64, 129]
    ctx = [300 + 700, 40 + 16, 3 + 1000, 77, 64, 129 + 1]
    q, kv, qsl, lens, tables = make_case(q_lens, ctx, heads, kv_heads, block_size=16)
    expected = reference.paged_attention(q, kv, qsl, lens, tables, 0.125)
    out = torch.full_like(q, float("nan"))
    torch_attention.paged_attention(q, kv, qsl, lens, tables, 0.125, out)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _prefill(q, kv, qsl, lens, tables, scale):
    out = torch.full_like(q, float("nan"))
    cpu_ops.load().paged_prefill_attention(q, kv, qsl.long(), lens, tables, scale, out)
    return out


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2), (8, 1), (12, 4), (7, 7), (32, 4)])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 32])  # unrolled sizes, and runtime ones
def test_prefill_kernel_matches_reference(heads, kv_heads, head_dim):
    """Fresh prompts and chunks after context of lengths that leave partial tiles of rows and
    keys (a tile is 64 (token, head) rows of one KV head against 64 keys), in one call."""
    q_lens = [1, 2, 17, 70, 200]
    ctx = [33, 2, 17, 70 + 129, 200 + 5]
    q, kv, qsl, lens, tables = make_case(q_lens, ctx, heads, kv_heads, head_dim, block_size=16)
    expected = reference.paged_attention(q, kv, qsl, lens, tables, head_dim ** -0.5)
    torch.testing.assert_close(_prefill(q, kv, qsl, lens, tables, head_dim ** -0.5), expected,
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("block_size", [16, 128])
def test_prefill_kernel_long_prompts_any_threads(threads, block_size):
    """Long prompts, whose tiles differ most in cost (handed out longest first), at thread
    counts below, at and above the number of sequences."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, kv, qsl, lens, tables = make_case([1100, 333], [1100, 333 + 900], 8, 4, block_size=block_size)
        expected = reference.paged_attention(q, kv, qsl, lens, tables, 0.125)
        torch.testing.assert_close(_prefill(q, kv, qsl, lens, tables, 0.125), expected, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_prefill_kernel_half_precision(dtype, tol):
    q, kv, qsl, lens, tables = make_case([150, 40], [150, 40 + 90], 8, 2, dtype=dtype)
    expected = reference.paged_attention(q.float(), kv.float(), qsl, lens, tables, 0.125)
    out = _prefill(q, kv, qsl, lens, tables, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_prefill_kernel_peaked_scores_and_unused_table_entries():
    """Scores spanning the float range (most weights exactly 0), and block-table entries past a
    sequence's keys that are no block id at all: only the blocks a sequence reaches are read."""
    q, kv, qsl, lens, tables = make_case([90, 20], [90, 20], 8, 4, head_dim=32)
    tables[1, 2:] = -5  # 20 keys use 2 blocks of 16
    expected = reference.paged_attention(q * 8, kv * 8, qsl, lens, tables.clamp(min=0), 1.0)
    out = _prefill(q * 8, kv * 8, qsl, lens, tables, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


def test_prefill_kernel_refuses_inconsistent_inputs():
    q, kv, qsl, lens, tables = make_case([10, 5], [10, 5], 8, 4)
    with pytest.raises(RuntimeError, match="query rows but"):
        _prefill(q, kv, qsl, torch.tensor([10, 4], dtype=torch.int32), tables, 0.1)
    bad = tables.clone()
    bad[0, 0] = kv.shape[1]
    with pytest.raises(RuntimeError, match="outside"):
        _prefill(q, kv, qsl, lens, bad, 0.1)
    with pytest.raises(RuntimeError, match="span"):
        _prefill(q, kv, torch.tensor([0, 10, 14]), lens, tables, 0.1)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_chunk_after_context_half_precision(dtype, tol):
    q_lens, ctx = [96, 5], [96 + 200, 5 + 33]
    q, kv, qsl, lens, tables = make_case(q_lens, ctx, 8, 4, dtype=dtype)
    expected = reference.paged_attention(q.float(), kv.float(), qsl, lens, tables, 0.125)
    out = torch_attention.paged_attention(q, kv, qsl, lens, tables, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_decode_scores_spanning_the_float_range():
    """Peaked softmaxes: most weights underflow to exactly 0 (exp below -87), one dominates."""
    q, kv, qsl, lens, tables = make_case([1] * 3, [2, 37, 300], 8, 4, head_dim=32)
    expected = reference.paged_decode_attention(q * 8, kv * 8, lens, tables, 1.0)
    out = torch_attention.paged_decode_attention(q * 8, kv * 8, lens, tables, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rot_dim", [64, 32])  # full and partial rotation
def test_rotary_is_bit_identical_to_reference_on_qkv_views(rot_dim, interleaved):
    g = torch.Generator().manual_seed(rot_dim)
    t, heads, kv_heads, d = 37, 8, 2, 64
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)  # strided views, as in the model
    q, k = q.view(t, heads, d), k.view(t, kv_heads, d)
    cos_sin = torch.randn(300, rot_dim, generator=g)
    positions = torch.randint(0, 300, (t,), generator=g)
    before = qkv.clone()
    got = torch_attention.rotary_embedding(positions, q, k, cos_sin, interleaved)
    expected = reference.rotary_embedding(positions, q, k, cos_sin, interleaved)
    for a, b in zip(got, expected):
        assert a.is_contiguous() and torch.equal(a, b)
    assert torch.equal(qkv, before)  # inputs untouched


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotary_half_precision(dtype, interleaved):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(9, 4, 32, generator=g).to(dtype), torch.randn(9, 2, 32, generator=g).to(dtype)
    positions, cos_sin = torch.arange(9), torch.randn(16, 32, generator=g)
    for a, b in zip(torch_attention.rotary_embedding(positions, q, k, cos_sin, interleaved),
                    reference.rotary_embedding(positions, q, k, cos_sin, interleaved)):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("rot_dim", [64, 32])
def test_interleaved_rotary_is_glms(rot_dim):
    """The interleaved reference rotates as transformers' GLM-4 does (its partial rotary included)."""
    from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb

    from engine.models.rope import cos_sin_cache

    g = torch.Generator().manual_seed(2)
    t, d = 13, 64
    q, k = torch.randn(t, 4, d, generator=g), torch.randn(t, 2, d, generator=g)
    positions = torch.randint(0, 100, (t,), generator=g)
    table = cos_sin_cache(rot_dim, 100, {"rope_type": "default", "rope_theta": 10000.0})
    got_q, got_k = reference.rotary_embedding(positions, q, k, table, interleaved=True)
    cos, sin = table[positions].chunk(2, dim=-1)  # transformers' cos / sin: the halves repeated
    cos, sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    assert not torch.allclose(got_q, reference.rotary_embedding(positions, q, k, table)[0])  # not Neox's


def test_rotary_refuses_positions_outside_the_cache():
    q, k = torch.zeros(2, 4, 32), torch.zeros(2, 2, 32)
    with pytest.raises(RuntimeError, match="outside the rotary cache"):
        torch_attention.rotary_embedding(torch.tensor([0, 16]), q, k, torch.zeros(16, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_exactly_the_reference_slots(dtype):
    g = torch.Generator().manual_seed(7)
    t, kv_heads, d, blocks, bs = 23, 2, 32, 9, 16
    qkv = torch.randn(t, (4 + 2 * kv_heads) * d, generator=g).to(dtype)
    _, k, v = qkv.split([4 * d, kv_heads * d, kv_heads * d], dim=-1)
    k, v = k.view(t, kv_heads, d), v.view(t, kv_heads, d)  # strided views, as in the model
    slots = torch.randperm(blocks * bs, generator=g)[:t]
    slots[[3, 11]] = -1  # padding tokens are not written
    got = torch.full((2, blocks, bs, kv_heads, d), float("nan"), dtype=dtype)
    expected = got.clone()
    torch_attention.store_kv(k, v, got, slots)
    reference.store_kv(k, v, expected, slots)
    assert torch.equal(got.nan_to_num(123.0), expected.nan_to_num(123.0))
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch_attention.store_kv(k[:1], v[:1], got, torch.tensor([blocks * bs]))


@pytest.mark.parametrize("head_dim", [32, 128, 48])
def test_decode_large_batch_matches_reference(head_dim):
    """Batches of many sequences: one item per sequence."""
    ctx = [1 + (i * 37) % 300 for i in range(40)]
    q, kv, qsl, lens, tables = make_case([1] * len(ctx), ctx, 8, 2, head_dim)
    expected = reference.paged_decode_attention(q, kv, lens, tables, 0.1)
    out = torch.full_like(q, float("nan"))
    torch_attention.paged_decode_attention(q, kv, lens, tables, 0.1, out)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    half = torch_attention.paged_decode_attention(q.bfloat16(), kv.bfloat16(), lens, tables, 0.1)
    torch.testing.assert_close(half.float(), reference.paged_decode_attention(
        q.bfloat16(), kv.bfloat16(), lens, tables, 0.1).float(), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gather_and_scatter_blocks_match_reference(dtype):
    g = torch.Generator().manual_seed(3)
    caches = [torch.randn(2, 40, 16, 2, 32, generator=g).to(dtype) for _ in range(3)]
    ids = torch.tensor([7, 8, 9, 31, 0, 22, 39])  # a run, then scattered, unsorted
    got = torch.full((3, 2, len(ids), 16, 2, 32), float("nan"), dtype=dtype)
    torch_attention.gather_blocks(caches, ids, out=got)
    assert torch.equal(got, reference.gather_blocks(caches, ids))
    dest = [torch.randn(2, 40, 16, 2, 32, generator=g).to(dtype) for _ in range(3)]
    expected = [c.clone() for c in dest]
    torch_attention.scatter_blocks(got, dest, ids.flip(0))
    reference.scatter_blocks(got, expected, ids.flip(0))
    assert all(torch.equal(a, b) for a, b in zip(dest, expected))
    with pytest.raises(RuntimeError, match="outside"):
        torch_attention.scatter_blocks(got[:, :, :1].contiguous(), dest, torch.tensor([40]))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, tol, with_residual):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(70, 256, generator=g).to(dtype)
    residual = torch.randn(70, 256, generator=g).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(256, generator=g)).to(dtype)
    got, got_res = torch_attention.rms_norm(x, weight, 1e-6, residual)
    expected, expected_res = reference.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(got_res, expected_res)  # the residual stream is exact
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    heads = x.view(70, 8, 32)[:, ::2]  # q/k-norm: per-head rows of a strided view
    got, _ = torch_attention.rms_norm(heads, weight[:32], 1e-6)
    torch.testing.assert_close(got.float(), reference.rms_norm(heads, weight[:32], 1e-6)[0].float(), atol=tol, rtol=tol)


def test_prefill_only_step_writes_the_callers_output():
    """A step of prompts only: the kernel writes the caller's output in place where it can, and a
    strided one (a view into a wider buffer) gets the same values copied in."""
    q, kv, qsl, lens, tables = make_case([70, 33], [70, 33 + 40], 8, 4)
    expected = reference.paged_attention(q, kv, qsl, lens, tables, 0.125)
    out = torch.full_like(q, float("nan"))
    assert torch_attention.paged_attention(q, kv, qsl, lens, tables, 0.125, out) is out
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    wide = torch.full((q.shape[0], q.shape[1], 2 * q.shape[2]), float("nan"))
    view = wide[..., :q.shape[2]]
    assert torch_attention.paged_attention(q, kv, qsl, lens, tables, 0.125, view) is view
    torch.testing.assert_close(view, expected, atol=1e-5, rtol=1e-5)
    assert torch.isnan(wide[..., q.shape[2]:]).all()


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("head_dim", [64, 128, 48])  # unrolled sizes, and a runtime one
@pytest.mark.parametrize("path", ["cpp", "torch"])
def test_an_fp8_cache_is_read_in_the_querys_dtype(cache_dtype, dtype, tol, head_dim, path, monkeypatch):
    """--kv-cache-dtype fp8: decode rows, fresh prompts and chunks after context over an 8-bit
    cache match the reference, which widens the same stored values: the C++ kernels read the
    cache in place (widening a block or a key's row at a time), the torch path (no compiler)
    gathers and widens it."""
    q_lens = [1, 7, 1, 16, 33, 1]
    ctx = [20, 7, 1, 40, 100, 257]
    q, kv, qsl, lens, tables = make_case(q_lens, ctx, 8, 2, head_dim=head_dim, block_size=32, dtype=dtype)
    kv = (kv.float() * 3).to(cache_dtype)
    if path == "torch":
        monkeypatch.setattr(torch_attention, "_attention_ext", lambda query, cache: None)
    else:
        assert torch_attention._attention_ext(q, kv) is cpu_ops.load() is not None
    expected = reference.paged_attention(q, kv, qsl, lens, tables, 0.125)
    out = torch.full_like(q, float("nan"))
    torch_attention.paged_attention(q, kv, qsl, lens, tables, 0.125, out)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    decode = torch_attention.paged_decode_attention(q[:4], kv, lens[:4], tables[:4], 0.125)
    torch.testing.assert_close(decode.float(), reference.paged_decode_attention(
        q[:4], kv, lens[:4], tables[:4], 0.125).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("head_dim", [64, 4])  # prefill widens a key's row: 8 at a time, or one by one
def test_the_cpp_kernels_widen_every_fp8_value_exactly(cache_dtype, head_dim):
    """All 256 bytes of the format (subnormals, the largest values, NaN, e5m2's infinities) read
    by the decode and prefill kernels as torch widens them: each one-token sequence's output is
    its V row (one key, softmax weight 1)."""
    ext = cpu_ops.load()
    n = 256 // head_dim
    values = torch.arange(256, dtype=torch.uint8).view(cache_dtype).view(n, 1, head_dim)  # the V rows
    kv = torch.zeros(2, n, 16, 1, head_dim, dtype=cache_dtype)
    kv[1, :, 0] = values
    want = values.float().expand(n, 2, head_dim)  # 2 query heads on the KV head
    q = torch.randn(n, 2, head_dim)
    lens = torch.ones(n, dtype=torch.int32)
    tables = torch.arange(n, dtype=torch.int32)[:, None]
    out = torch.empty_like(q)
    ext.paged_decode_attention(q, kv, lens, tables, 0.125, out)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    out = torch.empty_like(q)
    ext.paged_prefill_attention(q, kv, torch.arange(n + 1), lens, tables, 0.125, out)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    half = torch.empty_like(q.bfloat16())
    ext.paged_decode_attention(q.bfloat16(), kv, lens, tables, 0.125, half)
    torch.testing.assert_close(half, want.bfloat16(), rtol=0, atol=0, equal_nan=True)


def test_the_cpp_kernels_refuse_a_cache_of_another_dtype():
    q, kv, qsl, lens, tables = make_case([1, 3], [9, 12], 4, 2)
    ext = cpu_ops.load()
    with pytest.raises(RuntimeError, match="cache must be the query's dtype or fp8"):
        ext.paged_decode_attention(q[:2].contiguous(), kv.half(), lens, tables, 0.1, torch.empty_like(q[:2]))
    with pytest.raises(RuntimeError, match="cache must be the query's dtype or fp8"):
        ext.paged_prefill_attention(q.double(), kv.to(torch.float8_e4m3fn), qsl, lens, tables, 0.1,
                                    torch.empty_like(q.double()))
    assert torch_attention._attention_ext(q.double(), kv.to(torch.float8_e4m3fn)) is None  # the torch path


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_fp8_store_rounds_to_nearest_and_saturates(cache_dtype, dtype, monkeypatch):
    """The C++ store writes what the reference writes, byte for byte: rounded to nearest even,
    saturated (448 is e4m3's largest finite value, 57,344 e5m2's), NaN kept, from rows that are
    views into a wider tensor (the fused QKV output)."""
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(40, 3, 2, 64, generator=g) * torch.logspace(-4, 5, 64)).to(dtype)
    new = qkv[:, 1]  # [tokens, KV heads, head dim], strided
    new[0, 0, :5] = torch.tensor([1.0, 1000.0, -1e6, 0.3, float("nan")]).to(dtype)
    slots = torch.randperm(128, generator=g)[:40]
    slots[3] = -1  # a padding row: not written
    got, want = torch.zeros(2, 4, 32, 2, 64, dtype=cache_dtype), torch.zeros(2, 4, 32, 2, 64, dtype=cache_dtype)
    store = reference.store_kv
    monkeypatch.setattr(reference, "store_kv", lambda *a: pytest.fail("the C++ store should take these rows"))
    torch_attention.store_kv(new, qkv[:, 2], got, slots)
    store(new, qkv[:, 2], want, slots)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    top = torch.finfo(cache_dtype).max
    b, o = divmod(int(slots[0]), 32)
    stored = got[0, b, o, 0, :5].float()
    assert stored[:4].tolist() == [1.0, min(top, float(torch.tensor(1000.0, dtype=dtype).to(cache_dtype))), -top,
                                   float(torch.tensor(0.3, dtype=dtype).to(cache_dtype))]
    assert stored[4].isnan()


# Sliding windows (Mistral's, Gemma's local layers) and soft-capped scores (Gemma 2): a window of
# one key, windows inside a block, across blocks and wider than every context.
BANDS = [(1, 0.0), (7, 0.0), (40, 0.0), (5000, 0.0), (0, 5.0), (33, 2.0)]


@pytest.mark.parametrize("window,softcap", BANDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_sliding_windows_and_soft_caps_match_reference(window, softcap, threads):
    """Decode (whole sequences, and a long one cut into slices: the slices start at the window's
    block) and prefill (fresh prompts, chunks after context, decode rows) in float32, bf16 and over
    an fp8 cache."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for q_lens, ctx in (([1] * 4, [3, 40, 411, 1500]), ([1], [1500]), ([50, 40, 1, 129], [50, 300, 17, 129])):
            for dtype, cache_dtype, tol in ((torch.float32, None, 1e-5), (torch.bfloat16, None, 1.6e-2),
                                            (torch.float32, torch.float8_e4m3fn, 1e-5)):
                q, kv, qsl, lens, tables = make_case(q_lens, ctx, 8, 2, head_dim=64, dtype=dtype)
                kv = kv.to(cache_dtype or dtype)
                expected = reference.paged_attention(q, kv, qsl, lens, tables, 0.1, window=window, softcap=softcap)
                out = torch_attention.paged_attention(q, kv, qsl, lens, tables, 0.1, window=window, softcap=softcap)
                torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(before)


def test_the_reference_window_is_the_last_keys_attention():
    """The band the kernels are held to: a query sees exactly the last `window` keys (its own
    included), as plain softmax attention over those keys computes it."""
    q, kv, qsl, lens, tables = make_case([1, 1], [5, 100], 4, 2)
    banded = reference.paged_decode_attention(q, kv, lens, tables, 0.1, window=8)
    torch.testing.assert_close(banded[0], reference.paged_decode_attention(q, kv, lens, tables, 0.1)[0])
    k, v = reference.gather_context(kv, tables[1], 100)
    k, v = k[92:].repeat_interleave(2, dim=1), v[92:].repeat_interleave(2, dim=1)  # [8, 4, 64]
    probs = torch.softmax(torch.einsum("hd,shd->hs", q[1], k) * 0.1, dim=-1)
    torch.testing.assert_close(banded[1], torch.einsum("hs,shd->hd", probs, v))
