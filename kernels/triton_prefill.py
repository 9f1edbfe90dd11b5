"""Triton paged attention for varlen (prefill, chunked prefill, mixed) batches with causal masking."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_paged import LOG2E, attend_kv_tile, check_attention_args, dot_options, head_block, softcap_log2


@triton.jit
def _find_seq(query_start_loc, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning grid block q_block: sequence i owns blocks from qsl[i] // BLOCK_Q + i on."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_prefill_kernel(
        out, query, kv_cache, query_start_loc, seq_lens, block_tables, qk_scale, num_seqs,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kv, stride_blk, stride_slot, stride_kvh, stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr,
        SOFTCAP: tl.constexpr):
    # One program: BLOCK_Q query tokens of one sequence x the GROUP query heads of one KV head,
    # flattened into BLOCK_M rows (row = token * GROUP + head), so K/V tiles are read once per group.
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return  # the grid is an upper bound on the number of query blocks
    seq_len = tl.load(seq_lens + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block_local * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows // GROUP < BLOCK_Q) & (q_idx < q_len)
    token = (q_start + q_idx).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    io_mask = row_valid[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(query + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context_len + q_idx

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table = block_tables + seq.to(tl.int64) * stride_bt
    # Causality: no row of this block sees past its last query token.
    k_end = tl.minimum(seq_len, context_len + (q_block_local + 1) * BLOCK_Q)
    k_begin = 0
    if WINDOW > 0:  # no row sees a key before the earliest row's window
        k_begin = tl.maximum(0, context_len + q_block_local * BLOCK_Q - WINDOW + 1)
    for k_start in range(k_begin, k_end, BLOCK_N):
        m_i, l_i, acc = attend_kv_tile(
            q, m_i, l_i, acc, kv_cache, block_table, kv_head, k_start, k_end, q_pos, qk_scale,
            stride_kv, stride_blk, stride_slot, stride_kvh,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, WINDOW, SOFTCAP)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             acc.to(out.dtype.element_ty), mask=io_mask)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of a varlen batch of queries [T, heads, head_dim] over paged context
    (window > 0: sliding-window attention; softcap > 0: soft-capped scores, as kernels.reference)."""
    if out is None:
        out = torch.empty_like(query)
    group = check_attention_args(query, kv_cache, out)
    num_tokens, _, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    # Mostly-decode batches get short row blocks; prefill chunks get tall ones. Deciding from
    # shapes alone avoids reading query_start_loc back from the device.
    block_m = 16 if num_tokens <= 2 * num_seqs else 64
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, kv_cache.shape[3])
    _paged_prefill_kernel[grid](
        out, query, kv_cache, query_start_loc, seq_lens, block_tables, scale * LOG2E, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=head_block(head_dim),
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=64,
        WINDOW=window, SOFTCAP=softcap_log2(softcap), **dot_options(query.dtype), num_warps=4, num_stages=3)
    return out
