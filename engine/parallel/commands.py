"""What the driver sends its workers: one command per step for the forward pass, one for the
logits, and a generic call whose replies come back from every worker."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class WorkerInit:
    rank: int
    config: Any  # EngineConfig
    hf_config: dict
    store_port: int  # the group's rendezvous (a TCPStore on 127.0.0.1, hosted by the driver)
    num_blocks: int  # the driver decides; every rank's KV shard has as many blocks
    num_threads: int | None  # torch threads of a CPU rank


@dataclass(frozen=True)
class Forward:
    """One forward pass over the step's flattened batch (the AttentionMetadata as host arrays)."""
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    decode_only: bool


@dataclass(frozen=True)
class ComputeLogits:
    """The driver broadcasts [rows, hidden] next; each rank computes its vocabulary shard."""
    rows: int


@dataclass(frozen=True)
class Call:
    """worker.<method>(*args) on every worker; each replies ("ok", result) or ("error", message)."""
    method: str
    args: tuple


@dataclass(frozen=True)
class Shutdown:
    pass
