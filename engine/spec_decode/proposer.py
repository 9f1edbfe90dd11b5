"""What every proposer shares: which rows propose, and backing off where proposals are rejected.

Proposals are made after the scheduler settled a step, from each running request's known tokens,
and verified by the next step. A row whose last proposal had nothing accepted waits 1, 3, 7, ...
63 tokens before it proposes again (reset by any acceptance), so a workload where nothing can be
accepted runs nearly all its steps without speculation: the backed-off rows then go through the
plain decode path (CUDA graphs included) instead of k + 1 query tokens each step.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

from engine.request import Request, RequestStatus
from engine.spec_decode.grammar import truncate_to_grammar

MAX_BACKOFF_EXPONENT = 6


@dataclass
class _RowState:
    num_tokens: int = 0  # when the last proposal was made
    proposal: tuple[int, ...] = ()
    failures: int = 0  # proposals in a row with nothing accepted
    resume_at: int = 0  # the request's token count from which it proposes again


class Proposer(abc.ABC):
    def __init__(self, num_speculative_tokens: int, max_model_len: int) -> None:
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self._rows: dict[str, _RowState] = {}
        self.num_backed_off = 0  # proposals skipped by the back-off

    def propose(self, running: list[Request]) -> None:
        """Set spec_token_ids on the running requests that are in the decode phase."""
        rows, ks = [], []
        for r in running:
            k = self._num_to_propose(r)
            if k > 0 and self._should_propose(r):
                rows.append(r)
                ks.append(k)
        if len(self._rows) > 2 * len(running) + 64:  # finished requests' states
            live = {r.request_id for r in running}
            self._rows = {rid: s for rid, s in self._rows.items() if rid in live}
        if not rows:
            return
        for r, proposal in zip(rows, self.propose_tokens(rows, ks)):
            proposal = truncate_to_grammar(r, proposal)
            r.spec_token_ids = proposal
            if proposal:
                state = self._rows.setdefault(r.request_id, _RowState())
                state.num_tokens, state.proposal = r.num_tokens, tuple(proposal)

    @abc.abstractmethod
    def propose_tokens(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens to follow requests[i]'s known tokens (the method's own part)."""

    def _num_to_propose(self, r: Request) -> int:
        if r.status != RequestStatus.RUNNING or r.prefill_only or r.num_computed_tokens != r.num_tokens - 1:
            return 0  # still catching up (prefill chunks, remote KV) or only producing one token
        p = r.sampling_params
        return min(self.k, p.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1)

    def _should_propose(self, r: Request) -> bool:
        state = self._rows.get(r.request_id)
        if state is None:
            return True
        if state.proposal and r.num_tokens > state.num_tokens:  # the last proposal was verified
            followed = r.all_token_ids[state.num_tokens:state.num_tokens + len(state.proposal)]
            accepted = next((i for i, (a, b) in enumerate(zip(followed, state.proposal)) if a != b), len(followed))
            state.failures = 0 if accepted else min(state.failures + 1, MAX_BACKOFF_EXPONENT)
            state.resume_at = r.num_tokens + (1 << state.failures) - 1
            state.proposal = ()
        if r.num_tokens < state.resume_at:
            self.num_backed_off += 1
            return False
        return True
