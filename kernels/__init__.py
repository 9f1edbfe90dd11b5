"""Attention and KV-block kernels behind one small interface (see kernels.backend)."""
from kernels.backend import KernelBackend, get_backend

__all__ = ["KernelBackend", "get_backend"]
