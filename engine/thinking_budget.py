"""A reasoning model's thinking budget (vLLM's thinking_token_budget, Anthropic's
thinking.budget_tokens): once an output has reasoned for `budget` tokens without closing its
reasoning, the engine forces the closing tokens, and the answer follows.

The state is read from the output itself, never kept beside it: a request resumed on another
engine (its earlier output resent as the prompt's tail), a decode continuing a prefill's first
token, and a speculative row scoring draft tokens all see the same budget. The rule is the
router's reasoning splitter's, on token ids: an output that starts in reasoning (its prompt
opened the block, or the model always thinks first) drops a redundant opening marker; one that
does not waits for the opening marker; the first closing marker after it ends the reasoning for
good. Reasoning tokens are the tokens between the two markers, as usage's reasoning_tokens counts
them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# Token ids a marker or the forced closing text may hold (a closing text is a phrase, not an essay).
MAX_MARKER_TOKENS = 64


def _invalid(message: str) -> Exception:
    from engine.request import InvalidRequestError  # request.py imports this module
    return InvalidRequestError(message)


@dataclass(frozen=True)
class ThinkingBudget:
    budget: int  # reasoning tokens allowed before the closing tokens are forced (0: none)
    end: tuple[int, ...]  # the closing marker's token ids (</think>)
    start: tuple[int, ...] = ()  # the opening marker's token ids (<think>)
    # The output starts in reasoning: its prompt left a block open, or the model thinks unprompted.
    # False: the reasoning starts where the output writes `start`.
    starts_in_reasoning: bool = True
    # What is forced when the budget is spent, ending with `end` (a closing phrase before the
    # marker, as vLLM's reasoning_end_str); empty: `end` alone.
    forced: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise _invalid(f"thinking_token_budget must be an integer >= 0, got {b!r}")
        for name in ("end", "start", "forced"):
            ids = getattr(self, name)
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                raise _invalid(f"thinking budget {name} must be a list of token ids")
            ids = tuple(ids)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids) or len(ids) > MAX_MARKER_TOKENS:
                raise _invalid(f"thinking budget {name} must be at most {MAX_MARKER_TOKENS} token ids")
            object.__setattr__(self, name, ids)
        if not self.end:
            raise _invalid("a thinking budget needs the reasoning's end marker (its token ids)")
        if not self.starts_in_reasoning and not self.start:
            raise _invalid("a thinking budget on an output that does not start in reasoning needs the "
                           "reasoning's start marker (its token ids)")
        forced = self.forced or self.end
        if forced[len(forced) - len(self.end):] != self.end or _find(forced[:-1], self.end, 0) >= 0:
            raise _invalid("the thinking budget's forced tokens must end with the end marker, and hold it only there")
        object.__setattr__(self, "forced", forced)

    def token_ids(self) -> tuple[int, ...]:
        """Every id it may force or match (for the vocabulary check)."""
        return tuple(dict.fromkeys((*self.end, *self.start, *self.forced)))

    def _reasoning_from(self, seq: Sequence[int], begin: int, unknown_next: bool = False) -> int | None:
        """Where the reasoning starts in seq (the output from `begin`), or None when it has not
        started. `unknown_next`: a token not yet known follows (a redundant opening marker only
        moves the start later, so the earliest is taken)."""
        start = self.start
        if self.starts_in_reasoning:
            k = len(start)
            if unknown_next or not k or len(seq) - begin < k or tuple(seq[begin:begin + k]) != start:
                return begin
            return begin + k
        at = _find(seq, start, begin)
        return None if at < 0 else at + len(start)

    def closed(self, seq: Sequence[int], begin: int = 0) -> bool:
        """The output (seq from `begin`) has opened and closed its reasoning: for good."""
        reasoning_from = self._reasoning_from(seq, begin)
        return reasoning_from is not None and _find(seq, self.end, reasoning_from) >= 0

    def forced_token(self, seq: Sequence[int], begin: int = 0) -> int | None:
        """The token the next position must take after seq[begin:] (this request's output so
        far, a resumed tail included), or None when the output may go on as it likes: not
        reasoning (yet, or any more), or within the budget."""
        reasoning_from = self._reasoning_from(seq, begin)
        if reasoning_from is None:
            return None
        spent = len(seq) - reasoning_from - self.budget
        if spent < 0 or spent >= len(self.forced) or _find(seq, self.end, reasoning_from) >= 0:
            return None
        return self.forced[spent]

    def may_force_after_next(self, seq: Sequence[int], begin: int = 0) -> bool:
        """Whether the position after seq[begin:] plus one token not yet known may be forced:
        the engine's overlapped decode step launches it before that token is read back, so it
        only may where the answer is no whatever the token is."""
        reasoning_from = self._reasoning_from(seq, begin, unknown_next=True)
        if reasoning_from is None:  # the unknown token may complete the opening marker
            return self.budget == 0
        if _find(seq, self.end, reasoning_from) >= 0:
            return False
        return len(seq) + 1 - reasoning_from - self.budget >= 0


def for_request(request) -> tuple[list[int], int] | None:
    """(the request's token ids, where its output starts) while its thinking budget may still
    act; None once its reasoning closed (remembered on the request: its committed output only
    grows) or when it has no budget."""
    tb = request.sampling_params.thinking_budget
    if tb is None or request.thinking_closed:
        return None
    seq, begin = request.all_token_ids, request.output_start
    if tb.closed(seq, begin):
        request.thinking_closed = True
        return None
    return seq, begin


def _find(seq: Sequence[int], marker: tuple[int, ...], begin: int) -> int:
    """Index of the first occurrence of `marker` in seq[begin:], or -1 (list.index finds each
    candidate first token at C speed)."""
    first, rest, m = marker[0], marker[1:], len(marker)
    seq = seq if isinstance(seq, list) else list(seq)
    last = len(seq) - m
    i = begin
    while i <= last:
        try:
            i = seq.index(first, i, last + 1)
        except ValueError:
            return -1
        if not rest or tuple(seq[i + 1:i + m]) == rest:
            return i
        i += 1
    return -1
