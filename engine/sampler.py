"""Logits processors, then greedy / temperature / top-k / top-p / min-p sampling, per-request seeds, logprobs."""
from __future__ import annotations

import torch

from engine.device import on_device
from engine.logits_processors import apply_logits_processors
from engine.request import SamplingParams


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                            top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits [n, vocab] to -inf outside each row's top-k / nucleus / min-p set."""
    if min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        mask |= ranks >= top_k[:, None]
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it does.
        mass_before = probs.cumsum(dim=-1) - probs
        mask |= mass_before >= top_p[:, None]
        mask[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's distribution after its temperature (1 for greedy rows) and top-k / top-p / min-p."""
    dev, vocab = logits.device, logits.shape[-1]
    temps = on_device([p.temperature if not p.greedy else 1.0 for p in params], dev, torch.float32)
    logits = logits / temps[:, None]
    top_k = top_p = min_p = None
    if any(p.top_k > 0 for p in params):
        top_k = on_device([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], dev)
    if any(p.top_p < 1.0 for p in params):
        top_p = on_device([p.top_p for p in params], dev)
    if any(p.min_p > 0.0 for p in params):
        min_p = on_device([p.min_p for p in params], dev)
    return torch.softmax(apply_top_k_top_p_min_p(logits, top_k, top_p, min_p), dim=-1)


def grammar_first(masked: torch.Tensor, processed: torch.Tensor, requests: list) -> torch.Tensor:
    """A structured-output row that the logits processors left nothing to sample (min_tokens
    hiding EOS where the grammar allows only its end, bad words banning every token it allows)
    samples from the grammar's mask alone: the grammar is the hard constraint, so a complete
    document ends (finish_reason "stop", short of min_tokens) instead of the row sampling a
    token the grammar refuses. `masked`: the logits before the processors, after the grammar's
    mask. On the logits' device, nothing read back."""
    if processed is masked:
        return processed
    rows = [i for i, r in enumerate(requests) if r.structured_output is not None]
    if not rows:
        return processed
    index = on_device(rows, processed.device)
    sub = processed.index_select(0, index)
    dead = torch.isneginf(sub).all(dim=-1, keepdim=True)
    return processed.index_copy(0, index, torch.where(dead, masked.index_select(0, index).to(sub.dtype), sub))


class Sampler:
    """Samples one token per row, on the logits' device. Seeded rows draw from their own
    generator (on that device), so a request's tokens do not depend on what else is in the batch."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list) -> tuple[list[int], list | None]:
        """One token per row of logits; `requests` are engine Requests in row order."""
        tokens, logprobs = self.select(logits, requests)
        token_list = tokens.tolist()
        return token_list, (self.logprob_entries(logprobs, token_list, requests) if logprobs is not None else None)

    def select(self, logits: torch.Tensor, requests: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled ids [n] and, when a row asks for them, log-probabilities [n, vocab], both on
        the logits' device with no device-to-host copy (the caller brings them back asynchronously)."""
        params = [r.sampling_params for r in requests]
        logits = logits.float()
        # Raw logprobs, before any processor (vLLM's default logprobs mode).
        logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
        logits = grammar_first(logits, apply_logits_processors(logits, requests), requests)
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1), logprobs
        return self._sample(logits, requests, params), logprobs

    @classmethod
    def logprob_entries(cls, logprobs: torch.Tensor, tokens: list[int], requests: list) -> list:
        return cls._logprobs(logprobs, tokens, [r.sampling_params for r in requests])

    def _sample(self, logits: torch.Tensor, requests: list, params: list[SamplingParams]) -> torch.Tensor:
        dev = logits.device
        any_greedy = any(p.greedy for p in params)
        probs = sampling_probs(logits, params)
        # Exponential race (Gumbel-max): argmax(p / E), E ~ Exp(1), one noise row per request.
        noise = torch.empty_like(probs)
        for i, (r, p) in enumerate(zip(requests, params)):
            if p.seed is not None:
                gen = self.request_generators.get(r.request_id)
                if gen is None:
                    gen = self.request_generators[r.request_id] = torch.Generator(device=dev).manual_seed(p.seed)
                    # Tokens sampled elsewhere used draws of this seed already: a prefill
                    # instance's first token, and the output resent as the prompt's tail after a
                    # migration. Skip them, so disaggregated == colocated and a moved request
                    # goes on with the random stream it had.
                    skip = torch.empty_like(noise[i])
                    for _ in range(r.num_output_tokens + p.resumed_tokens):
                        skip.exponential_(generator=gen)
                noise[i].exponential_(generator=gen)
            else:
                noise[i].exponential_(generator=self.generator)
        sampled = (probs / noise).argmax(dim=-1)
        if not any_greedy:
            return sampled
        return torch.where(on_device([p.greedy for p in params], dev), logits.argmax(dim=-1), sampled)

    @staticmethod
    def _logprobs(logprobs: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> list:
        out = []
        for i, (tok, p) in enumerate(zip(tokens, params)):
            if p.logprobs is None:
                out.append(None)
                continue
            row = logprobs[i]
            top = []
            if p.logprobs > 0:
                vals, ids = row.topk(p.logprobs)
                top = list(zip(ids.tolist(), vals.tolist()))
            out.append((float(row[tok]), top))
        return out
