"""Flattened varlen batch -> tensors (ids, positions, slot mapping, block tables) -> model -> sampler;
the KV connector's worker side runs here too (loads started before the forward pass)."""
from __future__ import annotations

import logging

import numpy as np
import torch

from engine.config import EngineConfig
from engine.device import resolve_device
from engine.kv_connector import KVCacheSpec, KVConnectorWorker
from engine.models import load_model
from engine.models.llama import AttentionMetadata
from engine.models.loader import resolve_dtype
from engine.sampler import Sampler
from engine.scheduler import ModelOutput, SchedulerOutput
from kernels import get_backend

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config: dict, max_model_len: int,
                 show_progress: bool = False, connector: KVConnectorWorker | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.parallel.device)
        self.kernels = get_backend(config.kernel_backend, self.device)
        self.dtype = resolve_dtype(config.model.dtype, hf_config)
        torch.manual_seed(config.model.seed)
        self.model = load_model(config.model.path, hf_config, self.kernels, self.dtype,
                                self.device, show_progress)
        arch = self.model.arch
        self.block_size = config.cache.block_size
        self.num_blocks = config.cache.num_blocks or max(
            1, config.cache.kv_cache_memory_bytes // self.bytes_per_block(arch))
        self.kv_cache_spec = KVCacheSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim,
                                         self.block_size, self.dtype, self.device)
        self.connector = connector
        if connector is not None:  # e.g. shared memory, registered with the transport
            self.kv_caches = connector.allocate_kv_caches(self.kv_cache_spec, self.num_blocks)
        else:
            # Zero-initialised: attention reads padding slots (masked); 0 * NaN would poison them.
            self.kv_caches = [
                torch.zeros((2, self.num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim),
                            dtype=self.dtype, device=self.device)
                for _ in range(arch.num_layers)]
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        sc = config.scheduler
        self._input_ids = np.zeros(sc.max_num_batched_tokens, dtype=np.int64)
        self._positions = np.zeros(sc.max_num_batched_tokens, dtype=np.int64)
        self._block_table = np.zeros((sc.max_num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self._arange = np.arange(max(sc.max_num_batched_tokens, sc.max_num_seqs) + 1, dtype=np.int64)
        self.sampler = Sampler(config.model.seed, self.device)
        # request id -> its block ids, grown from each SchedulerOutput's new_block_ids.
        self.block_ids: dict[str, list[int]] = {}

    def bytes_per_block(self, arch=None) -> int:
        arch = arch or self.model.arch
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * arch.num_kv_heads * arch.head_dim * elem * arch.num_layers

    def prepare(self, so: SchedulerOutput):
        reqs, ns = so.scheduled, so.num_scheduled_tokens
        b = len(reqs)
        num_tokens = np.fromiter(ns, dtype=np.int64, count=b)
        starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=b)
        t = int(num_tokens.sum())
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(num_tokens, out=qsl[1:])
        if t == b:
            self._input_ids[:t] = [r.all_token_ids[r.num_computed_tokens] for r in reqs]
        else:
            ids = []
            for r, n in zip(reqs, ns):
                ids.extend(r.all_token_ids[r.num_computed_tokens:r.num_computed_tokens + n])
            self._input_ids[:t] = ids
        positions = self._positions[:t]
        np.subtract(self._arange[:t], np.repeat(qsl[:-1] - starts, num_tokens), out=positions)
        seq_lens = starts + num_tokens
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        table = self._block_table[:b, :max_blocks]
        for i, r in enumerate(reqs):
            block_ids = self.block_ids[r.request_id]
            table[i, :len(block_ids)] = block_ids[:max_blocks]
        rows = np.repeat(self._arange[:b], num_tokens)
        slot_mapping = table[rows, positions // self.block_size].astype(np.int64) * self.block_size \
            + positions % self.block_size
        total = np.fromiter((r.num_tokens for r in reqs), dtype=np.int64, count=b)
        sample_rows = np.nonzero(seq_lens == total)[0]
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(self.device),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(self.device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(self.device),
            block_tables=torch.from_numpy(table.copy()).to(self.device),
            decode_only=t == b)
        input_ids = torch.from_numpy(self._input_ids[:t].copy()).to(self.device)
        pos = torch.from_numpy(positions.copy()).to(self.device)
        logits_indices = torch.from_numpy(qsl[1:][sample_rows] - 1).to(self.device)
        return input_ids, pos, meta, logits_indices, sample_rows

    def _update_block_tables(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.sampler.forget(rid)
            self.block_ids.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.block_ids.pop(rid, None)
        for r, new_ids in zip(so.scheduled, so.new_block_ids):
            if new_ids:
                self.block_ids.setdefault(r.request_id, []).extend(new_ids)

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        self._update_block_tables(so)
        if self.connector is None:
            return self._execute_model(so)
        if so.kv_connector_metadata:
            self.connector.start_load_kv(so.kv_connector_metadata)
        output = self._execute_model(so)
        output.kv_connector_output = self.connector.get_finished()
        return output

    @torch.inference_mode()
    def _execute_model(self, so: SchedulerOutput) -> ModelOutput:
        if not so.scheduled:
            return ModelOutput(sampled_token_ids=[])
        input_ids, positions, meta, logits_indices, sample_rows = self.prepare(so)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        prompt_logprobs = self._prompt_logprobs(so, hidden, meta) if any(
            r.prompt_logprobs is not None for r in so.scheduled) else None
        if len(sample_rows) == 0:
            return ModelOutput(sampled_token_ids=[], prompt_logprobs=prompt_logprobs)
        logits = self.model.compute_logits(hidden[logits_indices])
        reqs = [so.scheduled[i] for i in sample_rows.tolist()]
        tokens, logprobs = self.sampler(logits, reqs)
        return ModelOutput(sampled_token_ids=tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _prompt_logprobs(self, so: SchedulerOutput, hidden: torch.Tensor, meta) -> dict[str, list]:
        """Logprob of each prompt token given the ones before it, for the rows that ask."""
        result: dict[str, list] = {}
        qsl = meta.query_start_loc.tolist()
        for i, (r, n) in enumerate(zip(so.scheduled, so.num_scheduled_tokens)):
            if r.prompt_logprobs is None:
                continue
            start = r.num_computed_tokens
            # Position p predicts token p + 1; only predictions of prompt tokens count.
            end = min(start + n, r.num_prompt_tokens - 1)
            if end <= start:
                continue
            rows = hidden[qsl[i]:qsl[i] + (end - start)]
            logprobs = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
            targets = torch.tensor(r.all_token_ids[start + 1:end + 1], device=logprobs.device)
            chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
            k = r.sampling_params.prompt_logprobs
            if k > 0:
                vals, ids = logprobs.topk(k, dim=-1)
                tops = [list(zip(a, b)) for a, b in zip(ids.tolist(), vals.tolist())]
            else:
                tops = [[] for _ in chosen]
            result[r.request_id] = list(zip(chosen, tops))
        return result
