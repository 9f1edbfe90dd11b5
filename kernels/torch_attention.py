"""The engine's kernels on CPU: the default path off CUDA.

Same signatures as kernels.reference. Decode attention, rotary, RMSNorm, store_kv and block
gather/scatter run as C++ (kernels/csrc/cpu_attention.cpp, built on first use); without a
compiler, or for inputs the C++ does not take, each falls back to the reference. An fp8 cache
(--kv-cache-dtype fp8) is read in place by the C++ attention and stored by its store_kv. Prefill
rows too run as C++ (flash attention read in place from the paged cache, ~1.2-1.5x SDPA's CPU
flash kernel at head size 64 with AVX-512, 0.7-1.2x on AVX2 only: docs/kernels.md); without it they go to SDPA one row at a time (causal for fresh
prompts; a chunk after earlier context as the context unmasked plus its own causal triangle,
merged by log-sum-exp).
The cache must hold finite values everywhere (it is zero-initialised): padding slots are
masked, and 0 * NaN would still poison the output.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_ops, reference


def _ext(t: torch.Tensor):
    """The C++ module for a CPU tensor, else None (then the caller falls back)."""
    return cpu_ops.load() if t.device.type == "cpu" else None


def _cpp_takes(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the C++ kernels read and write a cache of cache_dtype from tensors of dtype: the
    same dtype, or fp8 (widened and narrowed in place) beside float32, float16 or bfloat16."""
    return dtype == cache_dtype or (cache_dtype in reference.FP8_CACHE_DTYPES and dtype != torch.float64)


def _attention_ext(query: torch.Tensor, kv_cache: torch.Tensor):
    """The C++ module where its attention reads this cache (_cpp_takes), else None."""
    return _ext(query) if _cpp_takes(query.dtype, kv_cache.dtype) else None


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
                           scale: float, out: torch.Tensor | None = None, window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    ext = _attention_ext(query, kv_cache)
    if ext is not None:
        if out is None or not out.is_contiguous():
            result = torch.empty_like(query)
            ext.paged_decode_attention(query.contiguous(), kv_cache, seq_lens.to(torch.int32),
                                       block_tables.to(torch.int32), scale, result, window, softcap)
            return result if out is None else out.copy_(result)
        ext.paged_decode_attention(query.contiguous(), kv_cache, seq_lens.to(torch.int32),
                                   block_tables.to(torch.int32), scale, out, window, softcap)
        return out
    if window or softcap:  # SDPA takes neither a window's band nor soft-capped scores
        return reference.paged_decode_attention(query, kv_cache, seq_lens, block_tables, scale, out, window, softcap)
    return _torch_decode(query, kv_cache, seq_lens, block_tables, scale, out)


def _torch_decode(query, kv_cache, seq_lens, block_tables, scale, out):
    b, h, d = query.shape
    max_seq_len = int(seq_lens.max())
    k, v = _gather_context(kv_cache, block_tables, max_seq_len)
    k, v = k.to(query.dtype), v.to(query.dtype)  # an fp8 cache, read back in the query's dtype
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
                    out: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    t = query.shape[0]
    b = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if t == b:  # every sequence has exactly one query token
        return paged_decode_attention(query, kv_cache, seq_lens, block_tables, scale, out, window, softcap)
    band = dict(window=window, softcap=softcap) if window or softcap else {}
    qsl = query_start_loc.to(torch.long)
    q_lens = qsl[1:] - qsl[:-1]
    decode = q_lens == 1
    if bool(decode.any()):
        rows = torch.nonzero(decode).flatten()
        tokens = qsl[:-1][rows]
        out[tokens] = paged_decode_attention(query[tokens], kv_cache, seq_lens[rows],
                                             block_tables[rows], scale, None, window, softcap)
        rows = torch.nonzero(~decode & (q_lens > 0)).flatten()
        if len(rows) == 0:
            return out
        sub_qsl = torch.zeros(len(rows) + 1, dtype=torch.long, device=query.device)
        torch.cumsum(q_lens[rows], 0, out=sub_qsl[1:])
        token_idx = torch.cat([torch.arange(int(qsl[r]), int(qsl[r + 1])) for r in rows.tolist()])
        out[token_idx] = _prefill(query[token_idx], kv_cache, sub_qsl, seq_lens[rows], block_tables[rows], scale,
                                  **band)
        return out
    return _prefill(query, kv_cache, qsl, seq_lens, block_tables, scale, out, **band)


# SDPA's CPU flash kernel with the log-sum-exp of each query row (torch's own op; absent in
# some builds, then chunks take the masked path).
_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _prefill(query, kv_cache, qsl, seq_lens, block_tables, scale, out=None, window=0, softcap=0.0) -> torch.Tensor:
    """Varlen causal attention over the paged cache (each row's query tokens at the end of its
    keys): the C++ kernel, else _sdpa_prefill; into `out` when given (the kernel writes it in
    place where it is contiguous and of the query's dtype)."""
    ext = _attention_ext(query, kv_cache)
    if ext is not None:
        direct = out is not None and out.is_contiguous() and out.dtype == query.dtype
        result = out if direct else torch.empty(query.shape, dtype=query.dtype, device=query.device)
        ext.paged_prefill_attention(query.contiguous(), kv_cache, qsl, seq_lens.to(torch.int32),
                                    block_tables.to(torch.int32), scale, result, window, softcap)
    elif window or softcap:  # SDPA takes neither a window's band nor soft-capped scores
        result = reference.paged_attention(query, kv_cache, qsl, seq_lens, block_tables, scale, None, window, softcap)
    else:
        result = _sdpa_prefill(query, kv_cache, qsl, seq_lens, block_tables, scale)
    if out is None or result is out:
        return result
    return out.copy_(result)


def _sdpa_prefill(query, kv_cache, qsl, seq_lens, block_tables, scale) -> torch.Tensor:
    """_prefill as one SDPA call per prefill row (a step holds few of them).

    A fresh prompt (no earlier context) is plain causal attention: SDPA's is_causal path, with
    no mask to build. A chunk after earlier context: _chunk_after_context on the CPU, else an
    explicit bottom-right causal mask.
    """
    out = torch.empty_like(query)
    block_size = kv_cache.shape[2]
    starts, lens = qsl.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        ids = block_tables[i, :-(-seq_len // block_size)].long()
        # [kvH, S, D], in the query's dtype (an fp8 cache's values widened).
        k = kv_cache[0, ids].flatten(0, 1)[:seq_len].transpose(0, 1).to(query.dtype)
        v = kv_cache[1, ids].flatten(0, 1)[:seq_len].transpose(0, 1).to(query.dtype)
        q = query[start:end].transpose(0, 1)  # [H, Q, D]
        if k.shape[0] != q.shape[0]:
            # Repeat the KV heads rather than pass enable_gqa: with it, CPU SDPA takes its math
            # path (mask, softmax, bmm: 3.5x slower here); 4-D, equal heads get the flash kernel.
            k = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
            v = v.repeat_interleave(q.shape[0] // v.shape[0], 0)
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)[0]
        elif _FLASH_LSE is not None and q.device.type == "cpu":
            o = _chunk_after_context(q, k, v, seq_len - q_len, scale)
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)[0]
        out[start:end] = o.transpose(0, 1).to(query.dtype)
    return out


def _chunk_after_context(q, k, v, ctx: int, scale: float) -> torch.Tensor:
    """Attention of a chunk of queries at positions ctx.. over keys 0..ctx+Q-1, as two flash
    calls merged by their log-sum-exp: the earlier context, which every query sees (no mask),
    and the chunk's own keys, causal. An explicit mask makes SDPA compute the whole rectangle,
    the upper triangle included (768 queries after 256 tokens: 10.5 ms against 7.8 split, on
    two cores). q [H, Q, D], k/v [H, ctx+Q, D]; [H, Q, D] in float32."""
    o1, lse1 = _FLASH_LSE(q[None], k[None, :, :ctx], v[None, :, :ctx], 0.0, False, scale=scale)[:2]
    o2, lse2 = _FLASH_LSE(q[None], k[None, :, ctx:], v[None, :, ctx:], 0.0, True, scale=scale)[:2]
    # Each part's softmax weight in the whole: exp(lse1) / (exp(lse1) + exp(lse2)).
    w1 = torch.sigmoid(lse1[0].float() - lse2[0].float())[..., None]
    o2 = o2[0].float()
    return o2 + (o1[0].float() - o2) * w1


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference.rotary_embedding, one C++ pass over q and k (bit-identical in float32)."""
    ext = _ext(query)
    if ext is None:
        return reference.rotary_embedding(positions, query, key, cos_sin_cache, interleaved)
    q, k = ext.rotary_embedding(positions, query, key, cos_sin_cache, interleaved)
    return q, k


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kernels.reference.store_kv as one C++ copy per token (no index tensors built); into an fp8
    cache, saturated and rounded as the reference stores."""
    ext = _ext(kv_cache)
    if ext is None or value.dtype != key.dtype or not _cpp_takes(key.dtype, kv_cache.dtype):
        return reference.store_kv(key, value, kv_cache, slot_mapping)
    ext.store_kv(key, value, kv_cache, slot_mapping)


def _copy_blocks_ext(kv_caches, staging):
    ext = _ext(staging)
    if ext is None or not staging.is_contiguous() or any(
            not c.is_contiguous() or c.dtype != staging.dtype or c.device != staging.device for c in kv_caches):
        return None
    return ext


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.reference.gather_blocks, one memcpy per (layer, K/V, block)."""
    if out is None:
        c = kv_caches[0]
        out = torch.empty((len(kv_caches), 2, len(block_ids), *c.shape[2:]), dtype=c.dtype, device=c.device)
    ext = _copy_blocks_ext(kv_caches, out)
    if ext is None:
        return reference.gather_blocks(kv_caches, block_ids, out=out)
    ext.copy_blocks(list(kv_caches), out, block_ids, True)
    return out


def scatter_blocks(staging: torch.Tensor, kv_caches: list[torch.Tensor], block_ids: torch.Tensor) -> None:
    """kernels.reference.scatter_blocks, one memcpy per (layer, K/V, block)."""
    ext = _copy_blocks_ext(kv_caches, staging)
    if ext is None:
        return reference.scatter_blocks(staging, kv_caches, block_ids)
    ext.copy_blocks(list(kv_caches), staging, block_ids, False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference.rms_norm in one C++ pass (the residual add fused)."""
    ext = _ext(x)
    if ext is None or weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        return reference.rms_norm(x, weight, eps, residual)
    out, res = ext.rms_norm(x, weight.detach(), eps, residual)
    return out, res
