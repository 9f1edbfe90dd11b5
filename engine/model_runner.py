"""Flattened varlen batch -> tensors (ids, positions, slot mapping, block tables) -> model -> sampler;
the KV connector's worker side runs here too (loads started before the forward pass)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.device import resolve_device
from engine.kv_connector import KVCacheSpec, KVConnectorWorker, zeroed_kv_caches
from engine.memory import MemoryBudget, check_start, default_size_warning, device_memory
from engine.models import load_model
from engine.models.llama import AttentionMetadata, LlamaArch
from engine.models.loader import (check_keep_under_tp, check_quantization, has_kv_scales, resolve_dtype,
                                  resolve_kv_cache_dtype)
from engine.parallel import TPLayout
from engine.request import Request, SamplingParams
from engine.sampler import Sampler
from engine.structured_output.bitmask import GrammarBitmask
from engine.spec_decode.draft_model import DraftModel
from engine.spec_decode.grammar import mask_proposal_positions
from engine.spec_decode.rejection_sampler import RejectionSampler, VerifiedTokens
from engine.scheduler import ModelOutput, SchedulerOutput
from kernels import get_backend

logger = logging.getLogger(__name__)


@dataclass
class LaunchedStep:
    """A step whose device work is queued: its sampled ids come back through `host` once
    `copied` has fired (on CUDA); `sampled` stays on the device for the next step's inputs."""
    scheduler_output: SchedulerOutput
    requests: list[Request] = field(default_factory=list)  # the rows that sampled, in order
    sampled: torch.Tensor | None = None
    host: torch.Tensor | None = None
    copied: "torch.cuda.Event | None" = None
    logprobs: torch.Tensor | None = None
    prompt_logprobs: dict | None = None
    # Speculative decoding: the rows' proposals, and what verifying them produced (host copies).
    spec: list[list[int]] | None = None
    verified: VerifiedTokens | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config: dict, max_model_len: int,
                 show_progress: bool = False, connector: KVConnectorWorker | None = None,
                 kv_connector_factory=None) -> None:
        """connector: this engine's KV connector worker side; under tensor parallelism each worker
        rank builds its own with `kv_connector_factory` (the one `connector` came from)."""
        self.config = config
        self.max_model_len = max_model_len
        self.device = resolve_device(config.parallel.device)
        self.kernels = get_backend(config.kernel_backend, self.device)
        self.dtype = resolve_dtype(config.model.dtype, hf_config)
        self.kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        if (self.kv_dtype == torch.float8_e4m3fn and self.device.type == "cuda" and self.kernels.name == "triton"
                and torch.cuda.get_device_capability(self.device) < (8, 9)):
            raise ValueError("--kv-cache-dtype fp8_e4m3 needs compute capability 8.9 or later (Ada, Hopper) for the "
                             "Triton kernels' conversions; use --kv-cache-dtype fp8_e5m2 on this GPU")
        torch.manual_seed(config.model.seed)
        arch = LlamaArch.from_hf_config(hf_config)
        tp_size = config.parallel.tensor_parallel_size
        check_quantization(hf_config, config.model.quantization)  # before any worker starts
        check_keep_under_tp(config.model.path, hf_config, config.model.quantized_weights, tp_size)
        self.tp_layout = TPLayout.of(arch, tp_size, rank=0)  # checks the size against the heads
        # This rank's KV heads: the cache here is rank 0's shard (each rank allocates its own).
        self.num_kv_heads = self.tp_layout.local_kv_heads
        self.block_size = config.cache.block_size
        # A speculative draft model's layers are KV cache layers too: checked now, loaded after the
        # target, its cache sized with the target's (bytes_per_block) and allocated beside it.
        self.draft = DraftModel.of(config.speculative, arch, max_model_len, tp_size)
        if self.draft is not None and self.draft.unsplit is not None:
            logger.warning("the draft model cannot be split over %d ranks (%s): it runs whole on rank 0, and its "
                           "cache's share of every other rank's KV memory goes unused", tp_size, self.draft.unsplit)
        probe = None
        if config.cache.sized_by_profile:  # vLLM's --gpu-memory-utilization
            if tp_size > 1:
                raise ValueError("--gpu-memory-utilization does not size a tensor-parallel engine's KV cache yet: "
                                 "give --kv-cache-memory-gb (per GPU) or --num-blocks")
            probe = device_memory(self.device)
            free_at_start, total = probe.free_total()
            check_start(free_at_start, total, config.cache.gpu_memory_utilization)
            # Room for the profiled step only; the KV cache proper is sized after it.
            self.num_blocks = self._profile_blocks(config, max_model_len)
        else:
            # Memory per device, as vLLM: every rank's shard has this many blocks.
            self.num_blocks = config.cache.num_blocks or max(
                1, config.cache.fixed_kv_bytes // self.bytes_per_block(arch))
            warning = default_size_warning(self.device, config.cache, self.num_blocks, self.block_size)
            if warning:
                logger.warning(warning)
        self.tp = None
        self.lora = None
        if tp_size > 1:
            self.model = self._load_tensor_parallel(config, hf_config, show_progress,
                                                    kv_connector_factory if connector is not None else None)
        else:
            self.model = load_model(config.model.path, hf_config, self.kernels, self.dtype,
                                    self.device, show_progress, linear_backend=config.model.linear_backend,
                                    quantized_weights=config.model.quantized_weights, max_model_len=max_model_len)
        self._say_kv_scales(hf_config)
        if self.draft is not None:
            self.draft.load(self.kernels, self.dtype, self.device, config.model.linear_backend, driver=self.tp)
        if config.lora is not None:  # loaded before the KV cache is sized: their memory counts
            from engine.lora import LoRAManager

            if self.tp is None:
                self.lora = LoRAManager(config.lora, self.model, self.dtype, self.device)
            if self.device.type == "cuda" and config.lora.max_loras is None:
                logger.warning("LoRA without --max-loras: each adapter loaded at run time takes device memory the "
                               "KV cache was not sized around; --max-loras N reserves N adapter slots at start "
                               "and keeps the adapters beyond them in host memory (vLLM's default is 1)")
        self.kv_cache_spec = KVCacheSpec(arch.num_layers, self.num_kv_heads, arch.head_dim,
                                         self.block_size, self.kv_dtype, self.device, tp_size, 0, arch.num_kv_heads)
        if connector is not None and self.tp is not None:
            from engine.parallel.kv_connector import TPConnectorWorker

            connector = TPConnectorWorker(connector, self.tp)
        self.connector = connector
        # Through the connector (e.g. shared memory, registered with the transport), else the
        # engine's own; the profiled step's is the engine's own, released after it.
        self._allocate_kv_caches(through_connector=probe is None)
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        sc = config.scheduler
        self._input_ids = np.zeros(sc.max_num_batched_tokens, dtype=np.int64)
        self._positions = np.zeros(sc.max_num_batched_tokens, dtype=np.int64)
        self._block_table = np.zeros((sc.max_num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self._arange = np.arange(max(sc.max_num_batched_tokens, sc.max_num_seqs) + 1, dtype=np.int64)
        self.sampler = Sampler(config.model.seed, self.device)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.grammar_bitmask = GrammarBitmask(sc.max_num_seqs, arch.vocab_size, self.device)
        # request id -> its block ids, grown from each SchedulerOutput's new_block_ids.
        self.block_ids: dict[str, list[int]] = {}
        # Sampled ids come back through pinned memory, two slots (two steps may be in flight).
        on_cuda = self.device.type == "cuda"
        self._sampled_host = [torch.zeros(sc.max_num_seqs, dtype=torch.int64, pin_memory=on_cuda)
                              for _ in range(2)] if on_cuda else []
        self._sampled_slot = 0
        self.memory_budget = None
        if probe is not None:
            self.memory_budget = self._size_kv_cache(probe, free_at_start, total, max_model_len)
        self.decode_graphs, self.cuda_graphs_off_reason = self._decode_graphs(config)

    def _profile_prompts(self, config: EngineConfig, max_model_len: int) -> list[int]:
        """The profiled step's prompts' lengths: max_num_batched_tokens in all, the most a step
        runs (vLLM's rule), none longer than max_model_len, no more of them than max_num_seqs."""
        sc = config.scheduler
        n = min(sc.max_num_seqs, -(-sc.max_num_batched_tokens // max_model_len))
        total = min(sc.max_num_batched_tokens, n * max_model_len)
        return [total // n + (i < total % n) for i in range(n)]

    def _profile_blocks(self, config: EngineConfig, max_model_len: int) -> int:
        """Blocks for the profiled step's prompts."""
        return sum(-(-n // self.block_size) for n in self._profile_prompts(config, max_model_len)) + 1

    @torch.inference_mode()
    def _profile_step(self, max_model_len: int) -> None:
        """The step that needs the most memory besides the KV cache: prompts of
        max_num_batched_tokens tokens in all through the model (and through a speculative draft,
        whose catch-up forwards are as long at most), then a full batch (max_num_seqs rows) sampled
        with top-k, top-p and 20 logprobs each (the sampler's sort and softmax copies)."""
        sc = self.config.scheduler
        lengths = self._profile_prompts(self.config, max_model_len)
        vocab = self.model.arch.vocab_size
        # Fixed ids and a local generator: the global RNG (seeded by --seed) is left as it was.
        params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, top_k=50, logprobs=20)
        prompts, blocks, at = [], [], 0
        for i, n in enumerate(lengths):
            prompts.append(Request(f"pdserve-profile-prompt-{i}", [(j * 7919 + 11) % vocab for j in range(n)], params))
            used = -(-n // self.block_size)
            blocks.append(list(range(at, at + used)))
            at += used
        so = SchedulerOutput(scheduled=prompts, num_scheduled_tokens=lengths, new_block_ids=blocks)
        connector, self.connector = self.connector, None  # nothing of this step is the connector's
        try:
            self.execute(so)
            if self.draft is not None:  # a speculative draft's catch-up: as many tokens at most, one forward
                hidden = self.draft.forward([p.all_token_ids for p in prompts], [np.arange(n) for n in lengths],
                                            blocks, decode_only=False)
                self.draft.model.compute_logits(hidden[torch.from_numpy(np.cumsum(lengths) - 1).to(self.device)])
            rows = [Request(f"pdserve-profile-{i}", [0], params) for i in range(sc.max_num_seqs)]
            g = torch.Generator(device=self.device).manual_seed(0)
            logits = torch.randn(len(rows), vocab, device=self.device, dtype=torch.float32, generator=g)
            self.sampler.select(logits, rows)
        finally:
            self.connector = connector
            for prompt in prompts:
                self.block_ids.pop(prompt.request_id, None)
                self.sampler.forget(prompt.request_id)

    def _size_kv_cache(self, probe, free_at_start: int, total: int, max_model_len: int) -> MemoryBudget:
        """After the weights: the profiled step, then the KV cache is what the share asked for
        leaves (vLLM's rule), allocated (and registered with the KV connector) now."""
        probe.reset_peak()
        self._profile_step(max_model_len)
        peak = probe.peak_over_current()
        self.kv_caches = []
        if self.draft is not None:
            self.draft.kv_caches = []
        probe.release()
        free_after, _ = probe.free_total()
        budget = MemoryBudget(total, free_at_start, free_after, peak, self.config.cache.gpu_memory_utilization)
        per_block = self.bytes_per_block()
        if budget.kv_bytes() < per_block:
            raise ValueError(f"no room for a KV cache: {budget.describe()}; raise --gpu-memory-utilization, "
                             "lower --max-num-batched-tokens or --max-num-seqs, or use a smaller model")
        self.num_blocks = budget.kv_bytes() // per_block
        logger.info("KV cache sized by --gpu-memory-utilization: %s: %d blocks of %d tokens",
                    budget.describe(), self.num_blocks, self.block_size)
        self._allocate_kv_caches(through_connector=True)
        return budget

    def _allocate_kv_caches(self, through_connector: bool) -> None:
        """num_blocks blocks of KV cache per layer (the connector's where it has one and
        through_connector), and the draft's beside them."""
        if through_connector and self.connector is not None:
            self.kv_caches = self.connector.allocate_kv_caches(self.kv_cache_spec, self.num_blocks)
        else:
            self.kv_caches = zeroed_kv_caches(self.kv_cache_spec, self.num_blocks)
        if self.draft is not None:
            self.draft.allocate(self.num_blocks, self.block_size, self.kv_dtype, self.device)

    def _load_tensor_parallel(self, config: EngineConfig, hf_config: dict, show_progress: bool,
                              kv_connector_factory):
        """Workers for ranks 1..N-1 (each loads its own shard meanwhile), rank 0's shard here."""
        from engine.parallel.driver import TensorParallelModel, TPDriver

        self.tp = TPDriver(config, hf_config, self.tp_layout, self.device, self.num_blocks, kv_connector_factory)
        try:
            local = load_model(config.model.path, hf_config, self.kernels, self.dtype, self.device,
                               show_progress, tp=self.tp.group, linear_backend=config.model.linear_backend,
                               quantized_weights=config.model.quantized_weights, max_model_len=self.max_model_len)
            model = TensorParallelModel(local, self.tp)
            if config.lora is not None:  # rank 0's shard of each adapter, before the workers' say they are
                # ready: an adapter that cannot be served is refused here as at TP=1 (a ValueError)
                from engine.lora import LoRAManager
                from engine.parallel.lora import TPLoRAManager

                self.lora = TPLoRAManager(LoRAManager(config.lora, local, self.dtype, self.device, self.tp_layout),
                                          model)
            self.tp.wait_ready()
        except BaseException:
            self.tp.shutdown()
            raise
        return model

    def check_alive(self) -> None:
        """Raises if a tensor-parallel worker has exited (a step would fail on it)."""
        if self.tp is not None:
            self.tp.check_alive()

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers (joined, none left behind)."""
        if self.tp is not None:
            self.tp.shutdown()

    def _decode_graphs(self, config: EngineConfig) -> tuple[DecodeGraphs, str | None]:
        """The decode buffers: padded, with CUDA graphs where they can be captured (else why not).
        Unpadded (at the step's own batch size) with enforce_eager, and where no graph can be
        captured unless capture sizes were given."""
        sc = config.scheduler
        reason = None
        per_tensor = any(getattr(m, "activations", None) == "tensor"  # (tensor parallelism: rank 0's shard)
                         for m in getattr(self.model, "local", self.model).modules())
        if config.model.enforce_eager:
            reason = "enforce_eager"
        elif config.parallel.tensor_parallel_size > 1:
            reason = "tensor parallelism"  # a graph would capture rank 0's launches only
        elif config.lora is not None:
            reason = "LoRA adapters"  # each step groups its rows by adapter: no fixed launches to capture
        elif per_tensor:
            reason = "per-tensor dynamic 8-bit activation scales"  # a padded row would move the step's scale
        elif self.device.type != "cuda":
            reason = "no CUDA device"
        elif self.kernels.name != "triton":
            reason = f"the {self.kernels.name} kernels read sequence lengths on the host"
        # Padding buys a graph per size; without graphs it is only extra rows of work, so the CPU
        # pads only to sizes it was given explicitly (which rehearses the GPU path exactly).
        pad = not config.model.enforce_eager and not per_tensor and (reason is None or sc.cuda_graph_sizes is not None)
        sizes = sc.decode_batch_sizes if pad else ()
        graphs = DecodeGraphs(self.model, self.kv_caches, sc.max_num_seqs, sizes, self.max_blocks_per_seq,
                              self.block_size, self.device, use_graphs=reason is None)
        return graphs, reason

    def _say_kv_scales(self, hf_config: dict) -> None:
        """Whether the checkpoint's calibrated KV cache scales are used (an fp8 cache) or not."""
        fp8 = self.kv_dtype.itemsize == 1
        if has_kv_scales(getattr(self.model, "local", self.model)):  # (tensor parallelism: rank 0's shard)
            if fp8:
                logger.info("KV cache scales from the checkpoint: the fp8 cache holds K / k_scale and V / v_scale")
            else:
                logger.info("the checkpoint's KV cache scales are not used: the cache is %s "
                            "(--kv-cache-dtype fp8 uses them)", str(self.kv_dtype).removeprefix("torch."))
        elif fp8 and (hf_config.get("quantization_config") or {}).get("kv_cache_scheme"):
            logger.warning("the checkpoint's kv_cache_scheme names KV cache scales, but none were found in its "
                           "weights: the fp8 cache stores K and V at scale 1")

    def bytes_per_block(self, arch=None) -> int:
        """Of this rank's KV shard, and of a draft model's cache (its shard on each rank; whole on
        rank 0 where the tensor-parallel size cannot split it)."""
        arch = arch or self.model.arch
        elem = self.kv_dtype.itemsize
        draft = self.draft.bytes_per_block(self.block_size, self.kv_dtype) if self.draft is not None else 0
        return 2 * self.block_size * self.num_kv_heads * arch.head_dim * elem * arch.num_layers + draft

    def prepare(self, so: SchedulerOutput):
        reqs, ns = so.scheduled, so.num_scheduled_tokens
        b = len(reqs)
        num_tokens = np.fromiter(ns, dtype=np.int64, count=b)
        starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=b)
        t = int(num_tokens.sum())
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(num_tokens, out=qsl[1:])
        spec = so.spec_token_ids
        if t == b:
            self._input_ids[:t] = [r.all_token_ids[r.num_computed_tokens] for r in reqs]
        else:
            ids = []
            for r, n in zip(reqs, ns):
                chunk = r.all_token_ids[r.num_computed_tokens:r.num_computed_tokens + n]
                ids.extend(chunk)
                if len(chunk) < n:  # the proposals it verifies follow its known tokens
                    ids.extend(spec[r.request_id])
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
        total = np.fromiter((r.num_tokens + len(spec.get(r.request_id, ())) for r in reqs), dtype=np.int64, count=b)
        sample_rows = np.nonzero(seq_lens == total)[0]
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(self.device),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(self.device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(self.device),
            block_tables=torch.from_numpy(table.copy()).to(self.device),
            decode_only=t == b)
        input_ids = torch.from_numpy(self._input_ids[:t].copy()).to(self.device)
        pos = torch.from_numpy(positions.copy()).to(self.device)
        if spec:  # a verifying row is scored at every position: its own token's and each proposal's
            ends = qsl[1:][sample_rows]
            lens = np.fromiter((len(spec.get(reqs[i].request_id, ())) + 1 for i in sample_rows.tolist()),
                               dtype=np.int64, count=len(sample_rows))
            logits_indices = torch.from_numpy(np.repeat(ends - lens, lens) + self._arange[:int(lens.sum())]
                                              - np.repeat(np.cumsum(lens) - lens, lens)).to(self.device)
        else:
            logits_indices = torch.from_numpy(qsl[1:][sample_rows] - 1).to(self.device)
        return input_ids, pos, meta, logits_indices, sample_rows

    def _update_block_tables(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.sampler.forget(rid)
            self.block_ids.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.block_ids.pop(rid, None)
        for rid, kept in so.num_kept_blocks.items():  # rejected proposals' blocks released
            if rid in self.block_ids:
                del self.block_ids[rid][kept:]
        for r, new_ids in zip(so.scheduled, so.new_block_ids):
            if new_ids:
                self.block_ids.setdefault(r.request_id, []).extend(new_ids)

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        return self.collect(self.launch(so))

    def launch(self, so: SchedulerOutput, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's device work without waiting for it. With `prev`, every scheduled row
        continues a row that sampled in prev, one position further: its input id is prev's
        sampled id, read on the device (the CPU has not seen it yet)."""
        self._update_block_tables(so)
        if self.connector is not None and so.kv_connector_metadata:
            self.connector.start_load_kv(so.kv_connector_metadata)
        return self._launch_model(so, prev)

    def collect(self, step: LaunchedStep) -> ModelOutput:
        """Wait for a launched step's sampled ids and hand them to the scheduler's shape."""
        if step.copied is not None:
            step.copied.synchronize()
        if step.verified is not None:
            return self._collect_verified(step)
        tokens = [] if step.sampled is None else (step.host if step.host is not None else step.sampled).tolist()
        logprobs = None
        if step.logprobs is not None:
            logprobs = self.sampler.logprob_entries(step.logprobs, tokens, step.requests)
        output = ModelOutput(sampled_token_ids=tokens, logprobs=logprobs, prompt_logprobs=step.prompt_logprobs)
        if self.connector is not None:
            output.kv_connector_output = self.connector.get_finished()
        return output

    @property
    def stats(self) -> dict:
        g = self.decode_graphs
        stats = {"decode_buffer_steps": g.num_steps, "cuda_graph_replays": g.num_replays,
                 "cuda_graphs_captured": len(g.graphs)}
        if self.lora is not None:
            stats.update(lora_adapters_on_device=len(self.lora.slots), lora_swaps=self.lora.swaps,
                         lora_adapters_in_host_memory=len(self.lora.host), lora_reloads=self.lora.reloads)
        return stats

    @torch.inference_mode()
    def _launch_model(self, so: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep:
        step = LaunchedStep(so)
        if not so.scheduled:
            return step
        reqs = so.scheduled
        if prev is not None or (not self.config.model.enforce_eager and so.total_num_scheduled_tokens == len(reqs)
                                and all(r.prompt_logprobs is None for r in reqs)):
            hidden, sample_rows = self._run_decode(so, prev)
        else:
            input_ids, positions, meta, logits_indices, sample_rows = self.prepare(so)
            if self.lora is not None:
                self.lora.set_batch([r.sampling_params.lora_name for r in reqs], so.num_scheduled_tokens,
                                    len(input_ids))
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            if any(r.prompt_logprobs is not None for r in reqs):
                step.prompt_logprobs = self._prompt_logprobs(so, hidden, meta)
            hidden = hidden[logits_indices]
        if len(sample_rows) == 0:
            return step
        step.requests = [reqs[i] for i in sample_rows.tolist()]
        logits = self.model.compute_logits(hidden)
        if so.spec_token_ids:
            self._verify(step, logits)
            return step
        logits = self.grammar_bitmask.apply(logits, step.requests)  # structured outputs' rows
        step.sampled, step.logprobs = self.sampler.select(logits, step.requests)
        if self.device.type == "cuda":
            host = self._sampled_host[self._sampled_slot][:len(step.requests)]
            self._sampled_slot ^= 1
            host.copy_(step.sampled, non_blocking=True)
            step.host, step.copied = host, torch.cuda.Event()
            step.copied.record()
        return step

    def _verify(self, step: LaunchedStep, logits: torch.Tensor) -> None:
        """Every sampled row through the rejection sampler (a row without proposals draws its one
        token from p); the tokens come back through pinned memory on CUDA."""
        spec = step.scheduler_output.spec_token_ids
        step.spec = [spec.get(r.request_id, []) for r in step.requests]
        logits = mask_proposal_positions(logits, step.requests, step.spec, self.grammar_bitmask.kernel)
        verified = self.rejection_sampler(logits, step.requests, step.spec)
        if self.device.type == "cuda":
            tokens = torch.empty(verified.tokens.shape, dtype=torch.int64, pin_memory=True)
            num = torch.empty(verified.num_tokens.shape, dtype=torch.int64, pin_memory=True)
            tokens.copy_(verified.tokens, non_blocking=True)
            num.copy_(verified.num_tokens, non_blocking=True)
            verified = VerifiedTokens(tokens, num, verified.logprobs)
            step.copied = torch.cuda.Event()
            step.copied.record()
        step.verified = verified

    def _collect_verified(self, step: LaunchedStep) -> ModelOutput:
        if step.copied is not None:
            step.copied.synchronize()
        v = step.verified
        runs = [row[:n] for row, n in zip(v.tokens.tolist(), v.num_tokens.tolist())]
        logprobs = None
        if v.logprobs is not None:  # raw logprobs of each produced token at its position
            starts = np.cumsum([0] + [len(s) + 1 for s in step.spec])
            flat_rows = [int(starts[i]) + j for i, run in enumerate(runs) for j in range(len(run))]
            entries = self.sampler.logprob_entries(v.logprobs[flat_rows], [t for run in runs for t in run],
                                                   [r for r, run in zip(step.requests, runs) for _ in run])
            logprobs, k = [], 0
            for run, r in zip(runs, step.requests):
                logprobs.append(entries[k:k + len(run)] if r.sampling_params.logprobs is not None else None)
                k += len(run)
        output = ModelOutput(sampled_token_ids=[], logprobs=logprobs, prompt_logprobs=step.prompt_logprobs,
                             sampled_token_runs=runs)
        if self.connector is not None:
            output.kv_connector_output = self.connector.get_finished()
        return output

    def _run_decode(self, so: SchedulerOutput, prev: LaunchedStep | None):
        """A decode-only step through the padded buffers (a CUDA graph replay where captured)."""
        reqs = so.scheduled
        b = len(reqs)
        padded = self.decode_graphs.padded_size(b)
        lookahead = 1 if prev is not None else 0
        positions = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=b) + lookahead
        input_ids = prev_rows = None
        if prev is None:
            input_ids = np.fromiter((r.all_token_ids[r.num_computed_tokens] for r in reqs), dtype=np.int64, count=b)
        else:
            row_of = {r.request_id: i for i, r in enumerate(prev.requests)}
            prev_rows = np.fromiter((row_of[r.request_id] for r in reqs), dtype=np.int64, count=b)
        graphs = self.decode_graphs
        if self.lora is not None:  # a row each, then the padding
            self.lora.set_batch([r.sampling_params.lora_name for r in reqs], [1] * b, padded)
        width = graphs.stage(b, padded, positions, input_ids, [self.block_ids[r.request_id] for r in reqs], prev_rows)
        hidden = graphs.run(b, padded, width, prev.sampled if prev is not None else None)
        # A row samples when it reaches its known tokens (a one-token prefill chunk may not).
        total = np.fromiter((r.num_tokens for r in reqs), dtype=np.int64, count=b) + lookahead
        sample_rows = np.nonzero(positions + 1 == total)[0]
        return (hidden if len(sample_rows) == b else hidden[torch.from_numpy(sample_rows).to(self.device)]), sample_rows

    def _prompt_logprobs(self, so: SchedulerOutput, hidden: torch.Tensor, meta) -> dict[str, list]:
        """Logprob of each prompt token given the ones before it, for the rows that ask: per
        token (logprob, [(top id, logprob), ...top-n], its rank in the distribution)."""
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
            chosen = logprobs.gather(1, targets[:, None])
            # vLLM's rank: 1 + how many tokens were likelier than the prompt's own.
            ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
            chosen = chosen.squeeze(1).tolist()
            k = r.sampling_params.prompt_logprobs
            if k > 0:
                vals, ids = logprobs.topk(k, dim=-1)
                tops = [list(zip(a, b)) for a, b in zip(ids.tolist(), vals.tolist())]
            else:
                tops = [[] for _ in chosen]
            result[r.request_id] = list(zip(chosen, tops, ranks))
        return result
