"""Shared fixtures: tiny random checkpoints made offline with transformers (no network)."""
from __future__ import annotations

import os

# Triton's interpreter runs kernels on CPU tensors; it must be chosen before triton is imported.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import pytest

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Cached per session: make(arch, **kwargs) -> checkpoint directory."""
    from engine.tiny import make_tiny_model

    made: dict = {}

    def make(arch: str = "llama", **kwargs) -> str:
        key = (arch, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])).__repr__())
        if key not in made:
            path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            made[key] = make_tiny_model(path, arch=arch, **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")
