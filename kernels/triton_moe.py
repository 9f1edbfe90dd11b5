"""A fused mixture-of-experts MLP in Triton: each tile of rows runs through one expert's weights.

The pairs (token, expert) are sorted by expert into tiles of BLOCK_M rows (kernels.moe.
align_by_expert, on the device), so an expert's weights are read once per tile rather than once
per token: a grouped GEMM for the gate/up projection (rows gathered from the tokens), SiLU-and-
multiply, a second grouped GEMM for the down projection scaled by each pair's routing weight,
and the k rows of each token summed. Nothing is read back to the host: a CUDA graph captures it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe import align_by_expert, check_moe_args
from kernels.triton_layers import silu_and_mul
from kernels.triton_paged import dot_options


@triton.jit
def _grouped_gemm_kernel(a, b, c, weights, scale, sorted_pairs, tile_expert, num_rows, N, K, num_pairs,
                         group, num_groups, stride_am, stride_be, stride_bn, stride_cm,
                         A_ROWS_PER_PAIR: tl.constexpr, MUL_WEIGHT: tl.constexpr, SCALED: tl.constexpr,
                         TILE_SCALE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # c[pair, n] = (weight[pair] *) sum_k a[pair // A_ROWS_PER_PAIR, k] * b[expert, n, k] for the
    # BLOCK_M pairs of this program's tile, all routed to one expert; float32 accumulation.
    # SCALED: b holds 8-bit values (FP8 or INT8) and scale float32 [E, N, num_groups], each tile of
    # b dequantized to a's dtype next to the dot, never stored; TILE_SCALE: a group spans whole K
    # tiles (one scale a row a tile).
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_rows):
        return  # an idle tile past the padded rows in use
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs + rm)
    valid = pair < num_pairs
    row = (pair // A_ROWS_PER_PAIR).to(tl.int64)
    expert = tl.load(tile_expert + pid_m).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    b_rows = b + expert * stride_be + rn[None, :].to(tl.int64) * stride_bn
    scale_rows = scale + (expert * N + rn[None, :].to(tl.int64)) * num_groups
    a_ty = a.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(a + row[:, None] * stride_am + k[None, :], mask=valid[:, None] & (k[None, :] < K), other=0.0)
        wmask = (k[:, None] < K) & (rn[None, :] < N)
        w = tl.load(b_rows + k[:, None], mask=wmask, other=0.0)
        if SCALED:
            if TILE_SCALE:
                s = tl.load(scale_rows + k0 // group, mask=rn[None, :] < N, other=0.0)
            else:
                s = tl.load(scale_rows + k[:, None] // group, mask=wmask, other=0.0)
            w = (w.to(tl.float32) * s).to(a_ty)
        if UPCAST:  # the interpreter's bf16 dot is wrong: the same values, in float32
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(x, w, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    c_ty = c.dtype.element_ty
    if MUL_WEIGHT:  # the product rounds to c's dtype before the weight, as the reference does
        acc = acc.to(c_ty).to(tl.float32) * tl.load(weights + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c + pair[:, None].to(tl.int64) * stride_cm + rn[None, :], acc.to(c_ty),
             mask=valid[:, None] & (rn[None, :] < N))


def _tiles(pairs: int, experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): short tiles while experts see a few rows each (decode)."""
    block_m = 16 if pairs < 16 * experts else 64
    return block_m, 64, 64


def _grouped_gemm(a, b, c, weights, scale, sorted_pairs, tile_expert, num_rows, a_rows_per_pair, block_m) -> None:
    num_pairs, n = c.shape
    k = a.shape[1]
    _, block_n, block_k = _tiles(num_pairs, b.shape[0])
    groups = 1 if scale is None else scale.shape[2]
    group = -(-k // groups)
    grid = (sorted_pairs.numel() // block_m, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, weights if weights is not None else c, scale if scale is not None else c, sorted_pairs,
        tile_expert, num_rows, n, k, num_pairs, group, groups,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        A_ROWS_PER_PAIR=a_rows_per_pair, MUL_WEIGHT=weights is not None, SCALED=scale is not None,
        TILE_SCALE=group % block_k == 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **dot_options(a.dtype))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.reference.fused_moe on the GPU (and in the interpreter). The k experts' rows of a
    token are summed after the down projection (in float32, rounded once), not expert by expert.
    8-bit experts (scales given) are dequantized tile by tile inside the GEMMs (W8A16)."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    if w13_scale is not None:
        w13_scale, w2_scale = w13_scale.contiguous(), w2_scale.contiguous()
    t, k = topk_ids.shape
    experts, two_inter, hidden = w13.shape
    if t == 0:
        return torch.zeros_like(x)
    for name, w in (("w13", w13), ("w2", w2)):
        if w.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    x = x if x.stride(-1) == 1 else x.contiguous()
    pairs = t * k
    block_m = _tiles(pairs, experts)[0]
    sorted_pairs, tile_expert, num_rows = align_by_expert(topk_ids, experts, block_m)
    gate_up = torch.empty(pairs, two_inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, None, w13_scale, sorted_pairs, tile_expert, num_rows, k, block_m)
    h = silu_and_mul(gate_up)
    down = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(h, w2, down, topk_weights.reshape(-1).contiguous(), w2_scale, sorted_pairs, tile_expert,
                  num_rows, 1, block_m)
    return down.view(t, k, hidden).sum(1, dtype=torch.float32).to(x.dtype)
