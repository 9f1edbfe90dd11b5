"""Backend selection: every backend offers the same functions as kernels.reference."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import reference

BACKEND_ENV = "PDSERVE_KERNEL_BACKEND"
BACKENDS = ("auto", "reference", "torch", "triton")


@dataclass(frozen=True)
class KernelBackend:
    """The kernels one engine uses; each has the signature of its kernels.reference twin."""
    name: str
    store_kv: Callable
    paged_attention: Callable
    paged_decode_attention: Callable
    gather_blocks: Callable
    scatter_blocks: Callable
    rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable
    fused_moe: Callable


def _reference() -> KernelBackend:
    return KernelBackend(
        name="reference",
        store_kv=reference.store_kv,
        paged_attention=reference.paged_attention,
        paged_decode_attention=reference.paged_decode_attention,
        gather_blocks=reference.gather_blocks,
        scatter_blocks=reference.scatter_blocks,
        rms_norm=reference.rms_norm,
        rotary_embedding=reference.rotary_embedding,
        silu_and_mul=reference.silu_and_mul,
        fused_moe=reference.fused_moe,
    )


def _torch() -> KernelBackend:
    from kernels import moe, torch_attention

    return KernelBackend(
        name="torch",
        store_kv=torch_attention.store_kv,
        paged_attention=torch_attention.paged_attention,
        paged_decode_attention=torch_attention.paged_decode_attention,
        gather_blocks=torch_attention.gather_blocks,
        scatter_blocks=torch_attention.scatter_blocks,
        rms_norm=torch_attention.rms_norm,
        rotary_embedding=torch_attention.rotary_embedding,
        silu_and_mul=reference.silu_and_mul,  # two vectorised torch ops already
        fused_moe=moe.fused_moe,
    )


def _triton() -> KernelBackend:
    from kernels import triton_backend  # imports triton; fails loudly if it is missing

    return triton_backend.backend()


def get_backend(name: str = "auto", device: torch.device | str = "cpu") -> KernelBackend:
    """Pick a backend: `auto` is Triton on CUDA devices and the vectorised torch path elsewhere.

    The env var PDSERVE_KERNEL_BACKEND overrides `auto`.
    """
    if name == "auto":
        name = os.environ.get(BACKEND_ENV, "auto")
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return {"reference": _reference, "torch": _torch, "triton": _triton}[name]()
