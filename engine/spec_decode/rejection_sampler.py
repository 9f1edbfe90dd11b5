"""Verifies proposals against the target's logits at every position of a row, keeping the target's
distribution exactly (speculative sampling: Leviathan et al. 2023, Chen et al. 2023).

A row proposing s tokens d_1..d_s brings s + 1 positions of logits: position j scores the token
after d_1..d_j. Greedy rows accept while the target's argmax equals the proposal, then emit the
argmax. Sampled rows accept d_j with probability min(1, p(d_j) / q(d_j)); at the first rejection
they draw from normalise(max(0, p - q)), and when all are accepted, a bonus token from p at the
last position. q is the distribution the proposal was drawn from: one-hot for n-gram lookup and
greedy drafts. p is the target's distribution after the request's logits processors (with the
proposals before each position as output so far), temperature and top-k / top-p / min-p, as the
normal sampler makes it; logprobs are the raw ones, as there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.device import on_device
from engine.logits_processors import apply_logits_processors
from engine.sampler import Sampler, grammar_first, sampling_probs


@dataclass
class VerifiedTokens:
    """On the logits' device: row i produced tokens[i, :num_tokens[i]] (accepted proposals, then
    the target's own token); logprobs (raw, one row per position, in position order) when asked."""
    tokens: torch.Tensor  # [rows, max_spec + 1] int64
    num_tokens: torch.Tensor  # [rows] int64
    logprobs: torch.Tensor | None = None  # [sum(spec + 1), vocab]


class RejectionSampler:
    """Vectorised over the batch on the logits' device; seeded rows draw from the same per-request
    generator as the sampler, so a seeded request is reproducible run to run."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, requests: Sequence, spec: Sequence[Sequence[int]],
                 draft_probs: torch.Tensor | None = None) -> VerifiedTokens:
        """logits [sum(len(s) + 1), vocab]: row i's len(spec[i]) + 1 positions, rows in order.
        draft_probs [rows, max_spec, vocab] or None (every proposal drawn one-hot)."""
        dev = logits.device
        num_spec = [len(s) for s in spec]
        rows, width = len(requests), max(num_spec) + 1
        # One logits row per position: the request repeated, its proposals before it as output.
        pos_requests = [r for r, n in zip(requests, num_spec) for _ in range(n + 1)]
        pos_outputs = [r.output_history + list(s[:j]) for r, s in zip(requests, spec) for j in range(len(s) + 1)]
        logits = logits.float()
        params = [r.sampling_params for r in requests]
        logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
        logits = grammar_first(logits, apply_logits_processors(logits, pos_requests, pos_outputs), pos_requests)

        # [rows, width] index of each (row, position) into the flat positions; padding repeats the last.
        starts = [0]
        for n in num_spec:
            starts.append(starts[-1] + n + 1)
        index = on_device([[starts[i] + min(j, num_spec[i]) for j in range(width)] for i in range(rows)], dev)
        valid = on_device([[j < n for j in range(width - 1)] for n in num_spec], dev, torch.bool)
        draft = on_device([list(s) + [0] * (width - 1 - len(s)) for s in spec], dev)
        spec_len = on_device(num_spec, dev)

        greedy_rows = [p.greedy for p in params]
        target = logits.argmax(dim=-1)[index]  # [rows, width]
        tokens, accepted = self._greedy(target, draft, valid)
        if not all(greedy_rows):
            s_tokens, s_accepted = self._sample(logits, index, draft, valid, spec_len, num_spec, requests, params,
                                                draft_probs)
            if any(greedy_rows):
                is_greedy = on_device(greedy_rows, dev, torch.bool)
                tokens = torch.where(is_greedy[:, None], tokens, s_tokens)
                accepted = torch.where(is_greedy, accepted, s_accepted)
            else:
                tokens, accepted = s_tokens, s_accepted
        return VerifiedTokens(tokens, accepted + 1, logprobs)

    @staticmethod
    def _greedy(target: torch.Tensor, draft: torch.Tensor, valid: torch.Tensor):
        """Accepted proposals equal the argmax, so the argmax row is the output."""
        match = (target[:, :-1] == draft) & valid
        accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
        return target, accepted

    def _sample(self, logits, index, draft, valid, spec_len, num_spec, requests, params, draft_probs):
        dev = logits.device
        rows, width = index.shape
        vocab = logits.shape[-1]
        p = self._target_probs(logits, params, num_spec)[index]  # [rows, width, vocab]
        uniform = torch.empty(rows, width - 1, device=dev)
        race = torch.empty(rows, width, vocab, device=dev)
        for i, r in enumerate(requests):
            gen = self._generator(r, dev)
            uniform[i].uniform_(generator=gen)
            race[i].exponential_(generator=gen)
        p_draft = p[:, :-1].gather(2, draft[:, :, None]).squeeze(2)  # p(d_j)
        if draft_probs is None:  # one-hot q: accept with probability p(d_j)
            accept = uniform < p_draft
            residual = p[:, :-1].scatter(2, draft[:, :, None], 0.0)
        else:
            q = draft_probs[:, :width - 1].float()
            q_draft = q.gather(2, draft[:, :, None]).squeeze(2)
            accept = uniform * q_draft < p_draft  # u < p / q, without dividing by zero
            residual = (p[:, :-1] - q).clamp_min_(0.0)
        # A residual of zero mass (p == q up to rounding) is never reached by a rejection; p keeps it valid.
        empty = residual.sum(dim=2, keepdim=True) <= 0
        residual = torch.where(empty, p[:, :-1], residual)
        accepted = (accept & valid).to(torch.int64).cumprod(dim=1).sum(dim=1)
        # Position a draws from the residual if a proposal was rejected there, from p at the end (bonus).
        fallback = torch.cat([residual, p[:, -1:]], dim=1)
        at_end = torch.arange(width, device=dev)[None, :] == spec_len[:, None]
        fallback = torch.where(at_end[:, :, None], p, fallback)
        recovered = (fallback / race).argmax(dim=2)  # exponential race: proportional to fallback
        positions = torch.arange(width, device=dev)[None, :]
        padded_draft = torch.cat([draft, draft[:, :1]], dim=1)
        tokens = torch.where(positions < accepted[:, None], padded_draft, recovered)
        return tokens, accepted

    @staticmethod
    def _target_probs(logits, params, num_spec) -> torch.Tensor:
        """The sampler's distribution at every position (each row's parameters repeated)."""
        return sampling_probs(logits, [p for p, n in zip(params, num_spec) for _ in range(n + 1)])

    def _generator(self, request, device: torch.device) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self.sampler.generator
        gens = self.sampler.request_generators
        gen = gens.get(request.request_id)
        if gen is None:
            gen = gens[request.request_id] = torch.Generator(device=device).manual_seed(seed)
        return gen
