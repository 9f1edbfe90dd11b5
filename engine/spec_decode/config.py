"""`speculative_config` as vLLM spells it: the method, k, and the method's own knobs (frozen)."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram: the longest suffix of length in [min, max] seen earlier proposes what followed it.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # draft_model: a smaller checkpoint with the target's vocabulary.
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 1 <= lo <= hi:
                raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, "
                                 f"got {lo!r} and {hi!r}")
            if self.model is not None:
                raise ValueError("speculative_config: 'model' is for method 'draft_model', not 'ngram'")
        else:
            if not self.model:
                raise ValueError("speculative_config: method 'draft_model' needs 'model' (a checkpoint directory)")
            if not os.path.isfile(os.path.join(self.model, "config.json")):
                raise FileNotFoundError(f"speculative_config: draft model {self.model!r} is not a Hugging Face "
                                        f"checkpoint directory (no config.json)")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A SpeculativeConfig, a dict, a JSON object string, or None (off)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
        missing = [k for k in ("method", "num_speculative_tokens") if k not in value]
        if missing:
            raise ValueError(f"speculative_config: missing {missing}")
        return cls(**value)

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots held past the verified tokens, for a draft that writes its proposals' KV after
        the step (the target's slots are computed again by the next verification)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0
