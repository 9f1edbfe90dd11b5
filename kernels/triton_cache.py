"""Triton KV-cache data movement: store_kv (reshape-and-cache) and block gather/scatter for KV transfer."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import fp8_max

COPY_CHUNK = 4096  # elements one gather/scatter program moves


@triton.jit
def _store_kv_kernel(key, value, kv_cache, slot_mapping,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kv, stride_blk, stride_slot, stride_kvh,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SATURATE: tl.constexpr):
    # One program per token: all its kv heads at once.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return  # padding token: -1 means "do not store"
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    dst = (slot // BLOCK_SIZE) * stride_blk + (slot % BLOCK_SIZE) * stride_slot \
        + h[:, None] * stride_kvh + d[None, :]
    k = tl.load(key + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if SATURATE > 0:  # an fp8 cache: out-of-range values stored as its largest finite one, NaN
        # kept (in float32, exact for any input dtype: one rounding, float32 -> fp8)
        k = tl.clamp(k.to(tl.float32), -SATURATE, SATURATE, propagate_nan=tl.PropagateNan.ALL)
        v = tl.clamp(v.to(tl.float32), -SATURATE, SATURATE, propagate_nan=tl.PropagateNan.ALL)
    tl.store(kv_cache + dst, k.to(kv_cache.dtype.element_ty), mask=mask)
    tl.store(kv_cache + stride_kv + dst, v.to(kv_cache.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new K/V rows [num_tokens, kv_heads, head_dim] into the paged cache."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)} do not fit "
                         f"kv_cache {tuple(kv_cache.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("key, value and kv_cache must be contiguous in their last dim")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        SATURATE=fp8_max(kv_cache.dtype))


@triton.jit
def _copy_blocks_kernel(staging, cache_ptrs, block_ids, num_ids, stride_kv, stride_blk,
                        BLOCK_ELEMS: tl.constexpr, CHUNK: tl.constexpr, TO_CACHE: tl.constexpr):
    # Program (layer, kv, j) x chunk: copy one chunk of block block_ids[j] between the layer's
    # cache and staging[layer, kv, j]. A block is BLOCK_ELEMS contiguous elements in both.
    row = tl.program_id(0).to(tl.int64)  # = (layer * 2 + kv) * num_ids + j, staging's own order
    layer = row // (2 * num_ids)
    kv = (row // num_ids) % 2
    block_id = tl.load(block_ids + row % num_ids).to(tl.int64)
    # Each layer is its own allocation: its address comes from a table, cast back to a pointer.
    # The wrapper checks 16-byte alignment; saying so lets the loads be vectorised.
    cache = tl.multiple_of(tl.load(cache_ptrs + layer).to(staging.dtype), 16)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_ELEMS
    src = cache + kv * stride_kv + block_id * stride_blk + offs
    dst = staging + row * BLOCK_ELEMS + offs
    if TO_CACHE:
        tl.store(src, tl.load(dst, mask=mask), mask=mask)
    else:
        tl.store(dst, tl.load(src, mask=mask), mask=mask)


def _copy_blocks(staging: torch.Tensor, kv_caches: list[torch.Tensor], block_ids: torch.Tensor,
                 to_cache: bool) -> None:
    first = kv_caches[0]
    for cache in kv_caches:
        if (cache.shape, cache.stride(), cache.dtype, cache.device) != \
                (first.shape, first.stride(), first.dtype, first.device):
            raise ValueError("every layer's kv_cache must have the same shape, strides, dtype and device")
    block_elems = first[0, 0].numel()
    if not first[0, 0].is_contiguous():
        raise ValueError("each kv_cache block must be contiguous ([..., block_size, kv_heads, head_dim])")
    if any(c.data_ptr() % 16 for c in kv_caches):
        raise ValueError("every layer's kv_cache must start at a 16-byte aligned address")
    ids = block_ids.to(device=first.device, dtype=torch.int64)
    if len(ids) == 0:
        return
    cache_ptrs = torch.tensor([c.data_ptr() for c in kv_caches], dtype=torch.int64, device=first.device)
    chunk = min(COPY_CHUNK, triton.next_power_of_2(block_elems))
    grid = (len(kv_caches) * 2 * len(ids), triton.cdiv(block_elems, chunk))
    _copy_blocks_kernel[grid](staging, cache_ptrs, ids, len(ids), first.stride(0), first.stride(1),
                              BLOCK_ELEMS=block_elems, CHUNK=chunk, TO_CACHE=to_cache)


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy blocks of every layer into a staging buffer [layers, 2, n, block_size, kv_heads, head_dim]."""
    c = kv_caches[0]
    shape = (len(kv_caches), 2, len(block_ids), *c.shape[2:])
    if out is None:
        out = torch.empty(shape, dtype=c.dtype, device=c.device)
    if tuple(out.shape) != shape or out.dtype != c.dtype:
        raise ValueError(f"out must be {shape} {c.dtype}, got {tuple(out.shape)} {out.dtype}")
    staging = out if out.is_contiguous() else torch.empty(shape, dtype=c.dtype, device=c.device)
    _copy_blocks(staging, kv_caches, block_ids, to_cache=False)
    if staging is not out:
        out.copy_(staging)
    return out


def scatter_blocks(staging: torch.Tensor, kv_caches: list[torch.Tensor],
                   block_ids: torch.Tensor) -> None:
    """Inverse of gather_blocks: write staging[layer, :, j] into block block_ids[j] of each layer."""
    c = kv_caches[0]
    shape = (len(kv_caches), 2, len(block_ids), *c.shape[2:])
    if tuple(staging.shape) != shape:
        raise ValueError(f"staging must be {shape}, got {tuple(staging.shape)}")
    _copy_blocks(staging.to(c.dtype).contiguous(), kv_caches, block_ids, to_cache=True)
