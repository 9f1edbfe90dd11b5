"""Torch reference kernels: the readable oracle every fast kernel is tested against.

Shapes (per layer):
  kv_cache      [2, num_blocks, block_size, num_kv_heads, head_dim]  (0 = K, 1 = V)
  slot_mapping  [num_tokens] int64, slot = block_id * block_size + offset; -1 = skip
  block_tables  [num_seqs, max_blocks_per_seq] int32 (rows padded with anything)
  query_start_loc [num_seqs + 1] int32, cumulative query lengths
  seq_lens      [num_seqs] int32, context length *including* this step's queries
The query tokens of sequence i sit at positions seq_lens[i] - q_len_i ... seq_lens[i] - 1
and attend causally to every earlier position of the same sequence.
"""
from __future__ import annotations

import torch


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new K/V rows [num_tokens, kv_heads, head_dim] into the paged cache."""
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = to_cache_dtype(key[valid], kv_cache.dtype)
    kv_cache[1, blocks, offsets] = to_cache_dtype(value[valid], kv_cache.dtype)


FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 cache dtype (--kv-cache-dtype fp8); 0.0 for any other."""
    return torch.finfo(dtype).max if dtype in FP8_CACHE_DTYPES else 0.0


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V as the cache stores them: an fp8 cache rounds to nearest and saturates (as the
    GPU's conversion does; torch's own e5m2 conversion would make an out-of-range value inf)."""
    top = fp8_max(dtype)
    return (x.clamp(-top, top) if top else x).to(dtype)


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of one sequence as contiguous [seq_len, kv_heads, head_dim] tensors."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    ids = block_table[:num_blocks].long()
    k = kv_cache[0, ids].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    v = kv_cache[1, ids].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    return k, v


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of a varlen batch of queries [T, heads, head_dim] over paged context.
    window > 0: a query at position p sees the keys at p - window + 1 .. p (sliding-window
    attention, transformers' rule); softcap > 0: scores softcap * tanh(scores / softcap)."""
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k, v = gather_context(kv_cache, block_tables[i], seq_len)
        k = k.float().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.float().repeat_interleave(group, dim=1)
        q = query[start:end].float()  # [Q, H, D]
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        hidden = k_pos > q_pos
        if window > 0:
            hidden |= k_pos <= q_pos - window
        scores.masked_fill_(hidden.unsqueeze(0), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqs,shd->qhd", probs, v).to(out.dtype)
    return out


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                           seq_lens: torch.Tensor, block_tables: torch.Tensor,
                           scale: float, out: torch.Tensor | None = None, window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    """One query token per sequence: query [num_seqs, heads, head_dim]."""
    qsl = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return paged_attention(query, kv_cache, qsl, seq_lens, block_tables, scale, out, window, softcap)


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy blocks of every layer into a staging buffer [layers, 2, n, block_size, kv_heads, head_dim]."""
    ids = block_ids.long()
    if out is None:
        c = kv_caches[0]
        out = torch.empty((len(kv_caches), 2, len(ids), *c.shape[2:]), dtype=c.dtype, device=c.device)
    for layer, cache in enumerate(kv_caches):
        torch.index_select(cache, 1, ids, out=out[layer])
    return out


def scatter_blocks(staging: torch.Tensor, kv_caches: list[torch.Tensor],
                   block_ids: torch.Tensor) -> None:
    """Inverse of gather_blocks: write staging[layer, :, j] into block block_ids[j] of each layer."""
    ids = block_ids.long()
    for layer, cache in enumerate(kv_caches):
        # Whole-row writes into a [2 * num_blocks, block_bytes] view: ~5x index_copy_ on CPU.
        rows = torch.cat((ids, ids + cache.shape[1]))
        cache.view(2 * cache.shape[1], -1)[rows] = staging[layer].reshape(2 * len(ids), -1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate, up) -> silu(gate) * up, [..., d], as HF's LlamaMLP computes it."""
    d = x.shape[-1] // 2
    # The product into silu's fresh output: the same rounding, one large buffer less to allocate
    # and fault in (prefill's [2048, d] on the CPU: the multiply ran 2.6x silu's time).
    return torch.nn.functional.silu(x[..., :d]).mul_(x[..., d:])


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate, up) -> gelu(gate, tanh approximation) * up, as HF's GemmaMLP computes it
    (torch ops: the same on every device and backend)."""
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d], approximate="tanh").mul_(x[..., d:])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual) normalised, as HF's LlamaRMSNorm; returns (normed, new_residual)."""
    if residual is not None:
        x = x + residual
    residual_out = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual_out


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding. cos_sin_cache [max_pos, rot_dim]: cos halves then sin halves.

    query [T, heads, head_dim], key [T, kv_heads, head_dim]; rotates the first rot_dim dims:
    dims i and rot_dim / 2 + i as a pair (Neox style), or, interleaved, dims 2i and 2i + 1 (GPT-J
    style: GLM's). Returns new tensors.
    """
    rot_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)
    if interleaved:
        cos, sin = cos.repeat_interleave(2, dim=-1).unsqueeze(1), sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    else:
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
        if interleaved:
            rotated = torch.stack((-x_rot[..., 1::2], x_rot[..., 0::2]), dim=-1).flatten(-2)
        else:
            x1, x2 = x_rot.chunk(2, dim=-1)
            rotated = torch.cat((-x2, x1), dim=-1)
        return torch.cat(((x_rot * cos + rotated * sin).to(x.dtype), x_pass), dim=-1)

    return rotate(query), rotate(key)


def dequantize(values: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Quantized values [..., N, K] (8-bit, or float32 already less their zero points) times float32
    scales [..., N, ceil(K / group)], one a row and group of `group` columns (the last group may be
    short), in `dtype`: the weight a kept projection or expert stands for."""
    k, groups = values.shape[-1], scale.shape[-1]
    v = values.to(torch.float32)
    if k == group * groups:  # no repeated scale made: each group of columns times its scale
        return (v.unflatten(-1, (groups, group)) * scale[..., None]).flatten(-2).to(dtype)
    return (v * scale.repeat_interleave(group, dim=-1)[..., :k]).to(dtype)


def dequantize_experts(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stacked 8-bit experts [E, N, K] (FP8 or INT8) times their float32 scales [E, N, groups]
    (a scale per row and group of ceil(K / groups) columns: the loader keeps only groups that
    divide K), in `dtype`."""
    return dequantize(q, scale, -(-q.shape[-1] // scale.shape[-1]), dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A mixture-of-experts MLP, as transformers' Mixtral / Qwen-MoE experts compute it.

    x [T, H]; w13 [E, 2 * I, H] (each expert's gate rows, then up rows); w2 [E, H, I];
    topk_weights [T, k] and topk_ids [T, k]: each token's k experts and their weights. Returns
    sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)) over the token's experts e = ids[j], [T, H] in
    x's dtype, summed expert by expert in expert order (each product rounded to x's dtype first).
    w13_scale / w2_scale: 8-bit experts (--quantized-weights keep), dequantize_experts' scales.
    """
    if w13_scale is not None:
        w13, w2 = dequantize_experts(w13, w13_scale, x.dtype), dequantize_experts(w2, w2_scale, x.dtype)
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        h = silu_and_mul(torch.nn.functional.linear(x[token], w13[e]))
        o = torch.nn.functional.linear(h, w2[e]) * topk_weights[token, slot, None]
        out.index_add_(0, token, o.to(x.dtype))
    return out
