"""Sizing the KV cache to the GPU (vLLM's --gpu-memory-utilization): the engine takes that
fraction of the device's memory, and what its weights, workspaces and the peak of a profiled
step (the most prompt tokens a step may run, and a full batch's sampling) do not use is KV
cache. The readings go through a small probe so the arithmetic and the profiled step run (and
are tested) on any device; only CUDA has a real one."""
from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1 << 30


class CudaMemory:
    """The device's memory as the CUDA caching allocator and the driver see it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def free_total(self) -> tuple[int, int]:
        torch.cuda.synchronize(self.device)
        return torch.cuda.mem_get_info(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_over_current(self) -> int:
        """How far the allocations since reset_peak went above what is allocated now."""
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)

    def release(self) -> None:
        """Cached blocks back to the driver, so free_total reads what is really in use."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


def device_memory(device: torch.device):
    if device.type != "cuda":
        raise ValueError(f"--gpu-memory-utilization sizes the KV cache to a CUDA device's memory; on {device} "
                         "give --kv-cache-memory-gb or --num-blocks")
    return CudaMemory(device)


@dataclass(frozen=True)
class MemoryBudget:
    """The readings the KV cache is sized from (bytes)."""
    total: int  # the device's memory
    free_at_start: int  # free before the weights were loaded
    free_after: int  # free after loading and the profiled step, its transient KV released
    peak_over_after: int  # how far the profiled step's allocations went above what stays
    utilization: float  # the fraction of `total` this engine may use

    @property
    def requested(self) -> int:
        return int(self.total * self.utilization)

    @property
    def non_kv(self) -> int:
        """Weights, workspaces, the allocator's own, and the step's transient peak."""
        return max(0, self.free_at_start - self.free_after) + max(0, self.peak_over_after)

    def kv_bytes(self) -> int:
        """vLLM's rule: the requested share less what is not KV cache (memory other processes
        hold is not counted, only checked at the start: check_start)."""
        return self.requested - self.non_kv

    def describe(self) -> str:
        return (f"{self.utilization:.2f} of {self.total / GIB:.1f} GiB = {self.requested / GIB:.2f} GiB: "
                f"weights and workspaces {(self.free_at_start - self.free_after) / GIB:.2f} GiB, "
                f"a step's peak {self.peak_over_after / GIB:.2f} GiB, KV cache {self.kv_bytes() / GIB:.2f} GiB")


def check_start(free: int, total: int, utilization: float) -> None:
    """Before loading: the share asked for must be free (vLLM's check: another process on the
    device would leave the engine short at its first long batch instead of at start)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    if free < int(total * utilization):
        raise ValueError(f"--gpu-memory-utilization {utilization} asks for {total * utilization / GIB:.2f} GiB of "
                         f"the device's {total / GIB:.2f} GiB, but only {free / GIB:.2f} GiB are free (another "
                         "process holds the rest): lower it, or free the device")


def default_size_warning(device: torch.device, cache, num_blocks: int, block_size: int) -> str | None:
    """The words for a GPU engine whose KV cache fell to the 1 GiB default (nothing sized it):
    a GPU's capacity in sequences is its cache, and vLLM would have taken 90% of the device."""
    if device.type != "cuda" or cache.num_blocks is not None or cache.kv_cache_memory_bytes is not None \
            or cache.gpu_memory_utilization is not None:
        return None
    return (f"the KV cache is the 1 GiB default ({num_blocks} blocks, {num_blocks * block_size} tokens) on a GPU: "
            "give --gpu-memory-utilization (vLLM's default is 0.9) or --kv-cache-memory-gb")


def module_bytes(module: torch.nn.Module) -> int:
    """The bytes a model's tensors hold: parameters, buffers and the plain tensors some modules
    keep (a kept quantized weight's, kernels.quant_linear), a tied or shared one counted once."""
    seen: dict[tuple[int, int], int] = {}
    for m in module.modules():
        plain = (v for v in vars(m).values() if isinstance(v, torch.Tensor))
        for t in (*m._parameters.values(), *m._buffers.values(), *plain):
            if t is not None and t.device.type != "meta" and t.numel():  # oneDNN-packed weights have no data_ptr
                seen[(id(t), 0) if t.is_mkldnn else (t.data_ptr(), t.numel())] = t.numel() * t.element_size()
    return sum(seen.values())
