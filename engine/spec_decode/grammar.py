"""Structured outputs under speculation: proposals stop at the first token the grammar refuses, and
each verified position is masked with what the grammar allows after the proposals before it."""
from __future__ import annotations

from typing import Sequence

import torch

from engine.structured_output.bitmask import bitmask_words


def truncate_to_grammar(request, proposal: list[int]) -> list[int]:
    """The leading proposals the request's grammar accepts in turn (its matcher is left as it was)."""
    grammar = request.structured_output
    if grammar is None or not proposal:
        return proposal
    return proposal[:grammar.validate_tokens(proposal)]


def mask_proposal_positions(logits: torch.Tensor, requests: Sequence, spec: Sequence[Sequence[int]],
                            kernel: str = "auto") -> torch.Tensor:
    """logits [sum(len(s) + 1), vocab], row i's positions in order: the grammar rows' positions
    masked in one pass (position j of a row: what its grammar allows after its first j proposals)."""
    if all(r.structured_output is None for r in requests):
        return logits
    from xgrammar import apply_token_bitmask_inplace

    vocab = logits.shape[-1]
    bitmask = torch.full((logits.shape[0], bitmask_words(vocab)), -1, dtype=torch.int32)
    rows: list[int] = []
    start = 0
    for r, s in zip(requests, spec):
        if r.structured_output is not None:
            rows.extend(_fill_along(r.structured_output.matcher, s, bitmask, start))
        start += len(s) + 1
    if logits.device.type == "cuda":
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    logits = logits.float().contiguous()  # the kernels take float32 rows
    apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows, backend=kernel)
    return logits


def _fill_along(matcher, proposals: Sequence[int], bitmask: torch.Tensor, start: int) -> range:
    """Rows start + j: what the grammar allows after the first j proposals, while it accepts them
    and has not ended (a position after its end is never reached: the request stops there).
    The matcher ends where it started; returns the rows filled."""
    walked = 0
    matcher.fill_bitmask(bitmask, start)
    for token in proposals:
        if not matcher.accept_token(token):
            break
        walked += 1
        if matcher.is_terminated():
            break
        matcher.fill_bitmask(bitmask, start + walked)
    filled = walked + 1 if walked == 0 or not matcher.is_terminated() else walked
    if walked:
        matcher.rollback(walked)
    return range(start, start + filled)


class DraftGrammar:
    """A draft model's proposals under its rows' grammars: each draft step's logits are masked
    with what the grammar allows after the proposals so far, whose tokens the matcher then takes;
    `finish` puts every matcher back where it was and says how many proposals each row keeps."""

    def __init__(self, requests: Sequence, kernel: str = "auto") -> None:
        self.requests = requests
        self.kernel = kernel
        self.walked = [0] * len(requests)  # tokens each matcher took
        self.ended = [r.structured_output is None for r in requests]  # nothing (more) to walk
        self.active = not all(self.ended)

    def mask(self, logits: torch.Tensor, live: Sequence[int]) -> torch.Tensor:
        """logits row i is for request live[i]; a row whose grammar ended is left as it is."""
        rows = [i for i, j in enumerate(live) if not self.ended[j]]
        if not rows:
            return logits
        from xgrammar import apply_token_bitmask_inplace

        bitmask = torch.full((logits.shape[0], bitmask_words(logits.shape[-1])), -1, dtype=torch.int32)
        for i in rows:
            self.requests[live[i]].structured_output.matcher.fill_bitmask(bitmask, i)
        if logits.device.type == "cuda":
            bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        logits = logits.float().contiguous()
        apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows, backend=self.kernel)
        return logits

    def advance(self, tokens: torch.Tensor, live: Sequence[int]) -> None:
        """The matchers take the tokens the draft chose (tokens[i] for request live[i])."""
        rows = [i for i, j in enumerate(live) if not self.ended[j]]
        if not rows:
            return
        chosen = tokens[torch.tensor(rows, device=tokens.device)].tolist()
        for i, token in zip(rows, chosen):
            j = live[i]
            matcher = self.requests[j].structured_output.matcher
            if matcher.is_terminated() or not matcher.accept_token(token):
                self.ended[j] = True
                continue
            self.walked[j] += 1
            if matcher.is_terminated():  # the grammar's end: nothing may follow it
                self.ended[j] = True

    def finish(self) -> list[int | None]:
        """Per request: how many proposals its grammar allows (None: no grammar)."""
        for r, n in zip(self.requests, self.walked):
            if n:
                r.structured_output.matcher.rollback(n)
        return [None if r.structured_output is None else n for r, n in zip(self.requests, self.walked)]
