"""Triton paged decode attention: one query token per sequence, split along the context (flash-decoding)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_paged import LOG2E, attend_kv_tile, check_attention_args, dot_options, head_block, softcap_log2

DECODE_BLOCK_N = 64  # keys per tile; splits are whole tiles
MIN_SPLIT_TOKENS = 512  # below this a split's fixed cost (query load, partial write) dominates


@triton.jit
def _paged_decode_kernel(
        out, mid_out, mid_lse, query, kv_cache, seq_lens, block_tables, qk_scale,
        tokens_per_split, num_splits,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kv, stride_blk, stride_slot, stride_kvh, stride_bt,
        NUM_HEADS: tl.constexpr, SPLIT: tl.constexpr,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    # One program: one sequence x the GROUP query heads of one KV head x one context split.
    # The heads are padded to BLOCK_H rows (>= 16, tl.dot's minimum); K/V is read once per group.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    k_begin = split * tokens_per_split
    if WINDOW > 0:  # the query (the last token) sees the last WINDOW keys: the splits cut those
        k_begin += tl.maximum(seq_len - WINDOW, 0)
    k_end = tl.minimum(seq_len, k_begin + tokens_per_split)

    h = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + h
    d = tl.arange(0, BLOCK_D)
    io_mask = (h < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(query + seq * stride_qt + head[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    block_table = block_tables + seq * stride_bt
    for k_start in range(k_begin, k_end, BLOCK_N):
        m_i, l_i, acc = attend_kv_tile(
            q, m_i, l_i, acc, kv_cache, block_table, kv_head, k_start, k_end, h, qk_scale,  # h: no causal q_pos
            stride_kv, stride_blk, stride_slot, stride_kvh,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, 0, SOFTCAP)
    # A split past the end of a short sequence saw no keys: l = 0, weight 0 in the reduction.
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        part = (seq * NUM_HEADS + head) * num_splits + split  # mid_lse [seqs, heads, splits]
        tl.store(mid_out + part[:, None] * HEAD_DIM + d[None, :], acc, mask=io_mask)
        lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse + part, lse, mask=h < GROUP)
    else:
        tl.store(out + seq * stride_ot + head[:, None] * stride_oh + d[None, :],
                 acc.to(out.dtype.element_ty), mask=io_mask)


@triton.jit
def _reduce_splits_kernel(out, mid_out, mid_lse, num_splits, stride_ot, stride_oh,
                          NUM_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    # Merge the partial softmaxes of one (sequence, head): weight each split by exp2(lse - max).
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    part = (seq * NUM_HEADS + head) * num_splits + s
    lse = tl.load(mid_lse + part, mask=s < num_splits, other=float("-inf"))
    weight = tl.math.exp2(lse - tl.max(lse, 0))  # some split holds a key (the last), so the max is finite
    o = tl.load(mid_out + part[:, None] * HEAD_DIM + d[None, :],
                mask=(s < num_splits)[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    o = tl.sum(o * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out + seq * stride_ot + head * stride_oh + d, o.to(out.dtype.element_ty), mask=d < HEAD_DIM)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device; the interpreter runs one program at a time."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, sms: int) -> int:
    """Split the context only when (sequence, kv head) programs alone leave SMs idle."""
    by_occupancy = triton.cdiv(4 * sms, max(1, num_seqs * num_kv_heads))
    by_length = triton.cdiv(max_context, MIN_SPLIT_TOKENS)
    return max(1, min(by_occupancy, by_length))


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float, out: torch.Tensor, num_splits: int,
                     block_n: int = DECODE_BLOCK_N, num_warps: int = 4, num_stages: int = 3, window: int = 0,
                     softcap: float = 0.0) -> torch.Tensor:
    """paged_decode_attention with an explicit split count and tile (tests and benchmarks pick them)."""
    group = check_attention_args(query, kv_cache, out)
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return out
    block_size = kv_cache.shape[2]
    # Bound the context by the block table's width: no device-to-host read of seq_lens; a window
    # bounds the keys a query sees (each sequence's splits start at its window).
    max_context = block_tables.shape[1] * block_size
    if window:
        max_context = min(max_context, window)
    tokens_per_split = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_context, tokens_per_split)
    mid_out = mid_lse = out  # unused placeholders when there is a single split
    if num_splits > 1:
        mid_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        mid_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    block_d = head_block(head_dim)
    _paged_decode_kernel[(num_seqs, kv_cache.shape[3], num_splits)](
        out, mid_out, mid_lse, query, kv_cache, seq_lens, block_tables, scale * LOG2E,
        tokens_per_split, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        NUM_HEADS=num_heads, SPLIT=num_splits > 1, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        WINDOW=window, SOFTCAP=softcap_log2(softcap),
        **dot_options(query.dtype), num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        _reduce_splits_kernel[(num_seqs, num_heads)](
            out, mid_out, mid_lse, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_splits))
    return out


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                           seq_lens: torch.Tensor, block_tables: torch.Tensor,
                           scale: float, out: torch.Tensor | None = None, window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    """One query token per sequence: query [num_seqs, heads, head_dim]. window > 0: the last
    `window` keys only (sliding window); softcap > 0: scores softcap * tanh(score / softcap)."""
    if out is None:
        out = torch.empty_like(query)
    context = block_tables.shape[1] * kv_cache.shape[2]
    splits = decode_num_splits(query.shape[0], kv_cache.shape[3], min(context, window) if window else context,
                               num_sms(query.device))
    return decode_attention(query, kv_cache, seq_lens, block_tables, scale, out, splits, window=window,
                            softcap=softcap)
