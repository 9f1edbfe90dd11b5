"""Triton fused layer kernels for the Llama family: RMSNorm (+ residual add), SiLU-and-multiply, neox
rotary embedding."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(out, residual_out, x, residual, weight, eps, hidden,
                     stride_x, stride_r, stride_out, stride_rout,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row. Arithmetic is in float32 with the roundings torch does (the add and
    # the normalised value round to x's dtype), which also keeps bf16 exact in the interpreter.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x_ty = x.dtype.element_ty
    h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        h = h.to(x_ty)
        tl.store(residual_out + row * stride_rout + cols, h, mask=mask)
        h = h.to(tl.float32)
    normed = (h * tl.math.rsqrt(tl.sum(h * h, 0) / hidden + eps)).to(x_ty)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * stride_out + cols, (normed.to(tl.float32) * w).to(out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual) normalised, as HF's LlamaRMSNorm; returns (normed, new_residual)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must have x's shape and dtype")
    rows = x.reshape(-1, hidden)
    res_rows = residual.reshape(-1, hidden) if residual is not None else rows
    if rows.stride(-1) != 1 or res_rows.stride(-1) != 1:
        rows, res_rows = rows.contiguous(), res_rows.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    if rows.shape[0]:
        out_rows, res_out_rows = out.view(-1, hidden), residual_out.reshape(-1, hidden)
        _rms_norm_kernel[(rows.shape[0],)](
            out_rows, res_out_rows, rows, res_rows, weight, eps, hidden,
            rows.stride(0), res_rows.stride(0), out_rows.stride(0), res_out_rows.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden))
    return out, residual_out


@triton.jit
def _rotate_heads(out, x, t, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin,
                  num_heads, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                  INTERLEAVED: tl.constexpr):
    """Rotate every head of token t: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), the pairs
    (i, HALF + i), or interleaved (2i, 2i + 1)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    src = x + t * stride_xt + h * stride_xh
    dst = out + t * stride_ot + h * stride_oh
    mask = (h < num_heads) & (i < HALF)
    if INTERLEAVED:
        first, second = 2 * i, 2 * i + 1
    else:
        first, second = i, HALF + i
    x1 = tl.load(src + first, mask=mask, other=0.0)
    x2 = tl.load(src + second, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(dst + first, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(dst + second, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)
    if 2 * HALF < HEAD_DIM:  # partial rotary: the tail passes through unchanged
        d = tl.arange(0, BLOCK_D)[None, :]
        tail = (h < num_heads) & (d >= 2 * HALF) & (d < HEAD_DIM)
        tl.store(dst + d, tl.load(src + d, mask=tail), mask=tail)


@triton.jit
def _rotary_kernel(q_out, k_out, query, key, positions, cos_sin_cache, num_heads, num_kv_heads,
                   stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
                   HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, INTERLEAVED: tl.constexpr):
    # One program per token: its query heads and key heads share one cos/sin row.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    cs = cos_sin_cache + pos * stride_cs
    cos = tl.load(cs + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_out, query, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  num_heads, HEAD_DIM, HALF, BLOCK_H, BLOCK_HALF, BLOCK_D, INTERLEAVED)
    _rotate_heads(k_out, key, t, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  num_kv_heads, HEAD_DIM, HALF, BLOCK_H, BLOCK_HALF, BLOCK_D, INTERLEAVED)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference.rotary_embedding: Neox style, or interleaved (GLM's). cos_sin_cache
    [max_pos, rot_dim]: cos halves then sin halves.

    query [T, heads, head_dim], key [T, kv_heads, head_dim]; rotates the first rot_dim dims.
    Returns new tensors.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim > head_dim or key.shape[2] != head_dim:
        raise ValueError(f"rot_dim {rot_dim} does not fit head_dim {head_dim} (key {tuple(key.shape)})")
    query = query if query.stride(-1) == 1 else query.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    cos_sin_cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q_out, k_out, query, key, positions, cos_sin_cache, num_heads, num_kv_heads,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
            HEAD_DIM=head_dim, HALF=rot_dim // 2, BLOCK_H=triton.next_power_of_2(max(num_heads, num_kv_heads)),
            BLOCK_HALF=triton.next_power_of_2(rot_dim // 2), BLOCK_D=triton.next_power_of_2(head_dim),
            INTERLEAVED=interleaved)
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(out, x, d, stride_x, stride_out, BLOCK: tl.constexpr):
    # One program per (row, BLOCK columns): read gate and up once, write silu(gate) * up once,
    # with torch's rounding points (silu rounds to x's dtype, then the product does).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x_ty = x.dtype.element_ty
    gate = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ty).to(tl.float32)
    tl.store(out + row * stride_out + cols, (act * up).to(out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate, up) -> silu(gate) * up, [..., d]: one pass instead of three."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension holds gate and up halves: it must be even, got {x.shape[-1]}")
    d = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if rows.shape[0] and d:
        out_rows = out.view(-1, d)
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](
            out_rows, rows, d, rows.stride(0), out_rows.stride(0), BLOCK=block)
    return out
