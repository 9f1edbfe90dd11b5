"""The Triton backend: each kernel has the signature and semantics of its kernels.reference twin."""
from __future__ import annotations

from kernels.backend import KernelBackend
from kernels.triton_cache import gather_blocks, scatter_blocks, store_kv
from kernels.triton_decode import paged_decode_attention
from kernels.triton_layers import rms_norm, rotary_embedding, silu_and_mul
from kernels.triton_moe import fused_moe
from kernels.triton_prefill import paged_attention


def backend() -> KernelBackend:
    """Triton kernels for CUDA tensors (and, under TRITON_INTERPRET=1, CPU tensors in tests)."""
    return KernelBackend(
        name="triton",
        store_kv=store_kv,
        paged_attention=paged_attention,
        paged_decode_attention=paged_decode_attention,
        gather_blocks=gather_blocks,
        scatter_blocks=scatter_blocks,
        rms_norm=rms_norm,
        rotary_embedding=rotary_embedding,
        silu_and_mul=silu_and_mul,
        fused_moe=fused_moe,
    )
