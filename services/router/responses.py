"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it for chat models): the request
becomes a chat completion (instructions + input items -> messages through the chat template,
function tools, text.format -> a structured output, reasoning.effort -> the template's), and the
answer comes back as output items: the reasoning (under --reasoning-parser), the message, the
function calls; whole, or streamed as the API's typed events.

Responses are stored only with --responses-store-size N (vLLM keeps them only under
VLLM_ENABLE_RESPONSES_API_STORE): then the last N responses sent with `store` (the default) can
be read back (GET /v1/responses/{id}), deleted, and continued with `previous_response_id` (their
conversation, input and output, comes before the new input). The store is the router
process's: behind several router replicas, a conversation continues where it is stored. Without
it `store` has no effect, `previous_response_id` is a 404, and a conversation goes back whole in
`input`, as stateless clients send it.

`background: true` (with the store) answers at once with the response `queued`; the router
generates it on its own while GET /v1/responses/{id} shows it `in_progress` and then finished, and
POST /v1/responses/{id}/cancel stops it (`cancelled`, the output so far kept). Created with
`stream: true` too, its events are kept: the POST streams them, and GET ?stream=true
&starting_after=N replays them after sequence number N and follows the rest, so a client that
lost its connection picks up where it was. A background response holds its place among the
router's requests in flight (--max-concurrent-requests) until it is done."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from services.router.answer_parts import AnswerParts
from services.router.errors import RouterError, bad_request, unsupported
from services.router.generation import TextChunk, TextGenerator
from services.router.openai_format import chat_logprobs
from services.router.openai_protocol import Body, parse_chat
from services.router.openai_serving import (ADMISSION_SLOT, CLIENT_CLOSED, SSE_HEADERS, STREAM_STATUS, Choice,
                                            sse_event, stream_events)
from services.router.sampling import RequestLimits
from services.router.served_model import ServedModel
from services.router.tool_calls import arguments_object

logger = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode

# Sampling and vLLM fields that mean the same as in a chat completion, passed on as they are.
_CHAT_SAME = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "skip_special_tokens",
              "include_stop_str_in_output", "priority", "cache_salt", "chat_template_kwargs", "include_reasoning",
              "structured_outputs", "bad_words", "allowed_token_ids", "stream")
# Accepted and echoed (or without effect here), not generation's business.
_ECHOED = ("metadata", "user", "service_tier", "store", "prompt_cache_key", "safety_identifier", "max_tool_calls",
           "truncation", "top_logprobs", "include", "parallel_tool_calls", "tool_choice", "tools", "text",
           "reasoning", "instructions", "max_output_tokens", "background", "previous_response_id", "prompt")
FIELDS = {"model", "input", *_CHAT_SAME, *_ECHOED}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_INCLUDES = {LOGPROBS_INCLUDE, "reasoning.encrypted_content"}
# Chat completion parameters whose Responses names differ, for the errors a chat parse raises.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
           "reasoning_effort": "reasoning.effort", "top_logprobs": "top_logprobs"}


def stored_response_not_found(response_id: str, param: str, stored: bool = False) -> RouterError:
    why = ("" if stored else ": this server does not store responses (the router's --responses-store-size); "
           "send the conversation in input")
    return RouterError(404, f"Response with id '{response_id:.100}' not found{why}", param=param,
                       code="response_not_found")


@dataclass
class BackgroundRun:
    """A response generated in the background: its task, the response as it stands, and (created
    with stream=true) every event it has made, in order, for clients to replay."""
    response: dict
    events: list[dict] | None
    task: asyncio.Task | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # replaced at each change

    @property
    def done(self) -> bool:
        return self.response["status"] not in ("queued", "in_progress")

    def emit(self, events: list[dict]) -> None:
        if self.events is not None:
            for event in events:
                event["sequence_number"] = len(self.events)
                self.events.append(event)
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


@dataclass
class StoredResponse:
    response: dict  # the response object, as answered (a background one: as it stands)
    conversation: list[dict] | None  # its chat messages, input and output, the instructions left out;
    # None while a background response is still being generated
    run: BackgroundRun | None = None


class ResponseStore:
    """The last `size` stored responses (least recently used out first). Written on the event
    loop, read on the parsing worker threads: a lock around the dict."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, item: StoredResponse) -> None:
        """Least recently used out first, never a background response still running (those are
        bounded by the requests in flight): it is read and cancelled by its id."""
        with self._lock:
            self._items[response_id] = item
            self._items.move_to_end(response_id)
            while len(self._items) > self.size:
                old = next((k for k, v in self._items.items() if v.run is None or v.run.done), None)
                if old is None:
                    break
                del self._items[old]

    def get(self, response_id: str, param: str) -> StoredResponse:
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
        if item is None:
            raise stored_response_not_found(response_id, param, stored=True)
        return item

    def running(self, response_id: str) -> bool:
        """A background response of this id is still being generated."""
        with self._lock:
            item = self._items.get(response_id)
        return item is not None and item.run is not None and not item.run.done

    def delete(self, response_id: str) -> None:
        with self._lock:
            if self._items.pop(response_id, None) is None:
                raise stored_response_not_found(response_id, "response_id", stored=True)


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _text_parts(content, where: str) -> list[dict]:
    """An input message's content: a string, or parts of text (input_text, output_text, text,
    refusal); images, files and audio are not served here."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or an array of content parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise unsupported(f"{where}.content[{j}] of type {kind!r:.40} (only text parts are)", "input")
        if not isinstance(part.get(key), str):
            raise bad_request(f"{where}.content[{j}] needs a string {key}", "input")
        parts.append({"type": "text", "text": part[key]})
    return parts


def _joined(parts: list[dict]) -> str:
    return "\n".join(p["text"] for p in parts)


def input_messages(instructions: str | None, raw) -> tuple[list[dict], bool]:
    """(chat messages, whether to continue the last one): `instructions` as the system message,
    then the input, a string (one user message) or items: messages (typed or not), function
    calls (into the assistant message before them, as vLLM merges them), their outputs (tool
    messages) and reasoning items (the assistant message's reasoning, for templates that render
    it). A last assistant message in progress or incomplete is continued, as vLLM does."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(raw, str):
        return messages + [{"role": "user", "content": raw}], False
    if not isinstance(raw, list) or not raw:
        raise bad_request("input must be a string or a non-empty array of input items", "input")
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        prev = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer, got {role!r:.40}",
                                  "input")
            text = _joined(_text_parts(item.get("content"), where))
            if role == "assistant" and prev is not None and not prev.get("content"):
                prev["content"] = text  # after its reasoning
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{where}: a function_call needs a string {key}", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if prev is not None:
                prev.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call_output needs a string call_id", "input")
            text = output if isinstance(output, str) else _joined(_text_parts(output, where))
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                raise unsupported(f"{where}: encrypted reasoning content", "input")
            texts = item.get("content") or item.get("summary") or []
            if not isinstance(texts, list) or not all(isinstance(t, dict) and isinstance(t.get("text"), str)
                                                      for t in texts):
                raise bad_request(f"{where}: reasoning content must be an array of {{\"text\": ...}} parts",
                                  "input")
            reasoning = "\n".join(t["text"] for t in texts)
            if prev is not None and not prev.get("content") and not prev.get("tool_calls"):
                prev["reasoning_content"] = prev["reasoning"] = reasoning
            else:
                messages.append({"role": "assistant", "content": None, "reasoning": reasoning,
                                 "reasoning_content": reasoning})
        else:
            raise unsupported(f"{where}: input items of type {kind!r:.40}", "input")
    last = raw[-1]
    continue_final = (last.get("type", "message") in ("message", "reasoning") and last.get("role", "assistant") ==
                      "assistant" and last.get("status") in ("in_progress", "incomplete"))
    return messages, continue_final


def _tools(raw, choice) -> tuple[list | None, object]:
    """Responses' function tools ({type, name, parameters, ...}) and tool_choice -> chat's."""
    if raw is None:
        return None, choice
    if not isinstance(raw, list):
        raise bad_request("tools must be an array", "tools")
    tools = []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise unsupported(f"tools[{i}] of type {kind!r} (only function tools are)", "tools")
        tools.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                            "strict") if k in tool}})
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                              "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _response_format(text) -> dict | None:
    """text.format -> chat's response_format."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request('text.format must be {"type": "text"}, {"type": "json_object"} or '
                          '{"type": "json_schema", "name": ..., "schema": {...}}', "text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                   if k in fmt}}


@dataclass
class ResponsesRequest:
    parsed: object  # the chat completion's ParsedRequest
    echo: dict  # the request's fields a response object repeats
    include_logprobs: bool = False
    ignored_fields: list[str] = field(default_factory=list)
    conversation: list[dict] | None = None  # set when the response is to be stored: its messages so far

    @property
    def stream(self) -> bool:
        return self.parsed.stream

    @property
    def background(self) -> bool:
        return self.echo["background"]


def parse_responses(body, model: ServedModel, limits: RequestLimits,
                    store: ResponseStore | None = None) -> ResponsesRequest:
    b = Body(body, FIELDS)
    previous_id = b.get("previous_response_id", "str")
    history: list[dict] = []
    if previous_id is not None:
        if store is None:
            raise stored_response_not_found(previous_id, "previous_response_id")
        previous = store.get(previous_id, "previous_response_id")
        if previous.conversation is None:
            status = (previous.run or previous).response["status"]
            raise bad_request(f"Response '{previous_id:.100}' is still {status}: continue it once it is done",
                              "previous_response_id")
        history = previous.conversation
    background = b.get("background", "bool", False)
    if background and (store is None or not b.get("store", "bool", True)):
        raise bad_request("background mode needs the response stored: store must be true, and this server "
                          "must store responses (the router's --responses-store-size)"
                          if store is None else "background mode needs store: true", "background")
    if b.get("prompt", "dict") is not None:
        raise unsupported("prompt templates", "prompt")
    metadata = b.get("metadata", "dict")
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise bad_request("metadata must be an object of strings", "metadata")
    include = b.get("include", "list", [])
    unknown = [x for x in include if x not in _INCLUDES]
    if unknown:
        raise bad_request(f"include: unknown value {unknown[0]!r:.60}; this server knows "
                          f"{', '.join(sorted(_INCLUDES))}", "include")
    truncation = b.get("truncation", "str", "disabled")
    if truncation not in ("disabled", "auto"):
        raise bad_request(f"truncation must be 'auto' or 'disabled', got {truncation!r:.40}", "truncation")
    top_logprobs = b.get("top_logprobs", "int")
    include_logprobs = LOGPROBS_INCLUDE in include or top_logprobs not in (None, 0)
    if "input" not in b.body:
        raise bad_request("input is required", "input")
    messages, continue_final = input_messages(b.get("instructions", "str"), b.body["input"])
    # The previous response's conversation comes after these instructions and before this input
    # (its own instructions are not carried over: OpenAI's rule).
    split = 1 if b.get("instructions", "str") else 0
    messages = messages[:split] + history + messages[split:]
    tools, tool_choice = _tools(b.get("tools", "list"), b.body.get("tool_choice"))
    reasoning = b.get("reasoning", "dict")
    chat = {k: b.body[k] for k in _CHAT_SAME if k in b.body}
    chat.update(model=b.body.get("model"), messages=messages, add_generation_prompt=not continue_final,
                continue_final_message=continue_final)
    for key, value in (("tools", tools), ("tool_choice", tool_choice), ("response_format", _response_format(
            b.get("text", "dict"))), ("max_tokens", b.get("max_output_tokens", "int")),
                       ("parallel_tool_calls", b.get("parallel_tool_calls", "bool")),
                       ("reasoning_effort", (reasoning or {}).get("effort"))):
        if value is not None:
            chat[key] = value
    if include_logprobs:
        chat.update(logprobs=True, top_logprobs=top_logprobs or 0)
    parsed = _parse_chat(chat, model, limits, truncation == "auto")
    echo = {"instructions": b.get("instructions", "str"), "metadata": metadata, "user": b.get("user", "str"),
            "tools": b.get("tools", "list", []), "tool_choice": b.body.get("tool_choice", "auto" if tools else "none"),
            "parallel_tool_calls": b.get("parallel_tool_calls", "bool", True),
            # What it samples with: the request's, else the model's defaults, else OpenAI's.
            "temperature": parsed.prompts[0].params.temperature, "top_p": parsed.prompts[0].params.top_p,
            "max_output_tokens": b.get("max_output_tokens", "int"), "max_tool_calls": b.get("max_tool_calls", "int"),
            "previous_response_id": previous_id, "reasoning": reasoning,
            "service_tier": b.get("service_tier", "str", "auto"),
            "text": b.get("text", "dict", {"format": {"type": "text"}}),
            "truncation": truncation, "top_logprobs": top_logprobs, "background": background,
            "store": store is not None and b.get("store", "bool", True)}
    conversation = messages[split:] if echo["store"] else None
    return ResponsesRequest(parsed, echo, include_logprobs, b.ignored, conversation)


def _parse_chat(chat: dict, model: ServedModel, limits: RequestLimits, truncate: bool):
    """The chat completion for these messages. truncation "auto" (OpenAI's rule): while the
    conversation does not fit the context, its oldest items go (the system messages stay, and the
    last message always), found by bisection on how many."""
    def parse(messages: list[dict]):
        try:
            return parse_chat({**chat, "messages": messages}, model, limits)
        except RouterError as e:  # the chat parameter's name -> the Responses one
            e.param = _PARAMS.get(e.param, e.param)
            raise

    messages = chat["messages"]
    if not truncate:
        return parse(messages)
    system = [m for m in messages if m["role"] in ("system", "developer")]
    rest = [m for m in messages if m["role"] not in ("system", "developer")]

    def attempt(dropped: int):
        kept = rest[dropped:]
        while len(kept) > 1 and kept[0]["role"] == "tool":  # a tool's output without its call
            kept = kept[1:]
        try:
            return parse(system + kept)
        except RouterError as e:
            if e.code != "context_length_exceeded" or dropped == len(rest) - 1:
                raise
            return None

    lo, hi = 0, len(rest) - 1
    best = attempt(hi)  # the last message alone: fits, or the request cannot be served
    while lo < hi:
        mid = (lo + hi) // 2
        got = attempt(mid)
        if got is not None:
            best, hi = got, mid
        else:
            lo = mid + 1
    return best


class ResponseOutput:
    """Output items as the answer comes: reasoning, message text, function calls. Each step
    returns the stream events it makes (a whole response takes the items and drops them)."""

    def __init__(self, model: ServedModel, logprobs: int | None, as_ids: bool, stream: bool = False) -> None:
        self.model, self.top_logprobs, self.as_ids = model, logprobs, as_ids
        self.items: list[dict] = []
        self.open: dict | None = None  # the reasoning or message item being written
        # Streamed: function calls as they come (their arguments as written), one item each, the
        # last open until the next begins or the answer ends. Whole: the calls at the end.
        self.stream = stream
        self.streamed: dict[int, dict] = {}  # a call's index in the answer -> its item
        self.open_call: dict | None = None

    def _close(self) -> list[dict]:
        events = self._close_call()
        item, self.open = self.open, None
        if item is None:
            return events
        index, part = len(self.items) - 1, item["content"][0]
        item["status"] = "completed"
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            done = {"type": "response.reasoning_text.done", **ids, "text": part["text"]}
        else:
            done = {"type": "response.output_text.done", **ids, "text": part["text"], "logprobs": part["logprobs"]}
        return events + [done, {"type": "response.content_part.done", **ids, "part": part},
                         {"type": "response.output_item.done", "output_index": index, "item": item}]

    def left_incomplete(self) -> None:
        """The answer stopped short (cancelled, failed): what was being written is incomplete."""
        for item in (self.open, self.open_call):
            if item is not None:
                item["status"] = "incomplete"

    def _close_call(self) -> list[dict]:
        item, self.open_call = self.open_call, None
        if item is None:
            return []
        if item["status"] == "in_progress":  # complete arguments (a JSON object), or cut short
            item["status"] = "completed" if arguments_object(item["arguments"]) is not None else "incomplete"
        index = self.items.index(item)
        return [{"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                 "arguments": item["arguments"]},
                {"type": "response.output_item.done", "output_index": index, "item": item}]

    def call_deltas(self, deltas: list[dict]) -> list[dict]:
        """Streamed: a call's item opens with its name, its arguments follow as they are written."""
        if not self.stream:
            return []
        events = []
        for delta in deltas:
            fn = delta.get("function", {})
            if "id" in delta:  # a call begins: what was open before it is complete
                events += self._close()
                item = {"type": "function_call", "id": _id("fc"), "call_id": delta["id"], "name": fn["name"],
                        "arguments": "", "status": "in_progress"}
                self.items.append(item)
                self.streamed[delta["index"]] = self.open_call = item
                events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                               "item": dict(item)})
            item = self.streamed[delta["index"]]
            if fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": self.items.index(item), "delta": fn["arguments"]})
        return events

    def _ensure(self, kind: str) -> list[dict]:
        if self.open is not None and self.open["type"] == kind:
            return []
        events = self._close()
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [part], "status": "in_progress"}
        else:
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress",
                    "content": [part]}
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        events.append({"type": "response.output_item.added", "output_index": index,
                       "item": {**item, "content": []}})
        events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                       "content_index": 0, "part": dict(part)})
        return events

    def reasoning(self, text: str) -> list[dict]:
        if not text:
            return []
        events = self._ensure("reasoning")
        self.open["content"][0]["text"] += text
        events.append({"type": "response.reasoning_text.delta", "item_id": self.open["id"],
                       "output_index": len(self.items) - 1, "content_index": 0, "delta": text})
        return events

    def content(self, text: str, token_ids: list[int], logprobs: list) -> list[dict]:
        """Text of the message; the logprobs of the tokens that made it (when asked for)."""
        lps = []
        if self.top_logprobs is not None and token_ids:
            lps = chat_logprobs(self.model, token_ids, logprobs, self.top_logprobs, self.as_ids)["content"]
        if not text and not lps:
            return []
        events = self._ensure("message")
        part = self.open["content"][0]
        part["text"] += text
        part["logprobs"] += lps
        events.append({"type": "response.output_text.delta", "item_id": self.open["id"],
                       "output_index": len(self.items) - 1, "content_index": 0, "delta": text, "logprobs": lps})
        return events

    def calls(self, calls: list[dict]) -> list[dict]:
        """The answer's calls, once it is complete: those not streamed as items yet."""
        events = self._close()
        streamed = {item["call_id"] for item in self.streamed.values()}
        for call in calls:
            if call["id"] in streamed:
                continue
            fn = call["function"]
            item = {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": fn["name"],
                    "arguments": fn["arguments"], "status": "completed"}
            self.items.append(item)
            index = len(self.items) - 1
            ids = {"item_id": item["id"], "output_index": index}
            events += [{"type": "response.output_item.added", "output_index": index,
                        "item": {**item, "arguments": "", "status": "in_progress"}},
                       {"type": "response.function_call_arguments.delta", **ids, "delta": fn["arguments"]},
                       {"type": "response.function_call_arguments.done", **ids, "arguments": fn["arguments"]},
                       {"type": "response.output_item.done", "output_index": index, "item": item}]
        return events

    def finish(self) -> list[dict]:
        """Closes the open item; an answer of nothing at all is one empty message."""
        if not self.items:
            events = self._ensure("message")
            return events + self._close()
        return self._close()


class _Turn:
    """One response being generated: its chunks become output items and stream events."""

    def __init__(self, serving: "ResponsesServing", rr: ResponsesRequest, response_id: str) -> None:
        self.serving, self.rr, self.id = serving, rr, response_id
        req = rr.parsed
        self.prompt = req.prompts[0]
        self.choice = Choice(0, self.prompt, req, serving.model, chat=True)
        self.answer = AnswerParts(self.choice)
        self.out = ResponseOutput(serving.model, req.logprobs, req.tokens_as_ids, stream=req.stream)
        self.created = int(time.time())
        self.run: BackgroundRun | None = None  # set when generated in the background

    def response(self, status: str, output: list, usage: dict | None = None, error: dict | None = None) -> dict:
        rr = self.rr
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": incomplete, "model": rr.parsed.model, "output": output, "usage": usage,
                **rr.echo}

    def usage(self) -> dict:
        choice = self.choice
        prompt = len(choice.prompt.token_ids)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": choice.num_cached_tokens},
                "output_tokens": choice.num_tokens,
                "output_tokens_details": {"reasoning_tokens": choice.reasoning_tokens()},
                "total_tokens": prompt + choice.num_tokens}

    def event(self, kind: str, status: str) -> dict:
        """A lifecycle event (response.created, .queued, .in_progress) with the response as it
        stood then."""
        return {"type": kind, "response": self.response(status, [])}

    def step(self, chunk: TextChunk) -> list[dict]:
        parts = self.answer.feed(chunk)
        out = self.out
        events = out.reasoning(parts.reasoning) + out.content(parts.content, parts.token_ids, parts.logprobs)
        events += out.call_deltas(parts.call_deltas)
        if parts.calls is not None:
            events += out.calls(parts.calls) + out.finish()
        return events

    def final(self) -> tuple[dict, list[dict]]:
        """The finished response (stored when asked) and its last event."""
        status = "incomplete" if self.choice.finish_reason == "length" else "completed"
        response = self.response(status, self.out.items, self.usage())
        self.serving.keep(self.rr, response, self.run)
        return response, [{"type": f"response.{status}", "response": response}]

    def cancelled(self) -> dict:
        """Stopped where it was: the item being written is left incomplete."""
        self.out.left_incomplete()
        return self.response("cancelled", self.out.items)

    def failed(self, e: RouterError) -> tuple[dict, list[dict]]:
        """An error event, then the response failed with what it had written."""
        self.out.left_incomplete()
        response = self.response("failed", self.out.items, None, {"code": e.code or e.type, "message": e.message})
        self.serving.keep(self.rr, response, self.run)
        return response, [{"type": "error", "code": e.code or e.type, "message": e.message, "param": e.param},
                          {"type": "response.failed", "response": response}]


class ResponsesServing:
    def __init__(self, generator: TextGenerator, model: ServedModel, store_size: int = 0) -> None:
        self.generator = generator
        self.model = model
        self.store = ResponseStore(store_size) if store_size > 0 else None
        self._tasks: set[asyncio.Task] = set()

    def parse(self, body, model: ServedModel, limits: RequestLimits) -> ResponsesRequest:
        return parse_responses(body, model, limits, self.store)

    def keep(self, rr: ResponsesRequest, response: dict, run: BackgroundRun | None = None) -> None:
        """A finished response asked to be stored: it and its conversation, output included."""
        if rr.conversation is not None and self.store is not None:
            output, _ = input_messages(None, response["output"]) if response["output"] else ([], False)
            self.store.put(response["id"], StoredResponse(response, rr.conversation + output, run))

    def _stored(self, response_id: str) -> StoredResponse:
        if self.store is None:
            raise stored_response_not_found(response_id, "response_id")
        return self.store.get(response_id, "response_id")

    def stored(self, response_id: str) -> dict:
        """The response; a background one as it stands (queued, in progress, or done)."""
        item = self._stored(response_id)
        return item.run.response if item.run is not None else item.response

    async def delete(self, response_id: str) -> dict:
        """A background response still running is cancelled first."""
        run = self._stored(response_id).run
        if run is not None and not run.done:
            await self._cancel_run(run)
        self.store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(self, response_id: str) -> dict:
        """A background response stops where it is (`cancelled`, its output so far kept); one
        already done comes back as it is."""
        run = self._stored(response_id).run
        if run is None:
            raise bad_request("Only responses created with background=true can be cancelled", "response_id")
        if not run.done:
            await self._cancel_run(run)
        return run.response

    @staticmethod
    async def _cancel_run(run: BackgroundRun) -> None:
        run.task.cancel()
        await asyncio.wait([run.task])

    async def replay(self, request: web.Request, response_id: str, starting_after: int | None,
                     headers: dict) -> web.StreamResponse:
        """GET ?stream=true: a background stream's events after `starting_after`, then the rest as
        they come."""
        run = self._stored(response_id).run
        if run is None or run.events is None:
            raise bad_request("stream=true replays only responses created with background=true and stream=true",
                              "stream")
        return await self._follow(request, run, -1 if starting_after is None else starting_after, headers)

    @staticmethod
    async def _follow(request: web.Request, run: BackgroundRun, after: int, headers: dict) -> web.StreamResponse:
        response = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        await response.prepare(request)
        i = max(after + 1, 0)
        try:
            while True:
                changed = run.changed
                while i < len(run.events):
                    await response.write(sse_event(run.events[i]))
                    i += 1
                if run.done and i >= len(run.events):
                    break
                await changed.wait()
        except ConnectionResetError:  # the response goes on; the client may come back for it
            request[STREAM_STATUS] = CLIENT_CLOSED
            return response
        await response.write_eof()
        return response

    async def close(self, timeout_s: float) -> None:
        """Lets background responses finish for up to `timeout_s`, then cancels the rest."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))

    async def respond(self, request: web.Request, rr: ResponsesRequest, request_id: str,
                      headers: dict) -> web.StreamResponse:
        if rr.conversation is not None and self.store.running(request_id):
            raise RouterError(409, f"Response '{request_id:.100}' is still being generated in the background: "
                                   "give this request another X-Request-Id", param="X-Request-Id",
                              code="response_id_in_use")
        turn = _Turn(self, rr, request_id)
        chunks = self.generator.stream(request_id, turn.prompt)
        if rr.background:
            return await self._background(request, turn, chunks, headers)
        if not rr.stream:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    turn.step(chunk)
            return web.Response(body=_encode(turn.final()[0]), content_type="application/json", headers=headers)

        seq = 0

        async def send(response: web.StreamResponse, events: list[dict]) -> None:
            nonlocal seq
            for event in events:
                event["sequence_number"] = seq
                seq += 1
                await response.write(sse_event(event))

        async def run(first: TextChunk, response: web.StreamResponse) -> None:
            await send(response, [turn.event("response.created", "in_progress"),
                                  turn.event("response.in_progress", "in_progress")])
            await send(response, turn.step(first))
            async for chunk in chunks:
                await send(response, turn.step(chunk))
            await send(response, turn.final()[1])

        async def on_error(e: RouterError, response: web.StreamResponse) -> None:
            await send(response, turn.failed(e)[1])

        return await stream_events(request, request_id, headers, chunks, self.generator.metrics, run, on_error)

    async def _background(self, request: web.Request, turn: _Turn, chunks, headers: dict) -> web.StreamResponse:
        """Stored `queued` and answered at once (or, streamed, followed from its first event);
        generated by a task of its own, which the client's connection does not end."""
        rr = turn.rr
        run = turn.run = BackgroundRun(turn.response("queued", []), [] if rr.stream else None)
        self.store.put(turn.id, StoredResponse(run.response, None, run))
        run.emit([turn.event("response.created", "queued"), turn.event("response.queued", "queued")])
        slot = request.get(ADMISSION_SLOT)  # this request's place in flight goes with the task
        release = slot.take() if slot is not None else (lambda: None)
        run.task = asyncio.create_task(self._generate(turn, chunks, run), name=f"background-{turn.id}")
        self._tasks.add(run.task)

        def finished(task: asyncio.Task) -> None:
            self._tasks.discard(task)
            release()
            if not run.done:  # cancelled before it ran a line
                self._end(turn, run, turn.cancelled(), [])

        run.task.add_done_callback(finished)
        if rr.stream:
            return await self._follow(request, run, -1, headers)
        return web.Response(body=_encode(run.response), content_type="application/json", headers=headers)

    async def _generate(self, turn: _Turn, chunks, run: BackgroundRun) -> None:
        try:
            async with contextlib.aclosing(chunks):  # closing it aborts the request upstream
                async for chunk in chunks:
                    if run.response["status"] == "queued":  # what GET shows from now on: the output so far
                        run.response = turn.response("in_progress", turn.out.items)
                        run.emit([turn.event("response.in_progress", "in_progress")])
                    run.emit(turn.step(chunk))
            response, events = turn.final()
        except RouterError as e:
            logger.warning("background response %s failed: %s", turn.id, e.message)
            response, events = turn.failed(e)
        except asyncio.CancelledError:
            response, events = turn.cancelled(), []
        except Exception:
            logger.exception("background response %s failed", turn.id)
            response, events = turn.failed(RouterError(500, "internal server error", type="server_error"))
        self._end(turn, run, response, events)

    def _end(self, turn: _Turn, run: BackgroundRun, response: dict, events: list[dict]) -> None:
        if response["status"] == "cancelled":  # final() and failed() keep theirs
            self.keep(turn.rr, response, run)
        run.response = response
        run.emit(events)
