"""Mixture-of-experts pieces for the torch backend and the Triton kernel: grouping a step's
(token, expert) pairs by expert.

A step routes each of its T tokens to k experts: T * k pairs, pair p = token * k + slot. The
torch backend sorts the pairs by expert and runs each expert hit once over its tokens (two
matmuls). The Triton kernel (kernels.triton_moe) wants the same order in whole tiles of
BLOCK_M rows per expert, built on the device without reading anything back, so a CUDA graph
can capture it.
"""
from __future__ import annotations

import torch

from kernels import cpu_ops
from kernels.reference import dequantize_experts, silu_and_mul


def check_moe_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                   w2_scale: torch.Tensor | None = None) -> None:
    experts, two_inter, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden or two_inter % 2 or w2.shape != (experts, hidden, two_inter // 2):
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not make a "
                         "mixture of experts ([T, H], [E, 2I, H], [E, H, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
                         f"be [{x.shape[0]}, k]")
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("8-bit experts need both w13_scale and w2_scale")
    for name, w, scale in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        if scale is None:
            continue
        if w.dtype not in (torch.float8_e4m3fn, torch.int8) or scale.dtype != torch.float32 or \
                scale.shape[:2] != w.shape[:2] or scale.dim() != 3 or not 0 < scale.shape[2] <= w.shape[2]:
            raise ValueError(f"{name} {tuple(w.shape)} {w.dtype} with scales {tuple(scale.shape)} {scale.dtype}: "
                             "8-bit experts take FP8 or INT8 values and float32 scales [E, N, groups]")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.reference.fused_moe, each expert hit run once over all its tokens (one read of the
    expert counts on the host per call), the pairs added to their tokens in the reference's order:
    on the CPU through the C++ extension (experts in parallel), else per-expert matmuls, or two
    padded batched ones when every expert is hit evenly (within float rounding of the reference).
    8-bit experts are dequantized one at a time as they run."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    k = topk_ids.shape[1]
    experts = w13.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order within one
    counted = torch.bincount(flat, minlength=experts)
    counts = counted.tolist()
    tokens = order // k
    weights = topk_weights.reshape(-1)[order]
    pairs, most = flat.numel(), max(counts, default=0)
    tracked = torch.is_grad_enabled() and any(t.requires_grad for t in (x, w13, w2, topk_weights))
    ext = cpu_ops.load() if x.device.type == "cpu" and w13_scale is None and 0 < most < 128 and not tracked \
        else None
    if ext is not None:
        # Experts in parallel, each one's matmuls single-threaded (kernels/csrc): 1.2-2x the torch
        # paths below at 1-256 tokens (16 experts, 4 a token, two cores); an expert of ~128 rows
        # or more runs faster as matmuls threaded within themselves (2,048 tokens: 14.4 ms against
        # 19.2). Not under autograd (the extension's threads run in inference mode).
        return ext.fused_moe(x, w13, w2, tokens, weights, counts)
    out = torch.zeros_like(x)
    if min(counts, default=0) > 0 and experts * most <= 2 * pairs and most <= 128 and w13_scale is None:
        # Every expert runs and none far above the rest (a decode step's batch): two batched
        # matmuls over all experts, each padded to the busiest one's rows, instead of a pair of
        # small matmuls per expert (2.6-3.3x at 8-64 tokens on two cores, where those are
        # dominated by their dispatch). Past ~128 rows an expert the per-expert matmuls win;
        # 8-bit experts are dequantized one at a time (all at once would take E times the memory).
        return _padded(x, w13, w2, weights, order, tokens, counted, most, out)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start:start + count]
        up, down = (w13[e], w2[e]) if w13_scale is None else (
            dequantize_experts(w13[e], w13_scale[e], x.dtype), dequantize_experts(w2[e], w2_scale[e], x.dtype))
        h = silu_and_mul(torch.nn.functional.linear(x[rows], up))
        o = torch.nn.functional.linear(h, down) * weights[start:start + count, None]
        out.index_add_(0, rows, o.to(x.dtype))
        start += count
    return out


def _padded(x, w13, w2, weights, order, tokens, counts, most, out) -> torch.Tensor:
    """fused_moe's batched form: pair rows gathered into [E, most, H] (zeros past each expert's
    count), bmm through w13 and w2, then each pair's row weighted and added to its token's, in the
    loop's order (expert by expert, tokens in order within one)."""
    experts, hidden = w13.shape[0], x.shape[1]
    expert = torch.repeat_interleave(torch.arange(experts, device=x.device), counts)
    first = torch.cumsum(counts, 0) - counts
    slot = expert * most + torch.arange(order.numel(), device=x.device) - first[expert]
    rows = x.new_zeros(experts * most, hidden)
    rows[slot] = x[tokens]
    h = silu_and_mul(torch.bmm(rows.view(experts, most, hidden), w13.transpose(1, 2)))
    o = torch.bmm(h, w2.transpose(1, 2)).view(experts * most, hidden)[slot] * weights[:, None]
    return out.index_add_(0, tokens, o.to(x.dtype))


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert, each expert's run padded to whole tiles of block_m rows.

    Returns (sorted_pairs, tile_expert, num_rows): sorted_pairs [R] int32, the pair at each row
    (T * k, past every pair, marks padding); tile_expert [R / block_m] int32, the expert of each
    tile; num_rows [1] int32, the rows in use (tiles at and past it are idle). R = T * k +
    E * (block_m - 1) rounded up to a tile, the most the padding can take: the sizes depend on T
    alone, and nothing is read back to the host.
    """
    pairs = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    count_end = torch.cumsum(counts, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    # A pair's row: its expert's first padded row plus its rank among that expert's pairs.
    dest = (padded_end - padded)[expert] + torch.arange(pairs, device=device) - (count_end - counts)[expert]
    rows = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((rows,), pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    tile_start = torch.arange(0, rows, block_m, device=device)
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, tile_expert.to(torch.int32), padded_end[-1:].to(torch.int32)
