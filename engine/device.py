"""`--device auto|cpu|cuda|cuda:N` -> a torch device (auto: the first visible GPU, else the CPU); host lists onto it."""
from __future__ import annotations

import re

import torch

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def resolve_device(spec: str) -> torch.device:
    if not DEVICE_PATTERN.match(spec):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {spec!r}")
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} asked for, but torch sees no CUDA device "
                             f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
        device = torch.device("cuda", index)
    return device


def on_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list on the device without waiting for the device: on CUDA through pinned
    memory and a non-blocking copy (a pageable copy would wait for every step queued before it)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
