"""The Triton backend offers every reference kernel, with the same signature, and is selectable."""
from __future__ import annotations

import dataclasses
import inspect

from kernels import get_backend, reference
from kernels.backend import BACKEND_ENV, KernelBackend


def test_every_kernel_has_its_reference_signature(triton_kernels):
    assert isinstance(triton_kernels, KernelBackend) and triton_kernels.name == "triton"
    for field in dataclasses.fields(KernelBackend):
        if field.name == "name":
            continue
        fast = getattr(triton_kernels, field.name)
        assert fast.__module__.startswith("kernels.triton_"), f"{field.name} falls back to {fast.__module__}"
        assert inspect.signature(fast) == inspect.signature(getattr(reference, field.name)), field.name


def test_triton_is_chosen_for_cuda_by_name_and_by_environment(triton_kernels, monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert get_backend("auto", "cuda").name == "triton"  # a device name; no GPU is needed here
    assert get_backend("triton").name == "triton"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert get_backend("auto", "cpu").name == "triton"
