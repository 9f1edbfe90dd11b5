"""Vectorised paged attention in plain torch: the CPU fast path (no per-sequence Python loop).

Same signatures as kernels.reference. Context is gathered from the paged cache into a
padded [batch, max_seq_len, kv_heads, head_dim] view and handed to SDPA with a causal,
length-aware mask. The cache must hold finite values everywhere (it is zero-initialised):
padding slots are masked, and 0 * NaN would still poison the output.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather_context(kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = kv_cache.shape[2]
    num_blocks = -(-max_seq_len // block_size)
    ids = block_tables[:, :num_blocks].long()
    b = ids.shape[0]
    k = kv_cache[0][ids].view(b, num_blocks * block_size, *kv_cache.shape[3:])
    v = kv_cache[1][ids].view(b, num_blocks * block_size, *kv_cache.shape[3:])
    return k, v


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                           seq_lens: torch.Tensor, block_tables: torch.Tensor,
                           scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    b, h, d = query.shape
    max_seq_len = int(seq_lens.max())
    k, v = _gather_context(kv_cache, block_tables, max_seq_len)
    s = k.shape[1]
    mask = (torch.arange(s, device=query.device)[None, :] < seq_lens[:, None].to(torch.long))
    o = F.scaled_dot_product_attention(
        query.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    o = o.squeeze(2).to(query.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    t = query.shape[0]
    b = seq_lens.shape[0]
    if t == b:  # every sequence has exactly one query token
        return paged_decode_attention(query, kv_cache, seq_lens, block_tables, scale, out)
    dev = query.device
    qsl = query_start_loc.to(torch.long)
    q_lens = qsl[1:] - qsl[:-1]
    seq_lens = seq_lens.to(torch.long)
    max_q = int(q_lens.max())
    max_seq_len = int(seq_lens.max())
    k, v = _gather_context(kv_cache, block_tables, max_seq_len)
    qpos = torch.arange(max_q, device=dev)
    valid_q = qpos[None, :] < q_lens[:, None]  # [B, Qmax]
    q_idx = (qsl[:-1, None] + qpos[None, :]).clamp_(max=t - 1)
    q = query[q_idx]  # [B, Qmax, H, D]
    q_abs = (seq_lens - q_lens)[:, None] + qpos[None, :]
    k_abs = torch.arange(k.shape[1], device=dev)
    mask = k_abs[None, None, :] <= q_abs[:, :, None]  # causal; implies k < seq_len on valid rows
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    o = o.transpose(1, 2)[valid_q].to(query.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out
