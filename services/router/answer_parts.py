"""One chat answer, chunk by chunk, as the parts that item-based APIs show (OpenAI's Responses,
Anthropic's Messages): the reasoning's text, the content's text with the tokens that made it, and
once the answer is complete its tool calls."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.router.generation import TextChunk
from services.router.openai_serving import Choice
from services.router.tool_calls import ToolCallStream


@dataclass
class Parts:
    reasoning: str = ""
    content: str = ""
    token_ids: list[int] = field(default_factory=list)  # the tokens whose text `content` is
    logprobs: list = field(default_factory=list)  # theirs (pb.TokenLogprob), when asked for
    calls: list[dict] | None = None  # set once the answer is complete: its tool calls (OpenAI's shape)
    call_deltas: list[dict] = field(default_factory=list)  # the calls as they come (ToolCallStream.take_deltas)


class AnswerParts:
    """`choice` accumulates the answer (usage, finish reason); with tools the content outside the
    calls streams as it comes, the calls as ToolCallStream makes them (`call_deltas`) and all of
    them once the answer is complete (`calls`). A token's logprob goes with the
    content text it makes; those of the reasoning's tokens are not shown (nor, with tools, any)."""

    def __init__(self, choice: Choice) -> None:
        self.choice = choice
        self.tools = ToolCallStream(choice.req.tools, stream_calls=choice.req.stream) \
            if choice.req.tools is not None else None
        self._pending: list[tuple[list, list]] = []  # tokens whose text is not shown yet

    def feed(self, chunk: TextChunk) -> Parts:
        c = self.choice
        text, _ = c.add(chunk)
        finished = chunk.finish_reason is not None
        parts = Parts(reasoning=c.new_reasoning if c.req.include_reasoning else "")
        if self.tools is not None:
            parts.content = self.tools.feed(text)
            if finished:
                rest, parts.calls = self.tools.finish()
                parts.content += rest
            parts.call_deltas = self.tools.take_deltas()
            return parts
        parts.content = text
        self._pending.append((chunk.token_ids, chunk.logprobs))
        in_content = c.splitter is None or c.splitter.state == "content"
        if text or finished and in_content:
            parts.token_ids = [t for ids, _ in self._pending for t in ids]
            parts.logprobs = [lp for _, lps in self._pending for lp in lps]
            self._pending.clear()
        elif c.new_reasoning:
            self._pending.clear()
        if finished:
            parts.calls = []
        return parts
