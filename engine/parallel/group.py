"""A rank's view of the tensor-parallel process group: its layout and the device collectives."""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from engine.parallel.layout import TPLayout

# A rank that dies mid-collective closes its gloo sockets and its peers fail at once; this bounds
# the wait on NCCL, where a dead peer is only noticed by the timeout.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r of a CUDA engine runs on cuda:(base + r); every CPU rank on the CPU."""
    if base.type != "cuda":
        return base
    index = (base.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"tensor parallelism from {base} needs cuda:{index} for rank {rank}, but only "
                         f"{torch.cuda.device_count()} CUDA device(s) are visible")
    return torch.device("cuda", index)


class TPGroup:
    """Joins the group on construction (blocks until every rank has): nccl on CUDA, gloo on CPU."""

    def __init__(self, layout: TPLayout, init_method: str, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                                rank=layout.rank, world_size=layout.size, timeout=COLLECTIVE_TIMEOUT)
        self.group = dist.group.WORLD

    @property
    def rank(self) -> int:
        return self.layout.rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x, in place (a row-parallel layer's partial products)."""
        dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x."""
        dist.broadcast(x, src=0, group=self.group)
        return x

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """Each rank's [rows, vocab_per_rank] shard -> the full [rows, vocab] on rank 0."""
        local = local.contiguous()
        if self.rank != 0:
            dist.gather(local, None, dst=0, group=self.group)
            return None
        parts = [torch.empty_like(local) for _ in range(self.layout.size)]
        dist.gather(local, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[:, :self.layout.vocab_size]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
