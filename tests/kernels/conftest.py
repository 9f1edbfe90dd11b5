"""Kernel-test fixtures: Triton's CPU interpreter where there is no GPU, and a fresh seed per test."""
from __future__ import annotations

import os

import torch

# Must happen before triton is imported (tests/conftest.py does the same; this keeps the
# kernel tests runnable on their own).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

SEED_ENV = "PDSERVE_TEST_SEED"


@pytest.fixture(autouse=True)
def seed() -> int:
    """Fresh random inputs every run; a failure prints the seed, PDSERVE_TEST_SEED replays it."""
    value = int(os.environ.get(SEED_ENV) or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(value)
    print(f"{SEED_ENV}={value}")
    return value


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the Triton kernels run: the GPU when there is one, else the interpreter on CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def triton_kernels():
    pytest.importorskip("triton")
    from kernels import triton_backend

    return triton_backend.backend()
