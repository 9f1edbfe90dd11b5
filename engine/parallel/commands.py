"""What the driver sends its workers: one command per step for the forward pass, one for the
logits, and a generic call whose replies come back from every worker."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class WorkerInit:
    rank: int
    config: Any  # EngineConfig
    hf_config: dict
    store_port: int  # the group's rendezvous (a TCPStore on 127.0.0.1, hosted by the driver)
    num_blocks: int  # the driver decides; every rank's KV shard has as many blocks
    num_threads: int | None  # torch threads of a CPU rank
    # Builds the rank's KV connector worker side (engine.kv_connector.KVConnectorFactory), or None.
    kv_connector_factory: Any = None


@dataclass(frozen=True)
class Forward:
    """One forward pass over the step's flattened batch: the input ids, positions and the
    AttentionMetadata's tensors packed into one int64 vector. On the CPU it travels in the command;
    on CUDA it follows the command as a broadcast on the device group (packed = None), so the
    driver never waits for the device to read its inputs back (async scheduling's ids are there)."""
    num_tokens: int
    num_seqs: int
    table_width: int
    decode_only: bool
    packed: np.ndarray | None
    # LoRA: the step's rows by adapter, as rank 0 set them (LoRAManager.set_batch's arguments:
    # each request's adapter name or None, its tokens, the rows); None: as the last step's.
    lora: tuple | None = None
    draft: bool = False  # the speculative draft's shard over its cache, not the target's

    @classmethod
    def pack(cls, input_ids: torch.Tensor, positions: torch.Tensor, meta, on_host: bool, lora: tuple | None = None,
             draft: bool = False):
        """-> (the command, the packed vector on the inputs' device)."""
        parts = (input_ids, positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                 meta.block_tables.reshape(-1))
        packed = torch.cat([p.to(torch.int64) for p in parts])
        b, w = meta.block_tables.shape
        return cls(input_ids.shape[0], b, w, meta.decode_only, packed.numpy() if on_host else None, lora,
                   draft), packed

    @property
    def size(self) -> int:
        return 3 * self.num_tokens + 2 * self.num_seqs + 1 + self.num_seqs * self.table_width

    def unpack(self, packed: torch.Tensor):
        """-> (input_ids, positions, AttentionMetadata) on the packed vector's device."""
        from engine.models.llama import AttentionMetadata

        t, b, w = self.num_tokens, self.num_seqs, self.table_width
        ids, pos, slots, qsl, seq_lens, table = packed.split([t, t, t, b + 1, b, b * w])
        meta = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl.to(torch.int32),
                                 seq_lens=seq_lens.to(torch.int32), block_tables=table.view(b, w).to(torch.int32),
                                 decode_only=self.decode_only)
        return ids, pos, meta


@dataclass(frozen=True)
class ComputeLogits:
    """The driver broadcasts [rows, hidden] next; each rank computes its vocabulary shard."""
    rows: int
    draft: bool = False  # the speculative draft's LM head


@dataclass(frozen=True)
class Call:
    """worker.<method>(*args) on every worker; each replies ("ok", result) or ("error", message)."""
    method: str
    args: tuple


@dataclass(frozen=True)
class Shutdown:
    pass
