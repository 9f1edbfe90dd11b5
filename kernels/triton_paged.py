"""Paged-KV pieces shared by the Triton attention kernels: one online-softmax step over a KV tile."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels use exp2, so scores are scaled into log2 units


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(triton.knobs.runtime.interpret)


def dot_options(dtype: torch.dtype) -> dict:
    """Constexprs that keep tl.dot exact enough for `dtype` on GPU and in the interpreter.

    float32 asks for IEEE products (the GPU default is TF32, 10 mantissa bits). bfloat16 is
    upcast to float32 in the interpreter only: its tl.dot on bf16 operands returns garbage.
    """
    return {
        "UPCAST": dtype == torch.bfloat16 and interpreting(),
        "DOT_PRECISION": "ieee" if dtype == torch.float32 or interpreting() else "tf32",
    }


def check_attention_args(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> int:
    """Validate shapes/strides the kernels rely on; returns the GQA group size."""
    num_heads, head_dim = query.shape[1:]
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache must be [2, blocks, block_size, kv_heads, {head_dim}], got {tuple(kv_cache.shape)}")
    if num_heads % kv_cache.shape[3]:
        raise ValueError(f"{num_heads} query heads are not a multiple of {kv_cache.shape[3]} kv heads")
    for name, t in (("query", query), ("kv_cache", kv_cache), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if out.shape != query.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, query {tuple(query.shape)}")
    return num_heads // kv_cache.shape[3]


def head_block(head_dim: int) -> int:
    """Padded head-dim tile: a power of two, and at least tl.dot's minimum of 16."""
    return max(16, triton.next_power_of_2(head_dim))


def softcap_log2(softcap: float) -> float:
    """A soft cap in the kernels' log2 score units (0: none)."""
    return softcap * LOG2E if softcap > 0 else 0.0


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): saturates to +-1 at either end (e^2x overflowing to inf, or 0).
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def attend_kv_tile(q, m_i, l_i, acc, kv_cache, block_table, kv_head, k_start, k_end, q_pos,
                   qk_scale, stride_kv, stride_blk, stride_slot, stride_kvh,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0):
    """Fold keys k_start .. k_start + BLOCK_N - 1 (those below k_end) into the running softmax.

    q [M, BLOCK_D]; m_i, l_i [M] running max and sum (log2 units); acc [M, BLOCK_D] float32.
    With CAUSAL, row r sees only keys at positions <= q_pos[r], and with a WINDOW only those
    above q_pos[r] - WINDOW. SOFTCAP (log2 units, softcap_log2): scores SOFTCAP * tanh(s / SOFTCAP).
    """
    k_pos = k_start + tl.arange(0, BLOCK_N)
    k_valid = k_pos < k_end
    d = tl.arange(0, BLOCK_D)
    # Masked loads: padding of the block table is arbitrary and slots past the context are
    # stale, so neither is read.
    block_id = tl.load(block_table + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
    # int64 before the multiply: block_id * stride_blk passes 2**31 in a large cache.
    slot = block_id * stride_blk + (k_pos % BLOCK_SIZE) * stride_slot + kv_head * stride_kvh
    kv_mask = k_valid[:, None] & (d < HEAD_DIM)[None, :]
    # In q's dtype: a no-op normally; float32 when the caller upcast q (bf16 in the interpreter).
    k = tl.load(kv_cache + slot[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    v = tl.load(kv_cache + stride_kv + slot[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP > 0:
        s = SOFTCAP * _tanh(s / SOFTCAP)
    visible = k_valid[None, :]
    if CAUSAL:
        visible = visible & (k_pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - WINDOW)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; subtract 0 there instead of -inf - -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
