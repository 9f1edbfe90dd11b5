"""Incremental detokenization with stop strings."""
from __future__ import annotations

from engine.request import SamplingParams


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; finds stop strings.

    Decodes a short window (prefix_offset..end) each time, so multi-token characters and
    tokenizers that merge spaces come out right, at O(window) per token.
    """

    def __init__(self, tokenizer, params: SamplingParams, prompt_token_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        # Strings can span token boundaries: hold back this many characters while streaming.
        self.stop_buffer = max((len(s) for s in params.stop), default=1) - 1 if params.stop else 0
        self.stopped_on: str | None = None
        self._emitted = 0
        self._checked = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int], finished: bool = False) -> str:
        """Append tokens; return the new text that is safe to show (a stop string ends it)."""
        for tok in new_token_ids:
            self.token_ids.append(tok)
            prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            full_text = self._decode(self.token_ids[self.prefix_offset:])
            if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                self.text += full_text[len(prefix_text):]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.token_ids)
            if self.params.stop and self._check_stop():
                break
        if self.stopped_on is not None:
            finished = True
        elif finished and self.read_offset < len(self.token_ids):
            # Flush bytes held back as an incomplete character: the stream ends here.
            prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.token_ids[self.prefix_offset:])[len(prefix_text):]
            self.prefix_offset = self.read_offset = len(self.token_ids)
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self.stop_buffer)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta

    def _check_stop(self) -> bool:
        # Only text added since the last check (plus a stop string's length of overlap) can match.
        search_from = max(0, self._checked - self.stop_buffer)
        self._checked = len(self.text)
        best = None
        for stop in self.params.stop:
            i = self.text.find(stop, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return False
        i, stop = best
        self.text = self.text[:i + len(stop)] if self.params.include_stop_str_in_output else self.text[:i]
        self._emitted = min(self._emitted, len(self.text))
        self.stopped_on = stop
        return True
