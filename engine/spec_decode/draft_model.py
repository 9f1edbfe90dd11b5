"""A draft model proposes k tokens autoregressively: a smaller checkpoint with the target's
vocabulary, on the target's device, with a paged KV cache of its own indexed by the target's block
table (the same block ids, the same slots, another tensor).

The draft's KV follows the rule the target's does, "computed catches up to known", with a count
of its own per request: each proposal first runs the draft over the request's tokens it has not
computed (all of them the first time), then k - 1 one-token steps. So a request whose target KV
came from elsewhere (a prefix-cache hit, a pull from a prefill instance in P/D: the pulled blocks
hold the target's KV only) has its whole prompt computed by the draft in its own cache on its first
proposal, and a preempted request starts over. The proposals' own KV (positions past the known
tokens) is rewritten by the next catch-up, so rejected proposals need no rollback here; the
scheduler keeps k slots past the verified tokens for these writes (num_lookahead_slots), and a
row without them (its first step after a remote pull) proposes from the next step on.

Proposals are the draft's argmax (q one-hot): for sampled requests the rejection sampler still
keeps the target's distribution exactly. The draft's layers are KV cache layers as the target's
are (vLLM's rule): the runner loads the draft beside the target, before the KV cache is sized,
and a block's bytes are the target's and the draft's together, in the cache dtype the target's
has (--kv-cache-dtype; an fp8 draft cache reads the draft checkpoint's own KV scales, if any).
"""
from __future__ import annotations

import json
import os
from typing import Callable

import numpy as np
import torch

from engine.config import language_model_config
from engine.models import load_model
from engine.models.llama import AttentionMetadata, LlamaArch
from engine.models.loader import check_architecture
from engine.request import Request
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.grammar import DraftGrammar
from engine.spec_decode.proposer import Proposer


class DraftModel:
    """The draft checkpoint beside the target: its shape (checked against the target's at once),
    then its weights and its KV cache, which the runner loads and sizes with the target's."""

    def __init__(self, config: SpeculativeConfig, target: LlamaArch, max_model_len: int, tp_size: int = 1,
                 rank: int = 0) -> None:
        """Under tensor parallelism (tp_size > 1) the draft is split over the ranks as the target is
        (`layout`: this rank's TPLayout of it), each rank its shard and its share of the draft cache;
        a draft the size cannot split (its heads, say) runs whole on rank 0 (`layout` None,
        `unsplit`: why)."""
        with open(os.path.join(config.model, "config.json")) as f:
            self.hf_config = language_model_config(json.load(f))
        check_architecture(self.hf_config)
        self.path = config.model
        self.arch = arch = LlamaArch.from_hf_config(self.hf_config)
        if arch.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({arch.vocab_size} tokens) differs "
                             f"from the target's ({target.vocab_size}): it must share the target's tokenizer")
        if arch.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config: the draft model covers {arch.max_position_embeddings} positions, "
                             f"less than max_model_len={max_model_len}")
        self.max_model_len = max_model_len
        self.layout, self.unsplit = None, None
        if tp_size > 1:
            from engine.parallel.layout import TPLayout

            try:
                self.layout = TPLayout.of(arch, tp_size, rank)
            except ValueError as e:
                self.unsplit = str(e)
        self.model = None
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        self.device = torch.device("cpu")

    @classmethod
    def of(cls, config: SpeculativeConfig | None, target: LlamaArch, max_model_len: int, tp_size: int = 1,
           rank: int = 0) -> "DraftModel | None":
        if config is None or config.method != "draft_model":
            return None
        return cls(config, target, max_model_len, tp_size, rank)

    @property
    def num_kv_heads(self) -> int:
        """The KV heads this rank's draft cache holds."""
        return self.arch.num_kv_heads if self.layout is None else self.layout.local_kv_heads

    def bytes_per_block(self, block_size: int, kv_dtype: torch.dtype) -> int:
        a = self.arch
        return 2 * block_size * self.num_kv_heads * a.head_dim * kv_dtype.itemsize * a.num_layers

    def load(self, kernels, dtype: torch.dtype, device: torch.device, linear_backend: str, group=None,
             driver=None) -> None:
        """The draft's weights: whole, or this rank's shard (`group`: a worker's TPGroup; `driver`:
        rank 0's TPDriver, whose workers then run their shards beside this one)."""
        if self.layout is None:
            group = driver = None
        if driver is not None:
            group = driver.group
        local = load_model(self.path, self.hf_config, kernels, dtype, device, linear_backend=linear_backend,
                           tp=None if group is None else group.with_layout(self.layout),
                           max_model_len=self.max_model_len)
        if driver is not None:
            from engine.parallel.driver import TensorParallelModel

            local = TensorParallelModel(local, driver, draft=True)
        self.model = local

    def allocate(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype, device: torch.device) -> None:
        """The draft cache, indexed by the target's block ids (the same count of blocks)."""
        self.kv_caches = []  # the old one freed before the new one is made
        self.block_size, self.device = block_size, device
        a = self.arch
        self.kv_caches = [torch.zeros((2, num_blocks, block_size, self.num_kv_heads, a.head_dim), dtype=kv_dtype,
                                      device=device) for _ in range(a.num_layers)]

    def forward(self, tokens, positions: list[np.ndarray], blocks: list[list[int]], decode_only: bool):
        """The draft over rows of (tokens, positions), writing their KV into the draft cache."""
        bs = self.block_size
        lens = np.fromiter((len(p) for p in positions), dtype=np.int64, count=len(positions))
        pos = np.concatenate(positions)
        seq_lens = np.fromiter((p[-1] + 1 for p in positions), dtype=np.int64, count=len(positions))
        width = int(-(-seq_lens.max() // bs))
        table = np.zeros((len(blocks), width), dtype=np.int32)
        for i, ids in enumerate(blocks):
            n = min(len(ids), width)
            table[i, :n] = ids[:n]
        rows = np.repeat(np.arange(len(blocks)), lens)
        slots = table[rows, pos // bs].astype(np.int64) * bs + pos % bs
        qsl = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl[1:])
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.from_numpy(slots).to(dev),
                                 query_start_loc=torch.from_numpy(qsl).to(dev),
                                 seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
                                 block_tables=torch.from_numpy(table).to(dev), decode_only=decode_only)
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.tensor([t for row in tokens for t in row], dtype=torch.int64).to(dev)
        return self.model(tokens, torch.from_numpy(pos).to(dev), self.kv_caches, meta)

    def catch_up(self, tokens: list[list[int]], starts: list[int], blocks: list[list[int]],
                 max_tokens: int) -> torch.Tensor:
        """The draft over each row's tokens from its start (KV into the draft cache), forwards of
        max_tokens tokens at most (the target's step budget: the memory the profiled step measured;
        a long row goes over several, each a chunk after the last); the hidden state of each row's
        last token, in row order."""
        last: list[torch.Tensor | None] = [None] * len(tokens)
        done = [0] * len(tokens)
        while any(d < len(t) for d, t in zip(done, tokens)):
            rows, room = [], max_tokens
            for i, t in enumerate(tokens):
                n = min(len(t) - done[i], room)
                if n > 0:
                    rows.append((i, done[i], done[i] + n))
                    room -= n
                if room == 0:
                    break
            hidden = self.forward([tokens[i][a:b] for i, a, b in rows],
                                  [np.arange(starts[i] + a, starts[i] + b) for i, a, b in rows],
                                  [blocks[i] for i, _, _ in rows], decode_only=False)
            at = 0
            for i, a, b in rows:
                at += b - a
                done[i] = b
                if b == len(tokens[i]):
                    last[i] = hidden[at - 1].clone()  # (a view would keep the forward's whole output)
        return torch.stack(last)


class DraftModelProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, max_model_len: int, runner,
                 block_ids_of: Callable[[str], list[int]]) -> None:
        super().__init__(config.num_speculative_tokens, max_model_len)
        self.draft = runner.draft  # loaded and given its cache by the runner (sized with the target's)
        self.device = runner.device
        self.block_size = runner.block_size
        self.model = self.draft.model
        self.max_chunk = runner.config.scheduler.max_num_batched_tokens
        self.block_ids_of = block_ids_of
        self.grammar_kernel = runner.grammar_bitmask.kernel
        # request id -> (its preemption count, tokens whose draft KV is in the draft cache).
        self.num_computed: dict[str, tuple[int, int]] = {}

    @torch.inference_mode()
    def propose_tokens(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        rows, starts, blocks = [], [], []
        for i, (r, k) in enumerate(zip(requests, ks)):
            ids = self.block_ids_of(r.request_id)
            if len(ids) * self.block_size < r.num_tokens + k - 1:
                continue  # no slots for the proposals' KV yet
            epoch, done = self.num_computed.get(r.request_id, (r.num_preemptions, 0))
            rows.append(i)
            # A row not scheduled last step (the token budget ran out) has no new token: its last
            # one runs again (the same KV rewritten) for the hidden state the proposal starts from.
            starts.append(min(done, r.num_tokens - 1) if epoch == r.num_preemptions else 0)
            blocks.append(ids)
        if not rows:
            return out
        reqs = [requests[i] for i in rows]
        ends = [r.num_tokens for r in reqs]
        # Catch up over the uncomputed known tokens; the last position proposes the first token.
        tokens = [r.all_token_ids[s:e] for r, s, e in zip(reqs, starts, ends)]
        hidden = self.draft.catch_up(tokens, starts, blocks, self.max_chunk)
        live = list(range(len(reqs)))
        grammar = DraftGrammar(reqs, self.grammar_kernel)  # structured outputs: proposals masked too
        proposed = self._choose(self.model.compute_logits(hidden), grammar, live)
        steps = [proposed]
        for step in range(1, max(ks[i] for i in rows)):
            live = [j for j in live if ks[rows[j]] > step]
            index = torch.tensor(live, device=self.device)
            inputs = steps[-1] if len(live) == len(steps[-1]) else steps[-1][index]
            pos = [np.array([ends[j] - 1 + step]) for j in live]
            hidden = self.draft.forward(inputs, pos, [blocks[j] for j in live], decode_only=True)
            nxt = self._choose(self.model.compute_logits(hidden), grammar, live)
            full = torch.zeros(len(reqs), dtype=nxt.dtype, device=self.device)
            full[index] = nxt
            steps.append(full)
        table = torch.stack(steps, dim=1).tolist()  # one copy back for the whole proposal
        allowed = grammar.finish() if grammar.active else [None] * len(reqs)
        for j, (i, r) in enumerate(zip(rows, reqs)):
            out[i] = table[j][:ks[i] if allowed[j] is None else min(ks[i], allowed[j])]
            self.num_computed[r.request_id] = (r.num_preemptions, r.num_tokens)
        if len(self.num_computed) > 2 * len(requests) + 256:
            live_ids = {r.request_id for r in requests}
            self.num_computed = {k: v for k, v in self.num_computed.items() if k in live_ids}
        return out

    @staticmethod
    def _choose(logits: torch.Tensor, grammar: DraftGrammar, live: list[int]) -> torch.Tensor:
        """The draft's argmax for rows live, within their grammars where they have one."""
        if not grammar.active:
            return logits.argmax(dim=-1)
        tokens = grammar.mask(logits, live).argmax(dim=-1)
        grammar.advance(tokens, live)
        return tokens
