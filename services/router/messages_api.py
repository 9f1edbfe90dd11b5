"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API, as vLLM serves it):
the request becomes a chat completion (system + messages of content blocks -> chat messages
through the chat template, tools -> function tools, tool_choice, thinking, output_config), and
the answer comes back as content blocks (thinking, text, tool_use), whole or as Anthropic's
stream events. Errors have Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
from __future__ import annotations

import contextlib
import json
import secrets

import msgspec
from aiohttp import web

from services.router.answer_parts import AnswerParts
from services.router.errors import RouterError, bad_request, unsupported
from services.router.generation import TextChunk, TextGenerator
from services.router.openai_protocol import Body, parse_chat, tokenize
from services.router.openai_serving import Choice, sse_event, stream_events
from services.router.sampling import RequestLimits
from services.router.served_model import ServedModel
from services.router.tool_calls import arguments_object

_encode = msgspec.json.Encoder().encode

FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
          "tools", "tool_choice", "thinking", "output_config", "metadata", "service_tier", "user_profile_id",
          "workspace_id", "inference_geo", "speed", "diagnostics", "container", "mcp_servers",
          # Anthropic's prompt caching markers: the prefix cache here is automatic, every prompt's
          "cache_control",
          # vLLM's extras, as in its chat completions
          "chat_template_kwargs", "cache_salt", "priority", "seed", "min_p", "repetition_penalty",
          "presence_penalty", "frequency_penalty", "structured_outputs", "include_reasoning"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
                "chat_template_kwargs"}
_CHAT_SAME = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs", "cache_salt", "priority", "seed",
              "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "structured_outputs",
              "include_reasoning")
# Chat completion parameters whose Messages names differ, for the errors a chat parse raises.
_PARAMS = {"max_tokens": "max_tokens", "thinking_token_budget": "thinking.budget_tokens", "stop": "stop_sequences",
           "response_format": "output_config.format",
           "reasoning_effort": "output_config.effort", "tools": "tools", "tool_choice": "tool_choice"}
# Anthropic's (and vLLM's) least thinking.budget_tokens.
MIN_BUDGET_TOKENS = 1024
# Claude Code's first system block carries a hash that changes every request: left out, as vLLM
# does, so the prompt's prefix stays cacheable.
_BILLING_HEADER = "x-anthropic-billing-header"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error"}


def error_body(e: RouterError) -> dict:
    """Anthropic's error shape; the message names the parameter when one is at fault."""
    message = e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}"
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": message}}


def _texts(content, where: str, allowed: tuple[str, ...] = ("text",), param: str = "messages") -> list[dict]:
    """Content as blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of content blocks", param)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(f"{where}[{j}] must be an object with a type", param)
        if block["type"] not in allowed:
            raise unsupported(f"{where}[{j}]: content blocks of type {block['type']!r:.40}", param)
        if block["type"] == "text" and not isinstance(block.get("text"), str):
            raise bad_request(f"{where}[{j}]: a text block needs a string text", param)
    return content


def _system(raw) -> str | None:
    if raw is None:
        return None
    blocks = _texts(raw, "system", param="system")
    text = "\n".join(b["text"] for b in blocks if not b["text"].startswith(_BILLING_HEADER))
    return text or None


def chat_messages(system, raw) -> list[dict]:
    """system + messages -> chat messages: text blocks joined; an assistant's thinking blocks its
    `reasoning` (and `reasoning_content`), its tool_use blocks tool calls; a user's tool_result
    blocks tool messages (before the user's own text, in their order)."""
    out = [{"role": "system", "content": system}] if system else []
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty array", "messages")
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be user or assistant", "messages")
        role = msg["role"]
        allowed = (("text", "thinking", "redacted_thinking", "tool_use") if role == "assistant"
                   else ("text", "tool_result"))
        texts, calls, reasoning = [], [], []
        for block in _texts(msg.get("content"), f"{where}.content", allowed):
            kind = block["type"]
            if kind == "text":
                texts.append(block["text"])
            elif kind == "thinking":
                if not isinstance(block.get("thinking"), str):
                    raise bad_request(f"{where}: a thinking block needs a string thinking", "messages")
                reasoning.append(block["thinking"])
            elif kind == "tool_use":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or \
                        not isinstance(block.get("input"), dict):
                    raise bad_request(f"{where}: a tool_use block needs a string id and name and an object input",
                                      "messages")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"],
                                           "arguments": json.dumps(block["input"], ensure_ascii=False)}})
            elif kind == "tool_result":
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad_request(f"{where}: a tool_result block needs a string tool_use_id", "messages")
                result = block.get("content", "")
                text = "\n".join(b["text"] for b in _texts(result, f"{where} tool_result.content")) if result else ""
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
            # redacted_thinking: opaque, accepted (clients send the assistant's turn back whole)
        if role == "user" and not texts and out and out[-1]["role"] == "tool":
            continue  # tool results only
        message = {"role": role, "content": "\n".join(texts) if texts or not calls else None}
        if calls:
            message["tool_calls"] = calls
        if reasoning:
            message["reasoning"] = message["reasoning_content"] = "\n".join(reasoning)
        out.append(message)
    return out


def _tools(raw, choice) -> dict:
    """tools ({name, description, input_schema}) and tool_choice -> the chat completion's."""
    out = {}
    if raw is not None:
        if not isinstance(raw, list):
            raise bad_request("tools must be an array", "tools")
        tools = []
        for i, tool in enumerate(raw):
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise unsupported(f"tools[{i}] of type {kind!r:.40} (only client tools with an input_schema are)",
                                  "tools")
            if not isinstance(tool.get("input_schema"), dict):
                raise bad_request(f"tools[{i}].input_schema must be a JSON schema object", "tools")
            fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
            if "description" in tool:
                fn["description"] = tool["description"]
            tools.append({"type": "function", "function": fn})
        out["tools"] = tools
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise bad_request('tool_choice must be {"type": "auto" | "any" | "tool" | "none"}', "tool_choice")
        if kind == "tool" and not isinstance(choice.get("name"), str):
            raise bad_request('tool_choice {"type": "tool"} needs a name', "tool_choice")
        out["tool_choice"] = ({"type": "function", "function": {"name": choice["name"]}} if kind == "tool"
                              else {"any": "required"}.get(kind, kind))
        if choice.get("disable_parallel_tool_use") is not None:
            out["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]
    return out


def _thinking_and_output(b: Body) -> dict:
    """thinking -> the template's enable_thinking, and an enabled thinking's budget_tokens ->
    thinking_token_budget (the engine closes the reasoning once it is spent); output_config.format
    -> response_format, .effort -> reasoning_effort."""
    out = {}
    thinking = b.get("thinking", "dict")
    if thinking is not None:
        kind = thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise bad_request('thinking.type must be "enabled", "disabled" or "adaptive"', "thinking")
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_BUDGET_TOKENS:
                raise bad_request(f"thinking.budget_tokens must be an integer >= {MIN_BUDGET_TOKENS}, got "
                                  f"{budget!r:.40}", "thinking.budget_tokens")
            out["thinking_token_budget"] = budget
        if kind != "adaptive":
            kwargs = dict(b.get("chat_template_kwargs", "dict", {}))
            kwargs.setdefault("enable_thinking", kind == "enabled")
            out["chat_template_kwargs"] = kwargs
    config = b.get("output_config", "dict", {})
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise bad_request('output_config.format must be {"type": "json_schema", "schema": {...}}',
                              "output_config")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if config.get("effort") is not None:
        out["reasoning_effort"] = config["effort"]
    return out


def _stop_sequences(b: Body) -> list[str] | None:
    stop = b.get("stop_sequences", "list")
    if stop is not None and not all(isinstance(s, str) for s in stop):
        raise bad_request("stop_sequences must be an array of strings", "stop_sequences")
    return stop


def _chat_body(b: Body) -> dict:
    chat = {k: b.body[k] for k in _CHAT_SAME if k in b.body}
    chat.update(model=b.body.get("model"), messages=chat_messages(_system(b.body.get("system")),
                                                                  b.body.get("messages")),
                **_tools(b.get("tools", "list"), b.body.get("tool_choice")), **_thinking_and_output(b))
    return chat


def _renamed(fn, *args):
    try:
        return fn(*args)
    except RouterError as e:  # the chat parameter's name -> the Messages one
        e.param = _PARAMS.get(e.param, e.param)
        raise


def parse_messages(body, model: ServedModel, limits: RequestLimits):
    b = Body(body, FIELDS)
    if b.get("mcp_servers", "list"):
        raise unsupported("mcp_servers (MCP tools run by the server)", "mcp_servers")
    max_tokens = b.get("max_tokens", "int")
    if max_tokens is None:
        raise bad_request("max_tokens is required", "max_tokens")
    chat = _chat_body(b)
    chat["max_tokens"] = max_tokens
    budget = chat.get("thinking_token_budget")
    if budget is not None and budget >= max_tokens:
        raise bad_request(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
                          "thinking.budget_tokens")
    if budget is not None and model.reasoning_parser is None:
        # No parser, no reasoning to tell from the answer: the whole output is text, bounded by
        # max_tokens (the template still gets enable_thinking).
        del chat["thinking_token_budget"]
    stop = _stop_sequences(b)
    if stop:
        chat["stop"] = stop
    parsed = _renamed(parse_chat, chat, model, limits)
    parsed.ignored_fields = b.ignored
    return parsed


def count_tokens(body, model: ServedModel, limits: RequestLimits) -> dict:
    """{"input_tokens"}: the prompt this request would be, as /v1/messages renders it."""
    b = Body(body, COUNT_FIELDS)
    chat = _chat_body(b)
    rendered = {k: v for k, v in chat.items() if k in ("model", "messages", "tools", "tool_choice",
                                                         "chat_template_kwargs", "reasoning_effort")}
    return {"input_tokens": _renamed(tokenize, rendered, model, limits)["count"]}


def stop_reason(choice: Choice, calls: list[dict]) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence): max_tokens wins, then a stop string, then
    tool_use when the answer called a tool, else end_turn."""
    if choice.finish_reason == "length":
        return "max_tokens", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return ("tool_use" if calls else "end_turn"), None


class MessageOutput:
    """Content blocks as the answer comes (thinking, text, tool_use); each step returns the
    stream events it makes (a whole answer takes the blocks)."""

    def __init__(self, stream: bool = False) -> None:
        self.blocks: list[dict] = []
        self.open: dict | None = None
        self.calls: list[dict] = []
        # Streamed: a tool_use block opens when its call begins and its input's JSON follows as
        # written (input_json_delta); whole: the calls at the end.
        self.stream = stream
        self.streamed: dict[int, int] = {}  # a call's index -> its block's

    def _close(self) -> list[dict]:
        block, self.open = self.open, None
        if block is None:
            return []
        index, events = len(self.blocks) - 1, []
        if block["type"] == "thinking":
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": block["signature"]}})
        return events + [{"type": "content_block_stop", "index": index}]

    def _delta(self, kind: str, text: str) -> list[dict]:
        if not text:
            return []
        events = []
        if self.open is None or self.open["type"] != kind:
            events = self._close()
            block = ({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                     else {"type": "text", "text": ""})
            self.blocks.append(block)
            self.open = block
            events.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)})
            if kind == "thinking":  # an opaque tag for the block, as vLLM gives (nothing verifies it here)
                block["signature"] = secrets.token_hex(16)
        self.open[kind] += text
        key = "thinking_delta" if kind == "thinking" else "text_delta"
        events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                       "delta": {"type": key, kind: text}})
        return events

    def thinking(self, text: str) -> list[dict]:
        return self._delta("thinking", text)

    def text(self, text: str) -> list[dict]:
        return self._delta("text", text)

    def tool_deltas(self, deltas: list[dict]) -> list[dict]:
        if not self.stream:
            return []
        events = []
        for delta in deltas:
            fn = delta.get("function", {})
            if "id" in delta and fn.get("arguments") and arguments_object(fn["arguments"]) is None:
                continue  # a whole call whose arguments are no JSON object: text, at the end (tool_uses)
            if "id" in delta:  # a call begins: the block before it is complete
                events += self._close()
                block = {"type": "tool_use", "id": delta["id"].replace("call_", "toolu_", 1), "name": fn["name"],
                         "input": {}}
                self.blocks.append(block)
                self.open = block
                self.streamed[delta["index"]] = len(self.blocks) - 1
                events.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                               "content_block": dict(block)})
            block_index = self.streamed[delta["index"]]
            if fn.get("arguments"):
                events.append({"type": "content_block_delta", "index": block_index,
                               "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}})
        return events

    def tool_uses(self, calls: list[dict]) -> list[dict]:
        """A call whose arguments are a JSON object is a tool_use block; one whose are not (a
        constrained answer cut short) stays text. Streamed already: its input, complete."""
        events = []
        streamed = {self.blocks[i]["id"]: self.blocks[i] for i in self.streamed.values()}
        for call in calls:
            fn = call["function"]
            block = streamed.get(call["id"].replace("call_", "toolu_", 1))
            if block is not None:
                block["input"] = arguments_object(fn["arguments"]) or {}
                self.calls.append(call)
                continue
            args = arguments_object(fn["arguments"])
            if args is None:
                events += self.text(fn["arguments"])
                continue
            events += self._close()
            block = {"type": "tool_use", "id": call["id"].replace("call_", "toolu_", 1), "name": fn["name"],
                     "input": args}
            self.blocks.append(block)
            self.calls.append(call)
            index = len(self.blocks) - 1
            events += [{"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
                       {"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}},
                       {"type": "content_block_stop", "index": index}]
        return events

    def finish(self) -> list[dict]:
        """Closes the open block; an answer of nothing at all is one empty text block."""
        if not self.blocks:
            self.blocks.append({"type": "text", "text": ""})
            return [{"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                    {"type": "content_block_stop", "index": 0}]
        return self._close()


class MessagesServing:
    def __init__(self, generator: TextGenerator, model: ServedModel) -> None:
        self.generator = generator
        self.model = model

    @staticmethod
    def _usage(choice: Choice, prompt_tokens: int) -> dict:
        """Anthropic counts the prompt's cache reads apart from its input_tokens."""
        cached = choice.num_cached_tokens
        return {"input_tokens": prompt_tokens - cached, "cache_read_input_tokens": cached,
                "output_tokens": choice.num_tokens}

    async def respond(self, request: web.Request, req, request_id: str, headers: dict) -> web.StreamResponse:
        prompt = req.prompts[0]
        choice = Choice(0, prompt, req, self.model, chat=True)
        answer = AnswerParts(choice)
        out = MessageOutput(stream=req.stream)
        chunks = self.generator.stream(request_id, prompt)

        def step(chunk: TextChunk) -> list[dict]:
            parts = answer.feed(chunk)
            events = out.thinking(parts.reasoning) + out.text(parts.content) + out.tool_deltas(parts.call_deltas)
            if parts.calls is not None:
                events += out.tool_uses(parts.calls) + out.finish()
            return events

        def message(content: list, reason: str | None, sequence: str | None) -> dict:
            return {"id": request_id, "type": "message", "role": "assistant", "content": content,
                    "model": req.model, "stop_reason": reason, "stop_sequence": sequence,
                    "usage": self._usage(choice, len(prompt.token_ids))}

        if not req.stream:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    step(chunk)
            body = message(out.blocks, *stop_reason(choice, out.calls))
            return web.Response(body=_encode(body), content_type="application/json", headers=headers)

        async def send(response: web.StreamResponse, events: list[dict]) -> None:
            for event in events:
                await response.write(sse_event(event))

        async def run(first: TextChunk, response: web.StreamResponse) -> None:
            events = step(first)  # the first chunk says how much of the prompt was cached
            await send(response, [{"type": "message_start", "message": message([], None, None)}, *events])
            async for chunk in chunks:
                await send(response, step(chunk))
            reason, sequence = stop_reason(choice, out.calls)
            await send(response, [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": self._usage(choice, len(prompt.token_ids))}, {"type": "message_stop"}])

        async def on_error(e: RouterError, response: web.StreamResponse) -> None:  # the error is the last event
            await send(response, [error_body(e)])

        return await stream_events(request, request_id, headers, chunks, self.generator.metrics, run, on_error)
