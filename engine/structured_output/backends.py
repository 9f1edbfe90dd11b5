"""Grammar engines behind one small interface: xgrammar (the default) and llguidance.

A backend compiles a StructuredOutputsParams into a grammar (slow, once per spec, thread-safe) and
makes a Matcher per request from it (cheap). Both fill xgrammar's bitmask layout: int32 words,
bit j of word i set when token 32 * i + j is allowed.
"""
from __future__ import annotations

import abc
import json

from engine.structured_output.params import StructuredOutputsParams

# The JSON a "json_object" request must produce: any object, as OpenAI's json mode.
_ANY_OBJECT = '{"type": "object"}'
# xgrammar 0.2.9 writes a string with minLength/maxLength as characters of this class, which lets
# raw control characters (U+0000-U+001F) through where JSON requires them escaped: a document a
# strict parser refuses. Its unbounded strings use the right class, and so do we, in the EBNF.
_LENGTH_BOUNDED_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


class GrammarError(ValueError):
    """The constraint does not compile (a bad schema, regex or grammar): the request's fault."""


class Matcher(abc.ABC):
    """One request's position in its grammar. accept/rollback move it; the rest only read it."""

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no move) if the grammar does not allow it."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (speculative decoding's rejected proposals)."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (an int32 [rows, words] CPU tensor)."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """The grammar accepted its stop token: nothing more may be generated."""

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of token_ids the grammar accepts in turn; the state is unchanged."""
        accepted = 0
        for t in token_ids:
            if not self.accept_token(t):
                break
            accepted += 1
        if accepted:
            self.rollback(accepted)
        return accepted


class AfterReasoningMatcher(Matcher):
    """A grammar that starts once the output has shown the reasoning's end marker (vLLM's
    structured outputs under a reasoning parser): until then every token is allowed and only
    watched for the marker's token ids; the grammar then takes the tokens after it. Rollback
    (speculative decoding) undoes either phase, the marker's completion too."""

    def __init__(self, inner: Matcher, end: tuple[int, ...]) -> None:
        self.inner = inner
        self.end = tuple(end)
        self.tokens: list[int] = []  # every token accepted, both phases
        self.started_at: int | None = None  # index in tokens of the grammar's first token

    @property
    def started(self) -> bool:
        return self.started_at is not None

    def accept_token(self, token_id: int) -> bool:
        if self.started_at is None:
            self.tokens.append(token_id)
            if len(self.tokens) >= len(self.end) and tuple(self.tokens[-len(self.end):]) == self.end:
                self.started_at = len(self.tokens)
            return True
        if not self.inner.accept_token(token_id):
            return False
        self.tokens.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self.tokens.pop()
            if self.started_at is not None:
                if len(self.tokens) >= self.started_at:
                    self.inner.rollback(1)
                else:  # the marker's last token went: the grammar has not started
                    self.started_at = None

    def fill_bitmask(self, bitmask, row: int) -> None:
        if self.started_at is None:
            bitmask[row].fill_(-1)  # every token
        else:
            self.inner.fill_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.started_at is not None and self.inner.is_terminated()


class GrammarBackend(abc.ABC):
    name: str

    @abc.abstractmethod
    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar; GrammarError if the spec is wrong. Called on a worker thread."""

    @abc.abstractmethod
    def matcher(self, compiled) -> Matcher:
        ...


class XgrammarMatcher(Matcher):
    def __init__(self, matcher) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def fill_bitmask(self, bitmask, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()


class XgrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2,
                 cache_limit_bytes: int = 256 << 20) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        # vocab_size is the model's (its logits' width): ids past the tokenizer's are never allowed.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_limit_bytes=cache_limit_bytes)

    def compile(self, params: StructuredOutputsParams):
        kind, c = params.kind, self.compiler
        whitespace = {"any_whitespace": not params.disable_any_whitespace}
        try:
            if kind in ("json", "json_object"):
                schema = params.json if kind == "json" else _ANY_OBJECT
                ebnf = str(self._xgr.Grammar.from_json_schema(schema, **whitespace))
                return c.compile_grammar(ebnf.replace(_LENGTH_BOUNDED_CHAR, _JSON_STRING_CHAR))
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "choice":
                return c.compile_grammar(choice_ebnf(params.choice))
            return c.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"invalid {kind} for structured outputs: {_first_line(e)}") from None

    def matcher(self, compiled) -> Matcher:
        return XgrammarMatcher(self._xgr.GrammarMatcher(compiled))


class LLGuidanceMatcher(Matcher):
    def __init__(self, matcher) -> None:
        from llguidance.torch import fill_next_token_bitmask

        self._m = matcher
        self._fill = fill_next_token_bitmask

    def accept_token(self, token_id: int) -> bool:
        if self._m.is_stopped() or not self._m.validate_tokens([token_id]):
            return False
        return self._m.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def fill_bitmask(self, bitmask, row: int) -> None:
        self._fill(self._m, bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def validate_tokens(self, token_ids: list[int]) -> int:
        return self._m.validate_tokens(token_ids)


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        eos = stop_token_ids[0] if stop_token_ids else None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    def compile(self, params: StructuredOutputsParams):
        ll, kind = self._ll, params.kind
        try:
            if kind == "json" or kind == "json_object":
                schema = json.loads(params.json if kind == "json" else _ANY_OBJECT)
                if isinstance(schema, dict):
                    # llguidance's own whitespace switch: compact unless any whitespace is wanted.
                    schema = {**schema, "x-guidance": {"whitespace_flexible": not params.disable_any_whitespace,
                                                       **schema.get("x-guidance", {})}}
                grammar = ll.grammar_from("json_schema", json.dumps(schema))
            elif kind == "choice":
                grammar = ll.grammar_from("grammar", choice_ebnf(params.choice))
            else:
                grammar = ll.grammar_from("regex" if kind == "regex" else "grammar", params.spec)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid {kind} for structured outputs: {_first_line(e)}") from None
        error = ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(f"invalid {kind} for structured outputs: {_first_line(error)}")
        return grammar

    def matcher(self, compiled) -> Matcher:
        return LLGuidanceMatcher(self._ll.LLMatcher(self.tokenizer, compiled))


def choice_ebnf(choices) -> str:
    """An EBNF grammar whose language is exactly the given strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def make_backend(name: str, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> GrammarBackend:
    if name == "xgrammar":
        return XgrammarBackend(tokenizer, vocab_size, stop_token_ids)
    if name == "llguidance":
        return LLGuidanceBackend(tokenizer, vocab_size, stop_token_ids)
    raise ValueError(f"unknown structured outputs backend {name!r}")


def _first_line(error) -> str:
    """xgrammar prefixes its messages with a timestamp and a C++ source location: drop them."""
    text = str(error).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else text
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    if ".cc:" in line.split(" ", 1)[0]:
        line = line.split(" ", 1)[1] if " " in line else line
    return line
