"""OpenAI request bodies (/v1/completions, /v1/chat/completions) -> prompts ready to dispatch."""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field

from engine.thinking_budget import ThinkingBudget
from services.convert import INT32
from services.router.errors import bad_request, unsupported
from services.router.sampling import (PreparedPrompt, RequestLimits, bad_words_token_ids, logprobs_count,
                                      prepare)
from services.router.served_model import ServedModel
from services.router.structured_outputs import FIELDS as STRUCTURED_FIELDS, parse_structured_outputs
from services.router.tool_calls import KEEPS_SPECIAL_TOKENS, ToolPlan, parse_tools

logger = logging.getLogger(__name__)

_KINDS = {"int": ((int,), "an integer"), "number": ((int, float), "a number"), "bool": ((bool,), "a boolean"),
          "str": ((str,), "a string"), "list": ((list,), "an array"), "dict": ((dict,), "an object")}

COMMON_FIELDS = {
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "stop", "stop_token_ids", "ignore_eos", "min_tokens", "stream", "stream_options", "n", "best_of",
    "user", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "include_stop_str_in_output", "skip_special_tokens", "use_beam_search", "request_id", "cache_salt",
    "bad_words", "stream_interval", "priority", "return_token_ids", "return_tokens_as_token_ids",
    "truncate_prompt_tokens", "allowed_token_ids", "thinking_token_budget", "prompt_logprobs",
    "spaces_between_special_tokens"} | STRUCTURED_FIELDS
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "logprobs", "suffix", "add_special_tokens", "truncation_side"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "logprobs", "top_logprobs", "add_generation_prompt", "continue_final_message",
    "chat_template", "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "include_reasoning", "add_special_tokens", "truncation_side", "reasoning_effort", "documents", "echo"}
UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                      "Refused request with untrusted chat template.")  # vLLM's words


@dataclass
class ParsedRequest:
    model: str
    # One engine request per sample: prompt i's samples are prompts[i * best_of:(i + 1) * best_of].
    prompts: list[PreparedPrompt]
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # every streamed chunk carries its choice's usage so far
    echo: bool = False
    echo_only: bool = False  # max_tokens 0 with echo: the prompt (and its logprobs) only
    logprobs: int | None = None  # top logprobs per token (chat: top_logprobs once logprobs is true)
    ignored_fields: list[str] = field(default_factory=list)
    n: int = 1  # choices per prompt
    best_of: int = 1  # samples per prompt (>= n): the n of highest cumulative logprob are the choices
    tools: ToolPlan | None = None  # chat with tools (tool_choice other than "none")
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    # Chat under --reasoning-parser: whether the output starts inside the reasoning block (None:
    # no parser), and vLLM's include_reasoning (false: the reasoning is dropped from the answer).
    reasoning_starts: bool | None = None
    include_reasoning: bool = True
    chat_echo: str = ""  # chat's echo: the last message's content, put before each answer's content
    # vLLM's prompt_logprobs: top-n per prompt token shown in the answer (None: not shown).
    prompt_logprobs: int | None = None


class Body:
    """Typed access to a JSON object; remembers the fields it does not know."""

    def __init__(self, body, known: set[str]) -> None:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        self.body = body
        self.ignored = sorted(k for k in body if k not in known)

    def get(self, name: str, kind: str, default=None):
        value = self.body.get(name)
        if value is None:
            return default
        types, what = _KINDS[kind]
        if isinstance(value, bool) and kind != "bool" or not isinstance(value, types):
            raise bad_request(f"{name} must be {what}, got {type(value).__name__}: {value!r:.40}", name)
        if kind != "number":
            return value
        try:
            return float(value)
        except OverflowError:  # an integer beyond any float
            raise bad_request(f"{name} is out of range", name) from None


def _check_model(model: ServedModel, b: Body) -> str:
    """The name answers carry (ServedModel.answer_name); 404 for a model not served."""
    name = b.get("model", "str", model.name)
    model.require_name(name)
    return model.answer_name(name)


def _unsupported_features(b: Body) -> None:
    if b.get("use_beam_search", "bool", False):
        raise unsupported("beam search", "use_beam_search")


def _samples(b: Body, limits: RequestLimits, stream: bool, best_of_allowed: bool) -> tuple[int, int]:
    """(n, best_of), as OpenAI checks them; both capped by --max-n."""
    n = b.get("n", "int", 1)
    if not 1 <= n <= limits.max_n:
        raise bad_request(f"n must be in [1, {limits.max_n}] (--max-n), got {n}", "n")
    best_of = b.get("best_of", "int")
    if best_of is None or best_of == n:
        return n, n
    if not best_of_allowed:
        raise unsupported("best_of (a /v1/completions parameter)", "best_of")
    if best_of < n:
        raise bad_request(f"best_of must be greater than or equal to n, got best_of={best_of} and n={n}",
                          "best_of")
    if best_of > limits.max_n:
        raise bad_request(f"best_of must be at most {limits.max_n} (--max-n), got {best_of}", "best_of")
    if stream:
        raise bad_request("best_of greater than n cannot be streamed: the choices are known only once "
                          "every sample is complete", "best_of")
    return n, best_of


def _logit_bias(b: Body) -> dict[int, float]:
    """OpenAI's logit_bias: JSON object keys are strings, token ids in them."""
    out = {}
    for key, value in b.get("logit_bias", "dict", {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r:.40}", "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_request(f"logit_bias values must be numbers, got {value!r:.40}", "logit_bias")
        try:
            out[token] = float(value)
        except OverflowError:
            raise bad_request("logit_bias values must be in [-100, 100]", "logit_bias") from None
    return out


def _bad_words(b: Body, model: ServedModel) -> tuple[tuple[int, ...], ...]:
    words = b.body.get("bad_words")
    if words is None:
        return ()
    if isinstance(words, str):
        words = [words]
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise bad_request("bad_words must be a string or an array of strings", "bad_words")
    return bad_words_token_ids(model, words)


def _per_sample(prompt_fn, n: int, knobs: dict) -> list[PreparedPrompt]:
    """`prompt_fn(knobs)` for each of n samples; a seeded request's sample i has seed + i, so the
    samples differ and the same request gives the same ones again (vLLM's rule)."""
    seed = knobs.get("seed")
    return [prompt_fn(knobs if seed is None or i == 0 else {**knobs, "seed": seed + i}) for i in range(n)]


def _stop(b: Body) -> tuple[str, ...]:
    stop = b.body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise bad_request("stop must be a string or an array of strings", "stop")


def _knobs(b: Body, model: ServedModel, tool_schema: str | None = None) -> dict:
    ids = b.get("stop_token_ids", "list", [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request("stop_token_ids must be an array of integers", "stop_token_ids")
    # vLLM's spaces_between_special_tokens: a slow tokenizer's option; every tokenizer here is a
    # fast one (tokenizer.json), where it changes nothing, as in vLLM's fast detokenizer. Checked.
    b.get("spaces_between_special_tokens", "bool")
    d = model.sampling_defaults  # the model's (vLLM's --generation-config), then OpenAI's
    knobs = dict(temperature=b.get("temperature", "number", d.get("temperature", 1.0)),
                 top_p=b.get("top_p", "number", d.get("top_p", 1.0)),
                 top_k=b.get("top_k", "int", d.get("top_k", 0)), min_p=b.get("min_p", "number", d.get("min_p", 0.0)),
                 seed=b.get("seed", "int"), stop=_stop(b), stop_token_ids=tuple(ids),
                 ignore_eos=b.get("ignore_eos", "bool", False), min_tokens=b.get("min_tokens", "int", 0),
                 include_stop_str_in_output=b.get("include_stop_str_in_output", "bool", False),
                 skip_special_tokens=b.get("skip_special_tokens", "bool", True),
                 cache_salt=b.get("cache_salt", "str"), lora_name=model.lora_of(b.get("model", "str")),
                 presence_penalty=b.get("presence_penalty", "number", d.get("presence_penalty", 0.0)),
                 frequency_penalty=b.get("frequency_penalty", "number", d.get("frequency_penalty", 0.0)),
                 repetition_penalty=b.get("repetition_penalty", "number", d.get("repetition_penalty", 1.0)),
                 logit_bias=_logit_bias(b), bad_words_token_ids=_bad_words(b, model),
                 stream_interval=b.get("stream_interval", "int"),
                 allowed_token_ids=_allowed_token_ids(b),
                 structured_outputs=parse_structured_outputs(b.body, tool_schema))
    return knobs


def _allowed_token_ids(b: Body) -> tuple[int, ...]:
    """vLLM's allowed_token_ids: a non-empty array of token ids (outside the vocabulary: 400)."""
    ids = b.get("allowed_token_ids", "list")
    if ids is None:
        return ()
    if not _is_token_ids(ids):
        raise bad_request("allowed_token_ids must be a non-empty array of token ids", "allowed_token_ids")
    return tuple(ids)


def _thinking_budget(b: Body, model: ServedModel) -> int | None:
    """vLLM's thinking_token_budget: reasoning tokens allowed before the engine forces the end of
    the reasoning (-1 or absent: no budget). Needs --reasoning-parser, which names the markers."""
    budget = b.get("thinking_token_budget", "int")
    if budget is None or budget == -1:
        return None
    if budget < 0:
        raise bad_request("thinking_token_budget must be a non-negative integer or -1 for unlimited, "
                          f"got {budget}", "thinking_token_budget")
    if model.reasoning_parser is None:
        raise bad_request("thinking_token_budget needs a reasoning model: this router runs without "
                          "--reasoning-parser, so it cannot tell reasoning from the answer", "thinking_token_budget")
    return budget


def _with_thinking_budget(knobs: dict, budget: int | None, model: ServedModel, prompt_text: str) -> dict:
    """knobs with the engine's ThinkingBudget for a prompt whose text is `prompt_text`: the
    output starts in reasoning as the parser reads the prompt (an unclosed <think>, or a model
    that thinks unprompted); otherwise the reasoning starts where the output opens it."""
    if budget is None:
        return knobs
    starts = model.reasoning_parser.starts_in_reasoning(prompt_text)
    return {**knobs, "thinking_budget": ThinkingBudget(budget, end=model.reasoning_end_ids,
                                                       start=model.reasoning_start_ids, starts_in_reasoning=starts,
                                                       forced=model.reasoning_forced_ids)}


def _prompt_logprobs(b: Body, stream: bool, model: ServedModel, limits: RequestLimits) -> int | None:
    """vLLM's prompt_logprobs: the top-n logprobs of each prompt token, in the answer (not
    streamed, vLLM's rule: a stream may only ask for 0, and is shown none); -1: the vocabulary."""
    n = b.get("prompt_logprobs", "int")
    if n is None:
        return None
    if stream and n != 0:
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    n = logprobs_count(n, model, limits, "prompt_logprobs", "prompt")
    return None if stream else n


def _stream_flags(b: Body) -> tuple[bool, bool, bool]:
    """stream; include_usage (a last chunk with the usage); vLLM's continuous_usage_stats (with
    include_usage: every chunk carries its choice's usage so far)."""
    stream = b.get("stream", "bool", False)
    options = b.get("stream_options", "dict", {})
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name, False)
        if not isinstance(value, bool):
            raise bad_request(f"stream_options.{name} must be a boolean", "stream_options")
        flags.append(value)
    include_usage = stream and flags[0]
    return stream, include_usage, include_usage and flags[1]


def _token_id_flags(b: Body) -> dict:
    return {"return_token_ids": b.get("return_token_ids", "bool", False),
            "tokens_as_ids": b.get("return_tokens_as_token_ids", "bool", False)}


def _unwatched_interval(knobs: dict, stream: bool, limits: RequestLimits) -> None:
    """A request the client does not stream gets its tokens upstream at least
    --non-streaming-interval a message (vLLM answers it once, at the end): only the router reads
    them, and each message costs the router and the engine's service CPU. A text stop string
    stops the decode where it matches (the engine looks for it too), not an interval later."""
    if not stream and limits.non_streaming_interval > 1:
        knobs["stream_interval"] = max(knobs["stream_interval"] or 1, limits.non_streaming_interval)


def _priority(b: Body) -> int:
    """vLLM's request priority (lower is sooner): the engines take a value other than 0 only
    under --scheduling-policy priority, and refuse it (400) otherwise."""
    value = b.get("priority", "int", 0)
    if not INT32[0] <= value <= INT32[1]:
        raise bad_request(f"priority must be in [{INT32[0]}, {INT32[1]}], got {value}", "priority")
    return value


def _truncation(b: Body, model: ServedModel):
    """vLLM's truncate_prompt_tokens and truncation_side: ids -> the prompt's last k tokens (or
    with truncation_side "right" its first k; -1: the model's context); None: no truncation (a
    prompt too long for the context is a 400)."""
    k = b.get("truncate_prompt_tokens", "int")
    side = b.get("truncation_side", "str", "left")
    if side not in ("left", "right"):
        raise bad_request(f"truncation_side must be 'left' or 'right', got {side!r}", "truncation_side")
    if k is None:
        return None
    if k == -1:
        k = model.max_model_len
    if not 1 <= k <= model.max_model_len:
        raise bad_request(f"truncate_prompt_tokens must be -1 or in [1, max_model_len = {model.max_model_len}], "
                          f"got {k}", "truncate_prompt_tokens")
    return (lambda ids: ids[-k:]) if side == "left" else (lambda ids: ids[:k])


def _max_tokens(b: Body) -> int | None:
    value = b.get("max_completion_tokens", "int")
    return value if value is not None else b.get("max_tokens", "int")


def _is_token_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def completion_prompts(raw, model: ServedModel, add_special_tokens: bool, max_prompts: int,
                       truncate=None) -> list[tuple]:
    """prompt: a string, a list of strings, a list of token ids or a list of token-id lists
    -> [(token ids, the text or None)]; `truncate` (from _truncation) cuts each prompt's ids (a
    text cut short is dropped: an echo shows the tokens kept)."""
    if truncate is None:  # a text too long for the context under any tokenization is refused unread
        encode = lambda text: model.encode_prompt(text, "prompt", add_special_tokens=add_special_tokens)  # noqa: E731
    else:
        encode = lambda text: model.encode(text, add_special_tokens=add_special_tokens)  # noqa: E731
    if isinstance(raw, str):
        raw = [raw]
    elif _is_token_ids(raw):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise bad_request("prompt must be a string, an array of strings, an array of token ids or an "
                          "array of token-id arrays (and not empty)", "prompt")
    if len(raw) > max_prompts:
        raise bad_request(f"prompt has {len(raw)} items; at most {max_prompts} are allowed per request "
                          "(--max-prompts-per-request)", "prompt")
    out = []
    for item in raw:
        if isinstance(item, str):
            out.append((encode(item), item))
        elif _is_token_ids(item):
            out.append((item, None))
        else:
            raise bad_request("each prompt in the array must be a string or an array of token ids, "
                              "all of one kind", "prompt")
    if truncate is not None:
        out = [(kept, text if len(kept) == len(ids) else None) for ids, text in out for kept in [truncate(ids)]]
    return out


def parse_completion(body, model: ServedModel, limits: RequestLimits) -> ParsedRequest:
    b = Body(body, COMPLETION_FIELDS)
    name = _check_model(model, b)
    _unsupported_features(b)
    if b.get("suffix", "str"):
        raise unsupported("suffix", "suffix")
    if "prompt" not in b.body:
        raise bad_request("prompt is required", "prompt")
    echo = b.get("echo", "bool", False)
    logprobs = b.get("logprobs", "int")
    if logprobs is not None:
        logprobs = logprobs_count(logprobs, model, limits, "logprobs")
    max_tokens = _max_tokens(b)
    echo_only = echo and max_tokens == 0
    if echo_only:
        max_tokens = 1  # one token is computed (the engines need one) and dropped
    knobs = _knobs(b, model)
    stream, include_usage, continuous_usage = _stream_flags(b)
    n, best_of = _samples(b, limits, stream, best_of_allowed=True)
    _unwatched_interval(knobs, stream, limits)
    # best_of ranks the samples by their logprobs: the engines send them even when not shown.
    knobs["logprobs"] = logprobs if best_of == n or logprobs is not None else 0
    # vLLM's: prompt_logprobs shown when asked for, or with echo and logprobs (echo's logprobs are
    # the prompt's); the engines compute the larger top-n of the two.
    shown = _prompt_logprobs(b, stream, model, limits)
    if shown is None and echo:
        shown = logprobs
    knobs["prompt_logprobs"] = max((v for v in (shown, logprobs if echo else None) if v is not None), default=None)
    shown = None if stream else shown  # echo's logprobs stream; the prompt_logprobs list does not
    raw = completion_prompts(b.body["prompt"], model, b.get("add_special_tokens", "bool", True),
                             limits.max_prompts_per_request, _truncation(b, model))
    _check_fan_out(len(raw), best_of, limits)
    priority = _priority(b)
    budget = _thinking_budget(b, model)
    prompts = [p for ids, text in raw for p in _per_sample(
        lambda k: prepare(model, ids, k, max_tokens=max_tokens, default_max_tokens=16, limits=limits, text=text,
                          priority=priority),
        best_of, _with_thinking_budget(knobs, budget, model, text if text is not None or budget is None
                                         else model.decode(ids)))]
    return ParsedRequest(name, prompts, stream, include_usage, continuous_usage, echo, echo_only, logprobs,
                         b.ignored, n, best_of, **_token_id_flags(b), prompt_logprobs=shown)


def _check_fan_out(num_prompts: int, best_of: int, limits: RequestLimits) -> None:
    if num_prompts * best_of > limits.max_prompts_per_request:
        raise bad_request(f"{num_prompts} prompts of {best_of} samples each are {num_prompts * best_of} "
                          f"generations; at most {limits.max_prompts_per_request} are allowed per request "
                          "(--max-prompts-per-request)", "n" if num_prompts == 1 else "prompt")


def chat_messages(raw) -> list[dict]:
    """Content as a string or a list of text parts (joined with newlines, as vLLM does)."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty array", "messages")
    out = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role", "messages")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise unsupported(f"content part of type {kind!r} (only text parts are)", "messages")
                if not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}]: a text part needs a string text", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or an array of text parts",
                              "messages")
        msg = {**msg, "content": content if content is not None else ""}
        if msg["role"] == "assistant" and msg.get("tool_calls") is not None:
            msg["tool_calls"] = _template_tool_calls(msg["tool_calls"], i)
            if not msg["tool_calls"]:
                del msg["tool_calls"]  # none: the template's plain assistant turn
        out.append(msg)
    return out


def _template_tool_calls(calls, i: int) -> list[dict]:
    """An assistant's tool calls as chat templates take them (vLLM's rule, after transformers'):
    `arguments` a mapping, not OpenAI's JSON text, so a template can iterate it (Qwen3-Coder's) or
    write it once as JSON (Llama 3's), not as an escaped string. Arguments that are not a JSON
    object become {} with a warning: they stay in the conversation's history, and a 400 would fail
    every later turn of it."""
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be an array", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise bad_request(f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", \"function\": "
                              "{\"name\", \"arguments\"}}", "messages")
        arguments = fn.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(arguments, dict):
            logger.warning("messages[%d].tool_calls[%d] (%.100r): arguments are not a JSON object; the template "
                           "gets {}", i, j, fn.get("name"))
            arguments = {}
        out.append({**call, "function": {**fn, "arguments": arguments}})
    return out


def _chat_template(b: Body, limits: RequestLimits) -> str | None:
    """A template sent with the request (vLLM's `chat_template`, or transformers' keyword in
    chat_template_kwargs): arbitrary code for the renderer, so only with the operator's consent."""
    template = b.get("chat_template", "str")
    in_kwargs = b.get("chat_template_kwargs", "dict", {}).get("chat_template")
    if template is None and in_kwargs is None:
        return None
    if not limits.trust_request_chat_template:
        raise bad_request(UNTRUSTED_TEMPLATE, "chat_template" if template is not None else "chat_template_kwargs",
                          "untrusted_chat_template")
    template = template if template is not None else in_kwargs
    if not isinstance(template, str):
        raise bad_request("chat_template must be a string", "chat_template_kwargs")
    return template


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _template_kwargs(b: Body) -> dict:
    """chat_template_kwargs, with vLLM's reasoning_effort for templates that read it (and, unless
    the client set enable_thinking, thinking on for any effort but "none")."""
    kwargs = dict(b.get("chat_template_kwargs", "dict", {}))
    effort = b.get("reasoning_effort", "str")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                              "reasoning_effort")
        kwargs["reasoning_effort"] = effort
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs


def _documents(b: Body) -> list[dict] | None:
    """vLLM's documents (RAG): objects of strings, for templates that render them."""
    docs = b.get("documents", "list")
    if docs is not None and not all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values())
                                    for d in docs):
        raise bad_request("documents must be an array of objects of strings (e.g. title, text)", "documents")
    return docs


@dataclass
class RenderedChat:
    messages: list[dict]
    add_generation_prompt: bool
    tools: ToolPlan | None
    text: str  # the chat template's output for them


def _render_chat(b: Body, model: ServedModel, limits: RequestLimits, generating: bool = True) -> RenderedChat:
    """The chat template's text for a chat body, as chat completions and /tokenize both render
    it: tools, template kwargs (reasoning_effort), a trusted request template, documents.
    `generating` False (/tokenize, count_tokens): nothing is generated, so tool_choice "auto"
    needs no --enable-auto-tool-choice."""
    tools = parse_tools(b.body, model.tool_call_parser, model.auto_tool_choice or not generating)
    messages = chat_messages(b.body.get("messages"))
    add_generation = b.get("add_generation_prompt", "bool", True)
    continue_final = b.get("continue_final_message", "bool", False)
    if add_generation and continue_final:
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                          "continue_final_message")
    text = model.chat_text(messages, add_generation, continue_final, _template_kwargs(b), _chat_template(b, limits),
                           tools=list(tools.tools) if tools is not None else None, documents=_documents(b))
    return RenderedChat(messages, add_generation, tools, text)


def parse_chat(body, model: ServedModel, limits: RequestLimits) -> ParsedRequest:
    b = Body(body, CHAT_FIELDS)
    name = _check_model(model, b)
    _unsupported_features(b)
    chat = _render_chat(b, model, limits)
    tools, messages = chat.tools, chat.messages
    want_logprobs = b.get("logprobs", "bool", False)
    top = b.get("top_logprobs", "int")
    if top is not None and not want_logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if top is not None:
        top = logprobs_count(top, model, limits, "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    # vLLM's echo: the last message's content comes back first when it has the answer's role (the
    # assistant's, or with no generation prompt, the last message's own).
    echo_role = "assistant" if chat.add_generation_prompt else messages[-1]["role"]
    chat_echo = messages[-1]["content"] if b.get("echo", "bool", False) and messages[-1]["role"] == echo_role else ""
    truncate = _truncation(b, model)
    prompt_text = chat.text
    # The template writes the special tokens it wants (BOS included), as in vLLM; add_special_tokens
    # adds the tokenizer's on top.
    add_special = b.get("add_special_tokens", "bool", False)
    if truncate is None:
        ids = model.encode_prompt(prompt_text, "messages", add_special_tokens=add_special)
    else:  # the template's text whatever its length, then the tokens kept
        ids = truncate(model.encode(prompt_text, add_special_tokens=add_special))
    parser = model.reasoning_parser
    knobs = _knobs(b, model, tools.schema(b.get("parallel_tool_calls", "bool", True)) if tools else None)
    knobs["logprobs"] = logprobs
    if tools is not None and tools.mode == "auto" and tools.parser in KEEPS_SPECIAL_TOKENS:
        knobs["skip_special_tokens"] = False  # the calls' markers are special tokens: their text must show
    reasoning_starts = _reasoning_starts(parser, prompt_text, knobs, model)
    knobs = _with_thinking_budget(knobs, _thinking_budget(b, model), model, prompt_text)
    stream, include_usage, continuous_usage = _stream_flags(b)
    n, _ = _samples(b, limits, stream, best_of_allowed=False)
    _unwatched_interval(knobs, stream, limits)
    shown = _prompt_logprobs(b, stream, model, limits)
    if shown is None and b.get("echo", "bool", False) and not stream:  # vLLM's: echo shows them at top_logprobs
        shown = top if want_logprobs else None
    knobs["prompt_logprobs"] = shown
    _check_fan_out(1, n, limits)
    max_tokens = _max_tokens(b)
    priority = _priority(b)
    # No max_tokens: the model's max_new_tokens, within the room left (vLLM's rule).
    default_max = model.sampling_defaults.get("max_tokens")
    prompts = _per_sample(lambda k: prepare(model, ids, k, max_tokens=max_tokens, default_max_tokens=default_max,
                                            limits=limits, param="messages", priority=priority), n, knobs)
    return ParsedRequest(name, prompts, stream, include_usage, continuous_usage, logprobs=logprobs,
                         ignored_fields=b.ignored, **_token_id_flags(b),
                         n=n, best_of=n, tools=tools,
                         reasoning_starts=reasoning_starts,
                         include_reasoning=b.get("include_reasoning", "bool", True), chat_echo=chat_echo,
                         prompt_logprobs=shown)


def _reasoning_starts(parser, prompt_text: str, knobs: dict, model: ServedModel) -> bool | None:
    """Where the output starts, for the reasoning parser (None: no parser, or no reasoning to
    find). A structured output (response_format, a constrained tool call) on an output that
    starts in reasoning applies after it, as vLLM's does: the engine gets the end marker's token
    ids and starts the grammar once they are out. On an output that does not start in reasoning
    the grammar holds from the first token, and the answer is all content."""
    if parser is None:
        return None
    starts = parser.starts_in_reasoning(prompt_text)
    so = knobs["structured_outputs"]
    if so is None:
        return starts
    if not starts:
        return None
    knobs["structured_outputs"] = dataclasses.replace(so, reasoning_end=tuple(model.reasoning_end_ids))
    return True


TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "continue_final_message", "chat_template", "chat_template_kwargs", "tools", "tool_choice",
                   "parallel_tool_calls", "return_token_strs", "reasoning_effort", "documents"}


def tokenize(body, model: ServedModel, limits: RequestLimits) -> dict:
    """vLLM's POST /tokenize: a completions `prompt` (special tokens added unless
    add_special_tokens is false) or chat `messages` through the chat template, as a chat
    completion would render them (tools included; add_special_tokens defaults to false there, the
    template writing its own). No context limit: clients count a prompt before they send it."""
    b = Body(body, TOKENIZE_FIELDS)
    _check_model(model, b)
    if "messages" in b.body:
        text = _render_chat(b, model, limits, generating=False).text
        ids = model.encode(text, add_special_tokens=b.get("add_special_tokens", "bool", False))
    elif "prompt" in b.body:
        ids = model.encode(b.get("prompt", "str"), add_special_tokens=b.get("add_special_tokens", "bool", True))
    else:
        raise bad_request("prompt (a string) or messages is required", "prompt")
    pieces = model.token_pieces(ids) if b.get("return_token_strs", "bool", False) else None
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": pieces}


def detokenize(body, model: ServedModel) -> dict:
    """vLLM's POST /detokenize: token ids -> their text, special tokens kept."""
    b = Body(body, {"model", "tokens"})
    _check_model(model, b)
    ids = b.get("tokens", "list")
    if ids is None:
        raise bad_request("tokens is required", "tokens")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request("tokens must be an array of integers", "tokens")
    model.check_token_ids(ids, "tokens")
    return {"prompt": model.decode(ids)}
