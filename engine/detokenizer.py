"""Incremental detokenization with stop strings."""
from __future__ import annotations

from engine.request import SamplingParams

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None


# A UTF-8 character is at most 4 bytes, so a partial one completes within 4 tokens or never: a
# stream held back longer (e.g. a lone lead byte between special tokens, which a random or
# misbehaving model emits) gives up on it and shows what decoding every id gives (U+FFFD).
MAX_HELD_TOKENS = 4
# Ids of context the window keeps before the text it emits (spacing decodes as in context).
_PRIME_IDS = 8


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; finds stop strings.

    With a fast (Rust) tokenizer, its DecodeStream; otherwise a short window of ids
    (prefix_offset..end) decoded each time. Either way, multi-token characters and tokenizers
    that merge spaces come out right, and the text ends equal to decoding all the ids at once.
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
        # Fast tokenizers decode incrementally in Rust (one call of ~2 us per token); others
        # decode a sliding window of ids twice per token.
        rust = getattr(tokenizer, "_tokenizer", None)
        self._rust = rust if DecodeStream is not None and rust is not None and hasattr(rust, "decoder") else None
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens) if self._rust else None
        self._held_back = False  # the stream's last step produced no text (maybe a partial character)
        self._held = 0  # tokens in a row that produced no text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _append(self, tok: int) -> None:
        if self._stream is not None:
            piece = self._stream.step(self._rust, tok)
            self._held_back = piece is None
            if piece:
                self.text += piece
            self._held = self._held + 1 if piece is None else 0
            if self._held > MAX_HELD_TOKENS:
                self._give_up_held()
            return
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        stuck = len(self.token_ids) - self.read_offset > MAX_HELD_TOKENS
        if len(full_text) > len(prefix_text) and (stuck or not full_text.endswith("\ufffd")):
            self.text += full_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)

    def _give_up_held(self) -> None:
        """The stream has held text back too long: take what decoding every id gives, and go on
        from there with the id window (which a stuck character cannot hold up)."""
        full = self._decode(self.token_ids)
        if len(full) > len(self.text) and full.startswith(self.text):
            self.text = full
        self._stream = None
        self.prefix_offset = max(0, len(self.token_ids) - _PRIME_IDS)
        self.read_offset = len(self.token_ids)
        self._held_back = False
        self._held = 0

    def _flush(self) -> None:
        """The stream ends: bytes held back as an incomplete character come out as they decode."""
        if self._stream is not None:
            if self._held_back:
                full = self._decode(self.token_ids)
                if len(full) > len(self.text) and full.startswith(self.text):
                    self.text = full
            return
        if self.read_offset < len(self.token_ids):
            prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.token_ids[self.prefix_offset:])[len(prefix_text):]
            self.prefix_offset = self.read_offset = len(self.token_ids)

    def add_tokens(self, new_token_ids: list[int], finished: bool = False) -> str:
        """Append tokens; return the new text that is safe to show (a stop string ends it)."""
        for tok in new_token_ids:
            self.token_ids.append(tok)
            self._append(tok)
            if not self.params.stop:
                continue
            if len(self.token_ids) <= self.params.min_tokens:  # vLLM's rule: not before min_tokens
                self._checked = len(self.text)
            elif self._check_stop():
                break
        if self.stopped_on is not None:
            finished = True
        elif finished:
            self._flush()
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self.stop_buffer)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta

    def add_prefix(self, token_ids: list[int]) -> None:
        """Output this request had before these tokens (a decode's first token, sampled by the
        prefill): read for stop strings, never returned as new text."""
        self.add_tokens(token_ids)
        self._emitted = len(self.text)

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
