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

from kernels.reference import silu_and_mul


def check_moe_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> None:
    experts, two_inter, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden or two_inter % 2 or w2.shape != (experts, hidden, two_inter // 2):
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not make a "
                         "mixture of experts ([T, H], [E, 2I, H], [E, H, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
                         f"be [{x.shape[0]}, k]")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """kernels.reference.fused_moe, each expert hit run once over all its tokens (one read of the
    expert counts on the host per call); the same sums in the same order."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids)
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order within one
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // k
    weights = topk_weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start:start + count]
        h = silu_and_mul(torch.nn.functional.linear(x[rows], w13[e]))
        o = torch.nn.functional.linear(h, w2[e]) * weights[start:start + count, None]
        out.index_add_(0, rows, o.to(x.dtype))
        start += count
    return out


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
