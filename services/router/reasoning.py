"""Reasoning output (vLLM's --reasoning-parser): a thinking model's `<think>...</think>` text goes to
the chat message's `reasoning` field, the rest to `content`.

Parsers (vLLM's names): those whose output starts in reasoning unless the prompt says otherwise,
whether or not the model or its template opened the `<think>` (an opening marker it writes is
dropped): `deepseek_r1` (DeepSeek-R1 and its distills), `minimax_m2` (MiniMax-M2), `glm45`
(GLM-4.5 to 4.7) and `kimi_k2` (Kimi K2 Thinking), as vLLM's start them with thinking on; those
whose model thinks only when it opens `<think>` itself or its template did: `qwen3` (Qwen3) and
`deepseek_v3` (DeepSeek-V3.1 and later, thinking per request). With thinking off
(`enable_thinking: false`, `thinking: false`) the templates close the block before the answer,
so the output starts in content.
Where the output starts is read from the prompt's text: after an unclosed `<think>` it starts in
reasoning, after a `</think>` in content, and with neither as the parser says. The markers are
matched on the text, so a tokenizer that splits them into several tokens works too; a streamed
piece that may be the start of a marker is held back until the next piece (or the end) says.
"""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    thinks_unprompted: bool  # with no marker in the prompt, the output starts in reasoning

    def check_tokenizer(self, tokenizer) -> None:
        """The markers must survive detokenization (skip_special_tokens drops special tokens)."""
        special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
        hidden = [m for m in (START, END) if m in special]
        if hidden:
            raise ValueError(f"--reasoning-parser {self.name}: the tokenizer marks {hidden} as special tokens, "
                             "which detokenization drops; the reasoning cannot be found in the text")

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        opened, closed = prompt_text.rfind(START), prompt_text.rfind(END)
        if opened < 0 and closed < 0:
            return self.thinks_unprompted
        return opened > closed

    def splitter(self, prompt_text: str) -> "ReasoningSplitter":
        return ReasoningSplitter(self.starts_in_reasoning(prompt_text))


def _count_by_ids(token_ids: list[int], in_reasoning: bool, start: int, end: int) -> tuple[int, str]:
    """(count, the splitter's state at the end) where each marker is one token id (DeepSeek-R1's
    and Qwen3's vocabularies): one pass over the ids, the splitter's rule."""
    state, fresh, count = ("reasoning" if in_reasoning else "before"), in_reasoning, 0
    for t in token_ids:
        if state == "before":
            if t == start:
                state = "reasoning"
            continue
        if fresh and t == start:  # a redundant opening marker, dropped
            fresh = False
            continue
        fresh = False
        if t == end:
            return count, "content"
        count += 1
    return count, state


def count_reasoning_tokens(decode, token_ids: list[int], in_reasoning: bool,
                           markers: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> int:
    """The generated tokens inside the reasoning block, the markers' tokens left out (vLLM's
    `reasoning_tokens`): those after the token that completes the opening `<think>` (or from the
    start, for an output that starts in reasoning) and before the one that completes `</think>`.
    `decode(ids)` -> text; `markers`: the two markers' token ids. Where each is one token, one
    pass over the ids (exactly vLLM's count), checked against the text when the ids never closed
    the block (the model may write a marker in other tokens); else by bisection on the text of a
    prefix of the ids: a closing marker cut into several tokens counts none of them when they are
    its ids in `markers` (as a thinking budget forces it), all but its last otherwise."""
    n = len(token_ids)
    start_ids, end_ids = markers
    if len(start_ids) == 1 and len(end_ids) == 1:
        count, state = _count_by_ids(token_ids, in_reasoning, start_ids[0], end_ids[0])
        if state == "content" or (END if state == "reasoning" else START) not in decode(token_ids):
            return count

    def first(pred) -> int:
        """The smallest k with pred(text of the first k tokens); n + 1 if none."""
        lo, hi = 0, n + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if mid <= n and pred(decode(token_ids[:mid])):
                hi = mid
            else:
                lo = mid + 1
        return lo

    if in_reasoning:
        # A redundant opening marker is dropped, as the splitter drops it.
        opened = first(lambda t: not START.startswith(t) or t == START)
        opened = opened if opened <= n and decode(token_ids[:opened]) == START else 0
        closed = first(lambda t: END in (t[len(START):] if t.startswith(START) else t))
    else:
        opened = first(lambda t: START in t)
        if opened > n:
            return 0
        closed = first(lambda t: END in t[t.find(START) + len(START):] if START in t else False)
    # The token that completes `</think>` is not reasoning, nor are the marker's other tokens when
    # they are its ids as the tokenizer writes them (a forced end, a model that learnt it whole).
    k = len(end_ids)
    last = closed - k if k and closed <= n and tuple(token_ids[closed - k:closed]) == tuple(end_ids) else closed - 1
    return max(0, min(last, n) - opened)


PARSERS = {p.name: p for p in (ReasoningParser("deepseek_r1", True), ReasoningParser("minimax_m2", True),
                                ReasoningParser("glm45", True), ReasoningParser("kimi_k2", True),
                                ReasoningParser("qwen3", False), ReasoningParser("deepseek_v3", False))}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown --reasoning-parser {name!r}; choose {', '.join(PARSERS)}") from None


class ReasoningSplitter:
    """Splits one output's text, piece by piece, into (reasoning, content). Before any reasoning
    (a qwen3 output not yet thinking) a `<think>` opens it; in reasoning, `</think>` closes it,
    for good (vLLM's rule: what follows is content, markers and all); an output that starts in
    reasoning and opens with `<think>` anyway has that marker dropped."""

    def __init__(self, in_reasoning: bool) -> None:
        self.state = "reasoning" if in_reasoning else "before"
        self._fresh = in_reasoning  # nothing seen yet of an output that starts in reasoning
        self._held = ""  # the tail of what came, which may begin a marker

    def feed(self, text: str) -> tuple[str, str]:
        text = self._held + text
        self._held = ""
        reasoning, content = [], []
        while text:
            if self._fresh:
                if START.startswith(text):  # too short to tell: wait for more
                    self._held = text
                    break
                self._fresh = False
                if text.startswith(START):
                    text = text[len(START):]
                    continue
            if self.state == "content":
                content.append(text)
                break
            marker = END if self.state == "reasoning" else START
            out = reasoning if self.state == "reasoning" else content
            at = text.find(marker)
            if at >= 0:
                out.append(text[:at])
                text = text[at + len(marker):]
                self.state = "content" if self.state == "reasoning" else "reasoning"
                continue
            keep = _partial_suffix(text, marker)
            out.append(text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held: the output ended, so it is plain text where it stands."""
        held, self._held = self._held, ""
        return (held, "") if self.state == "reasoning" else ("", held)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
