"""Front-end input processing: tokenization and request validation."""
from __future__ import annotations

import os

from engine.request import InvalidRequestError, SamplingParams


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory not found: {path!r}")
    return AutoTokenizer.from_pretrained(path)


class InputProcessor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id if self.tokenizer is not None else None

    def to_token_ids(self, prompt) -> list[int]:
        """str, list of token ids, or {"prompt": ...} / {"prompt_token_ids": [...]}."""
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: send prompt token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise InvalidRequestError("prompt must be a string or a list of token ids")

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens; this model's context is {self.max_model_len} "
                f"tokens and at least one must be left to generate")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling params must be a SamplingParams")
