"""Decode-only steps through persistent input buffers padded to a set of batch sizes; on CUDA one
graph per size, captured at start-up and replayed (as vLLM's CUDA graph runner).

A padded row is harmless: its slot is -1 (every store_kv skips it), its context is one token of
block 0 (read, never written), and its output row is dropped. On the CPU the same buffers and
padding run eagerly, so the CPU suite checks the padding the graphs rely on.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from engine.models.llama import AttentionMetadata

logger = logging.getLogger(__name__)

PAD_SLOT = -1


@dataclass
class DecodeInputs:
    """One decode batch's inputs, max_batch rows; the model reads their leading rows."""
    input_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    slot_mapping: torch.Tensor  # [max_batch] int64
    seq_lens: torch.Tensor  # [max_batch] int32
    block_tables: torch.Tensor  # [max_batch, max_blocks_per_seq] int32
    prev_rows: torch.Tensor  # [max_batch] int64: row of the previous step's sampled ids (async scheduling)

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device, pin: bool = False) -> "DecodeInputs":
        def buf(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

        return cls(buf(max_batch, dtype=torch.int64), buf(max_batch, dtype=torch.int64),
                   buf(max_batch, dtype=torch.int64), buf(max_batch, dtype=torch.int32),
                   buf(max_batch, max_blocks, dtype=torch.int32), buf(max_batch, dtype=torch.int64))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables, self.prev_rows)

    def copy_rows_(self, src: "DecodeInputs", rows: int, width: int) -> None:
        """The leading rows of src into self (host to device: asynchronous from pinned memory)."""
        for dst, s in zip(self.tensors(), src.tensors()):
            if dst.dim() == 2:
                dst[:rows, :width].copy_(s[:rows, :width], non_blocking=True)
            else:
                dst[:rows].copy_(s[:rows], non_blocking=True)


class DecodeGraphs:
    """Pads decode-only batches to the next of `sizes` (none: no padding); replays a CUDA graph per
    size on CUDA. A batch above every size runs eagerly at its own size through the same buffers."""

    def __init__(self, model: torch.nn.Module, kv_caches: Sequence[torch.Tensor], max_batch: int,
                 sizes: Sequence[int], max_blocks_per_seq: int, block_size: int, device: torch.device,
                 use_graphs: bool) -> None:
        self.model, self.kv_caches = model, list(kv_caches)
        self.sizes = sorted(sizes)
        self.max_batch = max(max_batch, *self.sizes) if self.sizes else max_batch
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.device = device
        self.on_cuda = device.type == "cuda"
        # Two host slots on CUDA: step n+1 is staged while step n's copies may still be queued.
        self.host = [DecodeInputs.allocate(self.max_batch, max_blocks_per_seq, torch.device("cpu"), pin=self.on_cuda)
                     for _ in range(2 if self.on_cuda else 1)]
        self.inputs = (DecodeInputs.allocate(self.max_batch, max_blocks_per_seq, device) if self.on_cuda
                       else self.host[0])
        self._np = [tuple(t.numpy() for t in h.tensors()) for h in self.host]
        self._copied: list[torch.cuda.Event | None] = [None] * len(self.host)
        self._slot = 0
        self.query_start_loc = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_steps = 0  # decode steps run through the padded buffers
        self.num_replays = 0  # of them, replayed from a CUDA graph
        if use_graphs:
            self.capture()

    def padded_size(self, num_reqs: int) -> int:
        """The batch size a decode step of num_reqs runs at."""
        assert num_reqs <= self.max_batch, f"{num_reqs} rows exceed the decode buffers' {self.max_batch}"
        return next((s for s in self.sizes if s >= num_reqs), num_reqs)

    def stage(self, num_reqs: int, padded: int, positions: np.ndarray, input_ids: np.ndarray | None,
              block_ids: Sequence[Sequence[int]], prev_rows: np.ndarray | None) -> int:
        """Write one step into the host buffers (padding rows included); returns the table width.
        input_ids None: the ids come from the previous step's sampled ids (prev_rows) on the device."""
        slot = self._slot
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()  # its previous copy is done before we overwrite it
        ids, pos, slots, seq_lens, table, rows = self._np[slot]
        b, bs = num_reqs, self.block_size
        pos[:b] = positions
        seq_lens[:b] = positions + 1
        if input_ids is not None:
            ids[:b] = input_ids
        if prev_rows is not None:
            rows[:b] = prev_rows
        width = self.max_blocks if self.graphs else max(1, int(-(-(int(positions.max()) + 1) // bs)))
        for i, blocks in enumerate(block_ids):
            n = min(len(blocks), width)
            table[i, :n] = blocks[:n]
        slots[:b] = table[np.arange(b), positions // bs].astype(np.int64) * bs + positions % bs
        # Padding rows: store nothing, attend to one token of block 0, embed token 0.
        ids[b:padded], pos[b:padded], rows[b:padded] = 0, 0, 0
        slots[b:padded], seq_lens[b:padded] = PAD_SLOT, 1
        table[b:padded, :width] = 0
        return width

    def run(self, num_reqs: int, padded: int, width: int, prev_sampled: torch.Tensor | None) -> torch.Tensor:
        """The model's hidden states [num_reqs, hidden] for the staged step."""
        slot = self._slot
        if self.on_cuda:
            self.inputs.copy_rows_(self.host[slot], padded, width)
            event = self._copied[slot] = torch.cuda.Event()
            event.record()
            self._slot = (slot + 1) % len(self.host)
        if prev_sampled is not None:
            rows = self.inputs.prev_rows[:num_reqs]
            self.inputs.input_ids[:num_reqs] = prev_sampled.index_select(0, rows)
        self.num_steps += 1
        graph = self.graphs.get(padded)
        if graph is not None:
            graph.replay()
            self.num_replays += 1
            return self.outputs[padded][:num_reqs]
        return self._forward(padded, width)[:num_reqs]

    def _forward(self, padded: int, width: int) -> torch.Tensor:
        x = self.inputs
        meta = AttentionMetadata(slot_mapping=x.slot_mapping[:padded], query_start_loc=self.query_start_loc[:padded + 1],
                                 seq_lens=x.seq_lens[:padded], block_tables=x.block_tables[:padded, :width],
                                 decode_only=True)
        return self.model(x.input_ids[:padded], x.positions[:padded], self.kv_caches, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per size, largest first, sharing one memory pool (a smaller graph's buffers fit
        in a larger one's); each size is warmed up first (Triton compiles, the allocator settles)."""
        x = self.inputs
        x.slot_mapping.fill_(PAD_SLOT)
        x.seq_lens.fill_(1)
        x.input_ids.zero_(), x.positions.zero_(), x.block_tables.zero_()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(size, self.max_blocks)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the KV transfer threads may use the device while a graph is captured.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs[size] = self._forward(size, self.max_blocks)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs for decode batch sizes %s", len(self.graphs), self.sizes)
