"""Triton paged attention (varlen/causal and split-context decode) against the torch reference."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import FP8, FP8_IDS, assert_close, make_paged_batch, poisoned
from kernels import reference

# (query heads per kv head, kv heads, block size, head dim, dtype): every GQA ratio, both
# block sizes, a head dim that is not a power of two, and each dtype. Few heads: the
# interpreter's time grows with the grid. bfloat16 runs in the interpreter
# too: there the kernels compute its dot products in float32 (the interpreter's bf16 tl.dot
# is wrong); the native bf16 path is checked on a GPU by bench/kernels_gpu.py.
CONFIGS = [
    (1, 2, 16, 64, torch.float32),
    (2, 2, 32, 64, torch.float32),
    (4, 1, 16, 80, torch.float32),
    (8, 1, 32, 64, torch.float32),
    (4, 2, 32, 64, torch.float16),
    (8, 1, 16, 128, torch.bfloat16),
]
CONFIG_IDS = [f"gqa{g}-kv{h}-bs{b}-d{d}-{str(t)[6:]}" for g, h, b, d, t in CONFIGS]

# A mixed batch as chunked prefill makes it: decode rows (q_len 1, one at position 0, one
# 417 tokens deep), whole prompts (5, 16, 129 tokens) and chunks over earlier context; most
# contexts end mid-block.
MIXED_Q_LENS = [1, 5, 16, 17, 1, 129, 3]
MIXED_SEQ_LENS = [1, 5, 16, 150, 417, 129, 421]
DECODE_SEQ_LENS = [1, 5, 16, 17, 129, 417, 1100]


@pytest.mark.parametrize("group,num_kv_heads,block_size,head_dim,dtype", CONFIGS, ids=CONFIG_IDS)
def test_paged_attention_matches_reference_on_mixed_batch(triton_kernels, device, group, num_kv_heads,
                                                          block_size, head_dim, dtype):
    batch = make_paged_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_kv_heads=num_kv_heads, group=group,
                             head_dim=head_dim, block_size=block_size, dtype=dtype)
    expected = reference.paged_attention(batch.query, batch.kv_cache, batch.query_start_loc,
                                         batch.seq_lens, batch.block_tables, batch.scale)
    b = batch.to(device)
    out = poisoned(b.query.shape, dtype, device)
    result = triton_kernels.paged_attention(b.query, b.kv_cache, b.query_start_loc, b.seq_lens,
                                            b.block_tables, b.scale, out=out)
    assert result is out
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("group,num_kv_heads,block_size,head_dim,dtype", CONFIGS, ids=CONFIG_IDS)
def test_paged_decode_attention_matches_reference(triton_kernels, device, group, num_kv_heads,
                                                  block_size, head_dim, dtype):
    from kernels.triton_decode import decode_attention, decode_num_splits, num_sms

    batch = make_paged_batch([1] * len(DECODE_SEQ_LENS), DECODE_SEQ_LENS, num_kv_heads=num_kv_heads, group=group,
                             head_dim=head_dim, block_size=block_size, dtype=dtype)
    expected = reference.paged_decode_attention(batch.query, batch.kv_cache, batch.seq_lens,
                                                batch.block_tables, batch.scale)
    b = batch.to(device)
    # What the engine calls (its own choice of splits), then the other of one / several splits:
    # with 1100 tokens of context at most, 5 splits leave the short sequences' last splits empty.
    out = poisoned(b.query.shape, dtype, device)
    result = triton_kernels.paged_decode_attention(b.query, b.kv_cache, b.seq_lens, b.block_tables,
                                                   b.scale, out=out)
    assert result is out
    assert_close(out, expected, dtype)
    chosen = decode_num_splits(len(DECODE_SEQ_LENS), num_kv_heads, b.block_tables.shape[1] * block_size,
                               num_sms(b.query.device))
    out = poisoned(b.query.shape, dtype, device)
    decode_attention(b.query, b.kv_cache, b.seq_lens, b.block_tables, b.scale, out, 5 if chosen == 1 else 1)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cache_dtype", FP8, ids=FP8_IDS)
def test_attention_over_an_fp8_cache_reads_it_in_the_querys_dtype(triton_kernels, device, cache_dtype, dtype):
    """--kv-cache-dtype fp8: the mixed batch and split-context decode over an 8-bit cache match
    the reference reading the same stored values widened (NaN poison in every slot not read)."""
    batch = make_paged_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_kv_heads=2, group=4, head_dim=64,
                             block_size=16, dtype=dtype, cache_dtype=cache_dtype)
    expected = reference.paged_attention(batch.query, batch.kv_cache, batch.query_start_loc,
                                         batch.seq_lens, batch.block_tables, batch.scale)
    b = batch.to(device)
    out = poisoned(b.query.shape, dtype, device)
    triton_kernels.paged_attention(b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables,
                                   b.scale, out=out)
    assert_close(out, expected, dtype)
    rows = [i for i, n in enumerate(MIXED_Q_LENS) if n == 1]
    last = b.query_start_loc[1:][rows] - 1
    out = poisoned((len(rows), *b.query.shape[1:]), dtype, device)
    triton_kernels.paged_decode_attention(b.query[last], b.kv_cache, b.seq_lens[rows], b.block_tables[rows],
                                          b.scale, out=out)
    assert_close(out, expected[last.cpu()], dtype)


def test_paged_attention_on_a_mostly_decode_batch(triton_kernels, device):
    # Few tokens per sequence: 16-row tiles, i.e. 2 query tokens x 8 heads per program.
    batch = make_paged_batch([1, 1, 3, 1, 1], [1, 200, 37, 64, 17], num_kv_heads=2, group=8, head_dim=64,
                             block_size=16, dtype=torch.float32)
    expected = reference.paged_attention(batch.query, batch.kv_cache, batch.query_start_loc,
                                         batch.seq_lens, batch.block_tables, batch.scale)
    b = batch.to(device)
    out = poisoned(b.query.shape, torch.float32, device)
    triton_kernels.paged_attention(b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables,
                                   b.scale, out=out)
    assert_close(out, expected, torch.float32)


def test_attention_allocates_its_output_when_none_is_given(triton_kernels, device):
    batch = make_paged_batch([3, 1], [40, 9], num_kv_heads=1, group=2, head_dim=32, block_size=16,
                             dtype=torch.float32).to(device)
    prefill = triton_kernels.paged_attention(batch.query, batch.kv_cache, batch.query_start_loc,
                                             batch.seq_lens, batch.block_tables, batch.scale)
    decode = triton_kernels.paged_decode_attention(batch.query[:2], batch.kv_cache, batch.seq_lens,
                                                   batch.block_tables, batch.scale)
    assert prefill.shape == batch.query.shape and prefill.dtype == batch.query.dtype
    assert decode.shape == (2, *batch.query.shape[1:])
    assert not prefill.isnan().any() and not decode.isnan().any()


def test_decode_splits_the_context_only_when_programs_would_leave_the_gpu_idle():
    from kernels.triton_decode import decode_num_splits

    # Llama-3-8B on a 132-SM Hopper: batch 256 fills the GPU, batch 1 at 16k context does not.
    assert decode_num_splits(num_seqs=256, num_kv_heads=8, max_context=4096, sms=132) == 1
    assert decode_num_splits(num_seqs=1, num_kv_heads=8, max_context=16384, sms=132) == 32
    assert decode_num_splits(num_seqs=1, num_kv_heads=8, max_context=100, sms=132) == 1


@pytest.mark.parametrize("window,softcap", [(7, 0.0), (40, 0.0), (0, 5.0), (33, 2.0)])
def test_sliding_windows_and_soft_caps_match_reference(triton_kernels, device, window, softcap):
    """The mixed batch with a window (inside a block, across blocks) and soft-capped scores, and
    split-context decode (splits before the window see no key and weigh nothing in the merge)."""
    from kernels.triton_decode import decode_attention

    batch = make_paged_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_kv_heads=2, group=2, head_dim=64, block_size=16,
                             dtype=torch.float32)
    expected = reference.paged_attention(batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                                         batch.block_tables, batch.scale, window=window, softcap=softcap)
    b = batch.to(device)
    out = poisoned(b.query.shape, torch.float32, device)
    triton_kernels.paged_attention(b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, b.scale,
                                   out=out, window=window, softcap=softcap)
    assert_close(out, expected, torch.float32)
    decode = make_paged_batch([1] * len(DECODE_SEQ_LENS), DECODE_SEQ_LENS, num_kv_heads=2, group=2, head_dim=64,
                              block_size=16, dtype=torch.float32)
    expected = reference.paged_decode_attention(decode.query, decode.kv_cache, decode.seq_lens, decode.block_tables,
                                                decode.scale, window=window, softcap=softcap)
    d = decode.to(device)
    for splits in (1, 5):
        out = poisoned(d.query.shape, torch.float32, device)
        decode_attention(d.query, d.kv_cache, d.seq_lens, d.block_tables, d.scale, out, splits, window=window,
                         softcap=softcap)
        assert_close(out, expected, torch.float32)
