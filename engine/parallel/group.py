"""A rank's view of the tensor-parallel process group: its layout and the device collectives."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from engine.parallel.layout import TPLayout

# A rank that dies mid-collective closes its gloo sockets and its peers fail at once; this bounds
# the wait on NCCL, where a dead peer is only noticed by the timeout.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r of a CUDA engine runs on cuda:(base + r); every CPU rank on the CPU."""
    if base.type != "cuda":
        return base
    index = (base.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"tensor parallelism from {base} needs cuda:{index} for rank {rank}, but only "
                         f"{torch.cuda.device_count()} CUDA device(s) are visible")
    return torch.device("cuda", index)


def make_store(rank: int, size: int, port: int = 0) -> dist.TCPStore:
    """The group's rendezvous: rank 0 hosts it (port 0: any free port, read back from .port)."""
    return dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)


def make_device_group(rank: int, size: int, store: dist.TCPStore, device: torch.device):
    """The ranks' collectives backend (joining blocks until every rank has): NCCL on CUDA, gloo on
    the CPU over the loopback interface (every rank is on this machine, and gloo's default device,
    the address the hostname resolves to, may not exist inside a container)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = COLLECTIVE_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, size, options)


class TPGroup:
    """The device group of one engine's ranks: nccl on CUDA, gloo on CPU. A process group of its
    own rather than torch.distributed's default one, so that one process can hold several engines
    (LLM objects, tests); joining blocks until every rank has."""

    def __init__(self, layout: TPLayout, store: dist.TCPStore, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.store = store
        self.pg = make_device_group(layout.rank, layout.size, store, device)

    @property
    def rank(self) -> int:
        return self.layout.rank

    def with_layout(self, layout: TPLayout) -> "TPGroup":
        """The same ranks and process group, splitting another model (a speculative draft)."""
        view = object.__new__(TPGroup)
        view.layout, view.device, view.store, view.pg = layout, self.device, self.store, self.pg
        return view

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x, in place (a row-parallel layer's partial products)."""
        self.pg.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.pg.broadcast([x], options).wait()
        return x

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """Each rank's [rows, vocab_per_rank] shard -> the full [rows, vocab] on rank 0."""
        local = local.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank != 0:
            self.pg.gather([], [local], options).wait()
            return None
        parts = [torch.empty_like(local) for _ in range(self.layout.size)]
        self.pg.gather([parts], [local], options).wait()
        return torch.cat(parts, dim=-1)[:, :self.layout.vocab_size]

    def close(self) -> None:
        self.pg = None
