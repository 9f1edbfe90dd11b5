"""How few tokens a text can become: refuses an over-long text prompt before tokenizing it.

Every token decodes from at most `max_token_chars` characters of normalized text (its longest
vocabulary entry, byte-level and "##" forms included, is never shorter than what it matches), and
the normalizer shrinks the text by at most `shrink` (NFC composes at most 4 code points into one;
a string Replace shrinks by its pattern over its content). So a text of n characters is at least
n / (max_token_chars * shrink) tokens. A normalizer or pre-tokenizer that can drop characters
outright (Strip, a regex Replace, Whitespace splits, SentencePiece's precompiled map) gives no
such bound: the check is then off and the body-size cap is what bounds the tokenizer's work.
"""
from __future__ import annotations

import json
import logging
import math

logger = logging.getLogger(__name__)

# Normalizers that never shrink the text, and those whose shrinking is bounded.
_KEEP_NORMALIZERS = {"Prepend", "Lowercase", "NFD", "NFKD", "ByteLevel"}
_UNICODE_COMPOSE = {"NFC": 4.0, "NFKC": 4.0}  # the longest canonical decomposition is 4 code points
# Pre-tokenizers that keep every character (they split, isolate or replace one for one).
_KEEP_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


def _normalizer_shrink(node: dict | None) -> float | None:
    """The most the normalizer can shrink a text by (None: unbounded)."""
    if node is None:
        return 1.0
    kind = node.get("type")
    if kind == "Sequence":
        total = 1.0
        for child in node.get("normalizers", []):
            factor = _normalizer_shrink(child)
            if factor is None:
                return None
            total *= factor
        return total
    if kind in _KEEP_NORMALIZERS:
        return 1.0
    if kind in _UNICODE_COMPOSE:
        return _UNICODE_COMPOSE[kind]
    if kind == "Replace" and "String" in node.get("pattern", {}) and node.get("content"):
        return max(1.0, len(node["pattern"]["String"]) / len(node["content"]))
    return None


def _pre_tokenizer_keeps(node: dict | None) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps(child) for child in node.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return node.get("behavior") != "Removed"
    return kind in _KEEP_PRE_TOKENIZERS


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


class PromptCharBound:
    """`min_tokens(text)`: a lower bound on the token count of `text`, or 0 when none is known."""

    def __init__(self, backend) -> None:
        """`backend`: a `tokenizers.Tokenizer`, or None (a tokenizer without one: no bound)."""
        self.chars_per_token: float | None = None
        if backend is None:
            logger.info("prompt length pre-check off: the tokenizer has no tokenizer.json backend")
            return
        shrink = _normalizer_shrink(_state(backend.normalizer))
        if shrink is None or not _pre_tokenizer_keeps(_state(backend.pre_tokenizer)):
            logger.info("prompt length pre-check off: this tokenizer's normalizer or pre-tokenizer can "
                        "drop characters")
            return
        longest = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=1)
        self.chars_per_token = max(1, longest) * shrink

    def min_tokens(self, text: str) -> int:
        return 0 if self.chars_per_token is None else math.ceil(len(text) / self.chars_per_token)
