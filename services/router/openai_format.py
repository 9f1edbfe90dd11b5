"""OpenAI response bodies: choices, streamed chunks, logprobs and usage."""
from __future__ import annotations

from services.router.served_model import ServedModel


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class CompletionLogprobs:
    """The /v1/completions `logprobs` object, built up chunk by chunk (text_offset runs on)."""

    def __init__(self, model: ServedModel, top_n: int, text_offset: int = 0, as_ids: bool = False) -> None:
        self.model = model
        self.top_n = top_n
        self.offset = text_offset
        self.name = token_namer(model, as_ids)

    def _top(self, lp) -> dict:
        top = {self.name(lp.token_id): lp.logprob}
        for t in lp.top[:self.top_n]:
            top.setdefault(self.name(t.token_id), t.logprob)
        return top

    def build(self, token_ids: list[int], logprobs: list, prompt_first: bool = False) -> dict:
        """`prompt_first`: the first token is a prompt's first, with no logprob (null)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        lps = ([None] if prompt_first else []) + list(logprobs)
        for token_id, lp in zip(token_ids, lps):
            out["tokens"].append(self.name(token_id))
            out["token_logprobs"].append(lp.logprob if lp is not None else None)
            out["top_logprobs"].append(self._top(lp) if lp is not None else None)
            out["text_offset"].append(self.offset)
            self.offset += len(self.model.token_string(token_id))  # offsets into the text, named or not
        return out

    @staticmethod
    def merge(a: dict | None, b: dict) -> dict:
        if a is None:
            return b
        return {k: a[k] + b[k] for k in a}


def prompt_logprobs_entries(model: ServedModel, logprobs: list, top_n: int) -> list:
    """vLLM's `prompt_logprobs`: null for the prompt's first token, then per token an object by
    token id (as a string) of {"logprob", "rank", "decoded_token"}: the prompt's own token
    first, then the top_n likeliest (ranks 1..top_n); -inf as -9999.0, vLLM's clamp (JSON has
    no infinity)."""
    def one(token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": model.token_string(token_id)}

    out: list = [None]
    for lp in logprobs:
        entry = {str(lp.token_id): one(lp.token_id, lp.logprob, lp.rank or None)}
        for rank, t in enumerate(lp.top[:top_n], 1):
            entry.setdefault(str(t.token_id), one(t.token_id, t.logprob, rank))
        out.append(entry)
    return out


def token_namer(model: ServedModel, as_ids: bool):
    """How logprobs name a token: its text, or with vLLM's return_tokens_as_token_ids
    "token_id:<id>" (a token that is part of a UTF-8 character has no text of its own)."""
    return (lambda token_id: f"token_id:{token_id}") if as_ids else model.token_string


def chat_logprobs(model: ServedModel, token_ids: list[int], logprobs: list, top_n: int,
                  as_ids: bool = False) -> dict:
    """Engines send the sampled token's logprob plus the other top ones; OpenAI's top_logprobs
    are the n most likely, the sampled token among them when it is. `bytes` are those of the
    name shown (vLLM's rule, also for token_id:<id> names)."""
    name = token_namer(model, as_ids)
    content = []
    for token_id, lp in zip(token_ids, logprobs):
        s = name(token_id)
        ranked = sorted([(lp.logprob, token_id), *((t.logprob, t.token_id) for t in lp.top
                                                    if t.token_id != token_id)], reverse=True)[:top_n]
        top = [{"token": (ts := name(t)), "logprob": v, "bytes": list(ts.encode())}
               for v, t in ranked]
        content.append({"token": s, "logprob": lp.logprob, "bytes": list(s.encode()), "top_logprobs": top})
    return {"content": content}


def completion_chunk(request_id: str, created: int, model: str, index: int, text: str,
                     logprobs: dict | None, finish_reason: str | None, stop_reason=None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish_reason, "stop_reason": stop_reason}]}


def chat_chunk(request_id: str, created: int, model: str, index: int, delta: dict,
               logprobs: dict | None, finish_reason: str | None, stop_reason=None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish_reason, "stop_reason": stop_reason}]}


def usage_chunk(request_id: str, created: int, model: str, obj: str, usage_: dict) -> dict:
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage_}
