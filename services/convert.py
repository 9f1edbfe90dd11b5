"""protobuf <-> engine dataclasses: the one module that imports both."""
from __future__ import annotations

import math

from engine.request import InvalidRequestError, SamplingParams
from engine.structured_output.params import StructuredOutputsParams
from engine.thinking_budget import ThinkingBudget
from services.api.pdserve.v1 import pdserve_pb2 as pb


# What an unset (0) max_tokens means at the public Generate front, capped by the room left.
DEFAULT_MAX_TOKENS = 16
# The SamplingParams fields with presence on the wire that a generation config gives defaults
# to, and what each reads as when unset.
NEUTRAL = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0, "repetition_penalty": 1.0}
INT32 = (-(1 << 31), (1 << 31) - 1)
INT64 = (-(1 << 63), (1 << 63) - 1)
FLOAT32_MAX = 3.4028234663852886e38


def sampling_kwargs(p: pb.SamplingParams) -> dict:
    """SamplingParams keyword arguments, with proto3's zeros read as "unset" where zero is not a
    usable value: max_tokens 0 is None (the caller's default), top_p 0 is 1.0; temperature 0 is
    greedy. Fields left unset read as their neutral values (the router's Generate front puts the
    model's defaults over them). Text stop strings: the router cuts the text at them; a decode or colocated engine
    stops generating where it finds one too (a prefill's one token is the router's to judge)."""
    return dict(
        max_tokens=p.max_tokens or None, temperature=p.temperature, top_p=p.top_p or 1.0,
        top_k=p.top_k, min_p=p.min_p, seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos, min_tokens=p.min_tokens,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens, cache_salt=p.cache_salt or None,
        lora_name=p.lora_name or None, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        logit_bias=dict(p.logit_bias), bad_words_token_ids=tuple(tuple(w.ids) for w in p.bad_words_token_ids),
        resumed_tokens=p.resumed_tokens,
        stream_interval=p.stream_interval if p.HasField("stream_interval") else None,
        allowed_token_ids=tuple(p.allowed_token_ids),
        thinking_budget=thinking_from_proto(p.thinking_budget) if p.HasField("thinking_budget") else None,
        structured_outputs=structured_from_proto(p.structured_outputs) if p.HasField("structured_outputs") else None)


def structured_from_proto(so: pb.StructuredOutputs) -> StructuredOutputsParams:
    kind = so.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_outputs needs one of json, json_object, regex, choice, grammar")
    value = list(so.choice.choices) if kind == "choice" else getattr(so, kind)
    return StructuredOutputsParams(**{kind: value}, backend=so.backend or "auto",
                                   disable_any_whitespace=so.disable_any_whitespace,
                                   reasoning_end=tuple(so.reasoning_end_token_ids))


def thinking_from_proto(t: pb.ThinkingBudget) -> ThinkingBudget:
    return ThinkingBudget(budget=t.budget, end=tuple(t.end_token_ids), start=tuple(t.start_token_ids),
                          starts_in_reasoning=t.starts_in_reasoning, forced=tuple(t.forced_token_ids))


def thinking_to_proto(t: ThinkingBudget) -> pb.ThinkingBudget:
    return pb.ThinkingBudget(budget=t.budget, end_token_ids=list(t.end), start_token_ids=list(t.start),
                             starts_in_reasoning=t.starts_in_reasoning,
                             forced_token_ids=list(t.forced) if t.forced != t.end else [])


def structured_to_proto(s: StructuredOutputsParams) -> pb.StructuredOutputs:
    so = pb.StructuredOutputs(backend=s.backend, disable_any_whitespace=s.disable_any_whitespace,
                              reasoning_end_token_ids=list(s.reasoning_end))
    if s.kind == "choice":
        so.choice.choices.extend(s.choice)
    else:
        setattr(so, s.kind, getattr(s, s.kind))
    return so


def sampling_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Validated SamplingParams; max_tokens must be set (the router always sets it)."""
    kwargs = sampling_kwargs(p)
    if kwargs["max_tokens"] is None:
        raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {p.max_tokens}")
    return SamplingParams(**kwargs)


def check_wire_ranges(s: SamplingParams) -> None:
    """Every value fits its protobuf field (int32, int64, finite float32): clients send JSON
    integers of any size, and protobuf's own range error would be a bare ValueError."""
    def check(name: str, value, bounds: tuple[int, int]) -> None:
        if value is not None and not bounds[0] <= value <= bounds[1]:
            raise InvalidRequestError(f"{name} must be in [{bounds[0]}, {bounds[1]}], got {value}")

    for name in ("max_tokens", "top_k", "min_tokens", "logprobs", "prompt_logprobs", "resumed_tokens",
                 "stream_interval"):
        check(name, getattr(s, name), INT32)
    check("seed", s.seed, INT64)
    for t in s.stop_token_ids:
        check("stop_token_ids", t, INT32)
    for t in s.allowed_token_ids:
        check("allowed_token_ids", t, INT32)
    if s.thinking_budget is not None:
        check("thinking_token_budget", s.thinking_budget.budget, INT32)
        for t in s.thinking_budget.token_ids():
            check("thinking budget token ids", t, INT32)
    for t, _ in s.logit_bias:
        check("logit_bias", t, INT32)
    for t in (t for word in s.bad_words_token_ids for t in word):
        check("bad_words", t, INT32)
    for name in ("temperature", "top_p", "min_p"):
        value = getattr(s, name)
        if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
            raise InvalidRequestError(f"{name} must be a finite number, got {value}")


def sampling_to_proto(s: SamplingParams) -> pb.SamplingParams:
    check_wire_ranges(s)
    try:
        return _sampling_to_proto(s)
    except (ValueError, TypeError) as e:  # a range the check above missed: still the client's input
        raise InvalidRequestError(f"sampling parameters out of range: {e}") from None


def _sampling_to_proto(s: SamplingParams) -> pb.SamplingParams:
    p = pb.SamplingParams(max_tokens=s.max_tokens, stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
                          min_tokens=s.min_tokens, stop=list(s.stop),
                          include_stop_str_in_output=s.include_stop_str_in_output,
                          skip_special_tokens=s.skip_special_tokens)
    for name, neutral in NEUTRAL.items():  # unset reads as neutral: sent only where it differs
        if getattr(s, name) != neutral:
            setattr(p, name, getattr(s, name))
    if s.seed is not None:
        p.seed = s.seed
    if s.logprobs is not None:
        p.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        p.prompt_logprobs = s.prompt_logprobs
    if s.cache_salt is not None:
        p.cache_salt = s.cache_salt
    if s.lora_name is not None:
        p.lora_name = s.lora_name
    p.logit_bias.update(s.logit_bias)
    p.bad_words_token_ids.extend(pb.TokenIds(ids=word) for word in s.bad_words_token_ids)
    p.resumed_tokens = s.resumed_tokens
    if s.stream_interval is not None:
        p.stream_interval = s.stream_interval
    p.allowed_token_ids.extend(s.allowed_token_ids)
    if s.thinking_budget is not None:
        p.thinking_budget.CopyFrom(thinking_to_proto(s.thinking_budget))
    if s.structured_outputs is not None:
        p.structured_outputs.CopyFrom(structured_to_proto(s.structured_outputs))
    return p


def token_logprob(token_id: int, entry: dict[int, float], rank: int = 0) -> pb.TokenLogprob:
    """An engine logprob entry ({chosen: lp, top ids: lp...}) as a TokenLogprob; `rank`: a
    prompt token's rank in its distribution (0: not computed)."""
    return pb.TokenLogprob(token_id=token_id, logprob=entry[token_id], rank=rank,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in entry.items() if t != token_id]
                           if len(entry) > 1 else [])


def prompt_token_logprobs(prompt: list[int], out) -> list[pb.TokenLogprob]:
    """A RequestOutput's prompt logprobs (one per prompt token after the first), with their ranks."""
    ranks = out.prompt_logprob_ranks or [0] * len(out.prompt_logprobs)
    return [token_logprob(t, e, r) for t, e, r in zip(prompt[1:], out.prompt_logprobs, ranks)]


def load_report(stats: dict, engine_id: str, role: str, block_size: int, max_model_len: int,
                max_num_batched_tokens: int) -> pb.LoadReport:
    return pb.LoadReport(
        engine_id=engine_id, role=role, num_running=stats.get("num_running", 0),
        num_waiting=stats.get("num_waiting", 0), kv_cache_usage=stats.get("kv_cache_usage", 0.0),
        num_pinned_blocks=stats.get("num_pinned_blocks", 0), num_blocks=stats.get("num_blocks", 0),
        block_size=block_size, outstanding_tokens=stats.get("outstanding_tokens", 0),
        max_model_len=max_model_len, kv_events_endpoint=stats.get("kv_events_endpoint", ""),
        kv_events_replay_endpoint=stats.get("kv_events_replay_endpoint", ""),
        kv_events_epoch=stats.get("kv_events_epoch", 0),
        max_num_batched_tokens=max_num_batched_tokens)
