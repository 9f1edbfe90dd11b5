"""What a request's output must match (vLLM's StructuredOutputsParams): one kind of constraint."""
from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")
BACKENDS = ("auto", "xgrammar", "llguidance")
# A choice list or a grammar this large is a denial of service, not a constraint.
MAX_SPEC_CHARS = 1 << 20
MAX_CHOICES = 1024
MAX_REASONING_END = 16  # token ids of a reasoning end marker


def _invalid(message: str) -> Exception:
    # engine.request holds SamplingParams, which holds these params: import the error late.
    from engine.request import InvalidRequestError
    return InvalidRequestError(message)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of json (a JSON schema, as JSON text), json_object, regex, choice (a list of
    strings, output is exactly one of them) or grammar (EBNF, xgrammar's dialect)."""
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    backend: str = "auto"  # auto (xgrammar, else llguidance) | xgrammar | llguidance
    # JSON kinds: only single spaces between tokens (vLLM's disable_any_whitespace); any
    # whitespace otherwise, which a random-weight model can use to never finish.
    disable_any_whitespace: bool = False
    # The token ids of the reasoning's end marker (`</think>`): the grammar applies to the output
    # after them, the reasoning before them is free (vLLM's, under a reasoning parser). Empty:
    # from the first token. Not part of the compiled grammar.
    reasoning_end: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        end = self.reasoning_end
        if isinstance(end, (str, bytes)) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                    for t in end) or len(end) > MAX_REASONING_END:
            raise _invalid(f"structured_outputs.reasoning_end must be at most {MAX_REASONING_END} token ids")
        object.__setattr__(self, "reasoning_end", tuple(end))
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise _invalid("structured_outputs.choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if (getattr(self, k) is not None and getattr(self, k) is not False)]
        if len(given) != 1:
            raise _invalid(
                "structured outputs need exactly one of json, json_object, regex, choice, grammar; got "
                + (", ".join(given) if given else "none"))
        if self.backend not in BACKENDS:
            raise _invalid(f"structured outputs backend must be one of {', '.join(BACKENDS)}, "
                                      f"got {self.backend!r}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise _invalid(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES or not all(self.choice):
                raise _invalid(f"structured_outputs.choice must hold 1 to {MAX_CHOICES} "
                                          "non-empty strings")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise _invalid(f"the structured outputs {self.kind} is over {MAX_SPEC_CHARS} characters")
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise _invalid(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise _invalid("structured_outputs.json must be a JSON schema (an object)")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False)

    @property
    def spec(self) -> str:
        """The constraint as one string (a choice list as JSON): with kind, the compile cache key."""
        kind = self.kind
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(list(self.choice))
        return getattr(self, kind)

    @property
    def cache_key(self) -> tuple:
        return (self.backend, self.kind, self.spec, self.disable_any_whitespace)

    @property
    def resolved_backend(self) -> str:
        """The backend tried first (auto: xgrammar, then llguidance for what it cannot compile)."""
        return "xgrammar" if self.backend == "auto" else self.backend
