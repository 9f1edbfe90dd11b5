"""Logits processors before sampling, vectorised over the batch: allowed token ids, logit_bias, bad
words, min_tokens, penalties, thinking budgets."""
from __future__ import annotations

from typing import Sequence

import torch

from engine.device import on_device
from engine.thinking_budget import for_request


def apply_logits_processors(logits: torch.Tensor, requests: Sequence,
                            output_ids_per_row: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """Row i of `logits` [rows, vocab] (float32) with requests[i]'s processors applied, in vLLM's
    order: every token but allowed_token_ids hidden, logit_bias added, bad words banned, EOS and
    stop ids hidden before min_tokens, then the repetition, frequency and presence penalties; a
    spent thinking budget then leaves only its closing token.
    Temperature and the top-k/top-p/min-p filters are the sampler's, after this.

    `output_ids_per_row[i]`: the output tokens row i follows (None: each request's
    output_history, its own output after any resumed prompt tail); explicit rows start with the
    resumed tail too, which min_tokens does not count (its budget is what is left). Speculative
    decoding scores k+1 positions of one request at once: pass that request once per position,
    with its output plus the draft tokens before that position, so each position sees the
    history it would have had. The same request may appear in many rows.

    Works on the logits' device with one host-to-device copy per kind of index; nothing is read
    back. Rows that ask for nothing come out unchanged, and a batch where no row asks for
    anything returns `logits` itself (no copy)."""
    masked = logits  # the input: a grammar's mask applied, no processor yet
    params = [r.sampling_params for r in requests]
    num_outputs = ([len(o) - p.resumed_tokens for o, p in zip(output_ids_per_row, params)]
                   if output_ids_per_row is not None else [r.num_output_tokens for r in requests])
    outputs = output_ids_per_row if output_ids_per_row is not None else _LazyOutputs(requests)
    forced = {i: t for i, p in enumerate(params) if p.thinking_budget is not None
              for t in (_forced(requests[i], outputs, i, output_ids_per_row),) if t is not None}
    if not forced and not any(p.allowed_token_ids or p.logit_bias or p.bad_words_token_ids or p.has_penalties
                              or p.min_tokens > n for p, n in zip(params, num_outputs)):
        return logits
    vocab = logits.shape[-1]
    logits = logits.clone()
    allow_rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if allow_rows:
        keep = torch.zeros(len(allow_rows), vocab, dtype=torch.bool, device=logits.device)
        cols = [t for i in allow_rows for t in params[i].allowed_token_ids]
        index = on_device([[k for k, i in enumerate(allow_rows) for _ in params[i].allowed_token_ids], cols],
                          logits.device)
        keep[index[0], index[1]] = True
        rows = on_device(allow_rows, logits.device)
        logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))
    bias_rows, bias_cols, biases = [], [], []
    for i, p in enumerate(params):
        for token, bias in p.logit_bias:
            bias_rows.append(i)
            bias_cols.append(token)
            biases.append(bias)
    if biases:
        index = on_device([bias_rows, bias_cols], logits.device)
        logits.index_put_((index[0], index[1]), on_device(biases, logits.device, logits.dtype), accumulate=True)
    ban_rows, ban_cols = [], []
    for i, (r, p) in enumerate(zip(requests, params)):
        banned = banned_words(p.bad_words_token_ids, outputs[i]) if p.bad_words_token_ids else []
        if p.min_tokens > num_outputs[i]:
            banned += [*p.stop_token_ids, *(() if r.eos_token_id is None else (r.eos_token_id,))]
        banned = [t for t in banned if 0 <= t < vocab]  # an id outside the vocabulary is never sampled
        ban_rows += [i] * len(banned)
        ban_cols += banned
    if ban_rows:
        index = on_device([ban_rows, ban_cols], logits.device)
        logits[index[0], index[1]] = float("-inf")  # one indexed write for the batch
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    if penalised:
        apply_penalties(logits, [requests[i] for i in penalised], [outputs[i] for i in penalised],
                        None if len(penalised) == len(params) else penalised)
    if forced:
        # A spent thinking budget: the closing token is the only choice, whatever the processors
        # above did to it; a grammar's mask (in `masked`, the input) still has the last word.
        rows = on_device(list(forced), logits.device)
        cols = on_device(list(forced.values()), logits.device)
        kept = masked[rows, cols]
        logits[rows] = float("-inf")
        logits[rows, cols] = kept.to(logits.dtype)
    return logits


def _forced(request, outputs, i: int, explicit) -> int | None:
    """A thinking budget's forced token for row i: on the request's own token ids (no copy; none
    once its reasoning closed), or on the row's explicit output (a speculative position)."""
    tb = request.sampling_params.thinking_budget
    if explicit is not None:
        return tb.forced_token(outputs[i])
    at = for_request(request)
    return None if at is None else tb.forced_token(*at)


class _LazyOutputs:
    """requests[i].output_history, copied out only for the rows that read it."""

    def __init__(self, requests: Sequence) -> None:
        self.requests = requests

    def __getitem__(self, i: int) -> list[int]:
        return self.requests[i].output_history


def banned_words(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The last token of each bad word whose other tokens the output ends with (vLLM: the output
    only, not the prompt); a one-token word always."""
    banned = []
    n = len(output)
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > n:
            continue
        if prefix == 0 or all(output[n - prefix + j] == word[j] for j in range(prefix)):
            banned.append(word[-1])
    return banned


def _token_table(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Rows of token ids [len(rows), longest], padded with `pad`."""
    width = max(1, max(len(r) for r in rows))
    return on_device([list(r) + [pad] * (width - len(r)) for r in rows], device, torch.int64)


def apply_penalties(logits: torch.Tensor, requests: Sequence, outputs: Sequence[Sequence[int]],
                    rows: list[int] | None) -> None:
    """In place on `logits` rows `rows` (None: all), as vLLM: a token seen in the prompt or the
    output has its logit divided by repetition_penalty when positive, multiplied when not; then
    frequency_penalty * (its count in the output) and presence_penalty * (seen in the output)
    are subtracted."""
    dev, vocab = logits.device, logits.shape[-1]
    params = [r.sampling_params for r in requests]
    # Counts over vocab + 1 columns: the padding id `vocab` lands in the last one, dropped.
    table = _token_table(outputs, vocab, dev)
    counts = torch.zeros(len(params), vocab + 1, dtype=logits.dtype, device=dev)
    counts.scatter_add_(1, table, torch.ones_like(table, dtype=logits.dtype))
    counts = counts[:, :vocab]
    seen = counts > 0
    index = on_device(rows, dev) if rows is not None else None
    sub = logits if index is None else logits.index_select(0, index)
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = _token_table([r.prompt_token_ids if p.repetition_penalty != 1.0 else () for r, p
                                in zip(requests, params)], vocab, dev)
        in_prompt = torch.zeros(len(params), vocab + 1, dtype=torch.bool, device=dev)
        in_prompt.scatter_(1, prompts, True)
        rep = on_device([p.repetition_penalty for p in params], dev, logits.dtype)[:, None]
        scale = torch.where(in_prompt[:, :vocab] | seen, rep, torch.ones_like(rep))
        sub = torch.where(sub > 0, sub / scale, sub * scale)
    # `sub` is a copy by now (index_select, or torch.where above), or `logits` itself: ours either way.
    if any(p.frequency_penalty != 0.0 for p in params):
        sub.sub_(counts.mul_(on_device([p.frequency_penalty for p in params], dev, logits.dtype)[:, None]))
    if any(p.presence_penalty != 0.0 for p in params):
        sub.sub_(seen * on_device([p.presence_penalty for p in params], dev, logits.dtype)[:, None])
    if index is None:
        if sub is not logits:
            logits.copy_(sub)
    else:
        logits.index_copy_(0, index, sub)
