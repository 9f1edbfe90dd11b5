"""POST /v1/completions and /v1/chat/completions: run the prompts, answer in JSON or SSE."""
from __future__ import annotations

import contextlib
import logging
import time

import msgspec
from aiohttp import web

from services.router.errors import RouterError
from services.router.generation import TextChunk, TextGenerator
from services.router.openai_format import (CompletionLogprobs, chat_chunk, chat_logprobs, completion_chunk,
                                           prompt_logprobs_entries, usage, usage_chunk)
from services.router.openai_protocol import ParsedRequest
from services.router.reasoning import ReasoningSplitter, count_reasoning_tokens
from services.router.sampling import PreparedPrompt
from services.router.served_model import ServedModel
from services.router.streams import merge
from services.router.tool_calls import ToolCallStream

logger = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode
CLIENT_CLOSED = 499  # nginx's code for a client that went away: what the metrics count
# The status a streamed response ended with (its HTTP status is already 200), for logs and metrics.
STREAM_STATUS = web.RequestKey("pdserve_stream_status", int)
# The request's place among those in flight (admission.Slot), for work that outlives it.
ADMISSION_SLOT = web.RequestKey("pdserve_admission_slot", object)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def stream_events(request: web.Request, request_id: str, headers: dict, chunks, metrics, run,
                        on_error) -> web.StreamResponse:
    """A streamed answer: the first chunk comes before the headers (a request that cannot be
    served at all, every prefill failed or a timeout, still gets its HTTP status); then
    `run(first, response)` writes the events, `on_error(e, response)` the last ones when a
    RouterError comes after the headers; a client gone mid-stream aborts the request upstream
    (closing `chunks` does)."""
    async with contextlib.aclosing(chunks):
        first = await anext(chunks)
        response = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        await response.prepare(request)
        try:
            await run(first, response)
        except RouterError as e:
            logger.warning("request %s failed mid-stream: %s", request_id, e.message)
            request[STREAM_STATUS] = e.status
            await on_error(e, response)
        except ConnectionResetError:
            request[STREAM_STATUS] = CLIENT_CLOSED
            metrics.client_aborts.inc()
            logger.info("request %s: client disconnected mid-stream; aborted", request_id)
            return response
    await response.write_eof()
    return response


def sse_event(event: dict) -> bytes:
    """An SSE event with its `event:` name (the Responses and Messages APIs' framing)."""
    return b"event: " + event["type"].encode() + b"\ndata: " + _encode(event) + b"\n\n"


def reasoning_delta(reasoning: str | None) -> dict:
    """vLLM's `reasoning`, and `reasoning_content` as DeepSeek's API (and older vLLM) name it."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


class Choice:
    """One sample's answer, accumulated (non-streaming) or turned into chunks (streaming)."""

    def __init__(self, index: int, prompt: PreparedPrompt, req: ParsedRequest, model: ServedModel,
                 chat: bool) -> None:
        self.index, self.prompt, self.req, self.model, self.chat = index, prompt, req, model, chat
        self.text = ""
        self.num_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason = None
        self.stop_reason = None
        self.logprobs: dict | None = None
        self.cumulative_logprob = 0.0  # of the generated tokens: what best_of ranks by
        self.started = False
        self._completion_lp = (CompletionLogprobs(model, req.logprobs, as_ids=req.tokens_as_ids)
                               if req.logprobs is not None and not chat else None)
        # return_token_ids: every id this choice shows (completions' echo: the prompt's first), and
        # those a stream has not sent yet (a chunk that writes nothing keeps them for the next).
        self.token_ids: list[int] = []
        self.unsent_ids: list[int] = []
        self.sent_prompt_ids = False
        self.tool_stream = ToolCallStream(req.tools) if chat and req.tools is not None else None
        # --reasoning-parser: the <think> text goes to `reasoning`, `text` keeps the content.
        self.splitter = ReasoningSplitter(req.reasoning_starts) if chat and req.reasoning_starts is not None else None
        self.reasoning = ""
        self.new_reasoning = ""  # the reasoning the last chunk added
        self.generated_ids: list[int] | None = [] if self.splitter is not None else None  # reasoning_tokens
        self.prompt_logprobs: list = []  # the engine's, per prompt token after the first

    def _prompt_echo(self, chunk: TextChunk) -> tuple[str, dict | None]:
        p = self.prompt
        text = p.text if p.text is not None else self.model.decode(
            p.token_ids, skip_special_tokens=p.params.skip_special_tokens)
        lp = None
        if self._completion_lp is not None:
            lp = self._completion_lp.build(p.token_ids, chunk.prompt_logprobs or [], prompt_first=True)
        return text, lp

    def add(self, chunk: TextChunk) -> tuple[str, dict | None]:
        """Takes a chunk; returns the text and logprobs this choice shows for it."""
        text, lp = "", None
        if not self.started:
            self.started = True
            self.num_cached_tokens = chunk.num_cached_tokens
            self.prompt_logprobs = chunk.prompt_logprobs or []
            if self.req.echo:
                text, lp = self._prompt_echo(chunk)
                self._show_ids(self.prompt.token_ids)
        if not self.req.echo_only:
            self._show_ids(chunk.token_ids)
            self.num_tokens += len(chunk.token_ids)
            if self.generated_ids is not None:
                self.generated_ids += chunk.token_ids
            self.cumulative_logprob += sum(lp.logprob for lp in chunk.logprobs)
            text += self._split_reasoning(chunk.text, chunk.finish_reason is not None)
            if self._completion_lp is not None:
                lp = CompletionLogprobs.merge(lp, self._completion_lp.build(chunk.token_ids, chunk.logprobs))
            elif self.chat and self.req.logprobs is not None:
                lp = chat_logprobs(self.model, chunk.token_ids, chunk.logprobs, self.req.logprobs,
                                   self.req.tokens_as_ids)
        if chunk.finish_reason is not None:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason
        self.text += text
        if lp is not None:
            self.logprobs = lp if self.logprobs is None else (
                {"content": self.logprobs["content"] + lp["content"]} if self.chat
                else CompletionLogprobs.merge(self.logprobs, lp))
        return text, lp

    def _split_reasoning(self, text: str, finished: bool) -> str:
        """The content of `text`; its reasoning goes to new_reasoning (and self.reasoning)."""
        if self.splitter is None:
            return text
        reasoning, content = self.splitter.feed(text)
        if finished:
            more_reasoning, more_content = self.splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        self.reasoning += reasoning
        self.new_reasoning = reasoning
        return content

    def reasoning_tokens(self) -> int:
        """The generated tokens inside the reasoning block (under --reasoning-parser)."""
        if self.generated_ids is None:
            return 0
        skip = self.prompt.params.skip_special_tokens
        return count_reasoning_tokens(lambda ids: self.model.decode(ids, skip_special_tokens=skip),
                                      self.generated_ids, self.req.reasoning_starts,
                                      (self.model.reasoning_start_ids, self.model.reasoning_end_ids))

    def shown_prompt_logprobs(self) -> list:
        """vLLM's prompt_logprobs list for this choice's prompt."""
        return prompt_logprobs_entries(self.model, self.prompt_logprobs, self.req.prompt_logprobs)

    def _show_ids(self, ids: list[int]) -> None:
        if self.req.return_token_ids:
            self.token_ids += ids
            self.unsent_ids += ids

    def take_unsent_ids(self) -> list[int]:
        ids, self.unsent_ids = self.unsent_ids, []
        return ids

    def tool_finish_reason(self, calls: list) -> str | None:
        """OpenAI's "tool_calls" when the model's answer is calls (and it was not cut short)."""
        return "tool_calls" if calls and self.finish_reason == "stop" else self.finish_reason

    def as_choice(self) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": self.text}
            finish_reason = self.finish_reason
            if self.req.tools is not None:
                content, calls = self.req.tools.tool_calls(self.text)
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish_reason = self.tool_finish_reason(calls)
            if self.req.chat_echo:  # after the tool calls were read from the answer, as vLLM
                message["content"] = self.req.chat_echo + (message["content"] or "")
            if self.splitter is not None:  # vLLM: null where there is none
                message["content"] = message["content"] or None
                if self.req.include_reasoning:
                    message.update(reasoning_delta(self.reasoning or None))
            out = {"index": self.index, "message": message, "logprobs": self.logprobs,
                   "finish_reason": finish_reason, "stop_reason": self.stop_reason}
        else:
            out = {"index": self.index, "text": self.text, "logprobs": self.logprobs,
                   "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}
            if self.req.return_token_ids:  # vLLM: a completion choice has its prompt's ids
                out["prompt_token_ids"] = self.prompt.token_ids
            if self.req.prompt_logprobs is not None:
                out["prompt_logprobs"] = self.shown_prompt_logprobs()
        if self.req.return_token_ids:
            out["token_ids"] = self.token_ids
        return out


class OpenAIServing:
    def __init__(self, generator: TextGenerator, model: ServedModel, max_concurrent_prompts: int) -> None:
        self.generator = generator
        self.model = model
        self.max_concurrent_prompts = max_concurrent_prompts  # of one request's, upstream at once

    def _choices(self, req: ParsedRequest, chat: bool) -> list[Choice]:
        """One per sample; with best_of == n a sample's index is its choice's (prompt i's are
        i * n ... i * n + n - 1); with best_of > n, `_best` numbers the chosen ones."""
        return [Choice(i, p, req, self.model, chat) for i, p in enumerate(req.prompts)]

    @staticmethod
    def _best(choices: list[Choice], req: ParsedRequest) -> list[Choice]:
        """Per prompt, the n samples of highest cumulative logprob, best first (as vLLM)."""
        if req.best_of == req.n:
            return choices
        chosen = []
        for start in range(0, len(choices), req.best_of):
            group = sorted(choices[start:start + req.best_of], key=lambda c: -c.cumulative_logprob)[:req.n]
            for rank, c in enumerate(group):
                c.index = start // req.best_of * req.n + rank
            chosen += group
        return chosen

    def _streams(self, request_id: str, req: ParsedRequest) -> list:
        n = len(req.prompts)
        return [self.generator.stream(request_id if n == 1 else f"{request_id}-{i}", p)
                for i, p in enumerate(req.prompts)]

    @staticmethod
    def _usage(choices: list[Choice], req: ParsedRequest) -> dict:
        """A prompt counts once however many samples it has (its first sample's cache hits);
        every generated token counts, a best_of sample not chosen too."""
        firsts = choices[::req.best_of]
        out = usage(sum(len(c.prompt.token_ids) for c in firsts), sum(c.num_tokens for c in choices),
                    sum(c.num_cached_tokens for c in firsts))
        if req.reasoning_starts is not None:  # vLLM's, under a reasoning parser
            out["completion_tokens_details"] = {"reasoning_tokens": sum(c.reasoning_tokens() for c in choices)}
        return out

    async def respond(self, request: web.Request, req: ParsedRequest, request_id: str,
                      chat: bool, headers: dict) -> web.StreamResponse:
        choices = self._choices(req, chat)
        created = int(time.time())
        chunks = merge(self._streams(request_id, req), self.max_concurrent_prompts)
        if not req.stream:
            async with contextlib.aclosing(chunks):
                async for i, chunk in chunks:
                    choices[i].add(chunk)
            body = {"id": request_id, "object": "chat.completion" if chat else "text_completion",
                    "created": created, "model": req.model,
                    "choices": [c.as_choice() for c in self._best(choices, req)],
                    "usage": self._usage(choices, req)}
            if chat and req.return_token_ids:  # vLLM: one prompt, its ids beside the choices
                body["prompt_token_ids"] = req.prompts[0].token_ids
            if chat and req.prompt_logprobs is not None:  # vLLM: beside the choices too
                body["prompt_logprobs"] = choices[0].shown_prompt_logprobs()
            return web.Response(body=_encode(body), content_type="application/json", headers=headers)
        async def run(first, response: web.StreamResponse) -> None:
            await self._stream(response, first, chunks, choices, req, request_id, created, chat)
            await response.write(b"data: [DONE]\n\n")

        async def on_error(e: RouterError, response: web.StreamResponse) -> None:  # the error is the last event
            await response.write(b"data: " + _encode(e.body()) + b"\n\ndata: [DONE]\n\n")

        return await stream_events(request, request_id, headers, chunks, self.generator.metrics, run, on_error)

    async def _stream(self, response: web.StreamResponse, first, chunks, choices: list[Choice],
                      req: ParsedRequest, request_id: str, created: int, chat: bool) -> None:
        make = chat_chunk if chat else completion_chunk
        prompt_ids_sent = False  # chat with return_token_ids: the prompt's ids ride the first chunk

        async def send(i: int, chunk: TextChunk) -> None:
            choice = choices[i]
            if chat and not choice.started:
                await write(choice, {"role": "assistant", "content": ""}, None, None)
                if req.chat_echo:
                    await write(choice, {"content": req.chat_echo}, None, None)
            text, lp = choice.add(chunk)
            finish_reason = chunk.finish_reason
            reasoning = choice.new_reasoning if req.include_reasoning else ""
            if reasoning and choice.tool_stream is not None:  # thinking first; tool calls parse the content
                await write(choice, reasoning_delta(reasoning), lp, None)
                reasoning, lp = "", None
            if choice.tool_stream is not None:  # tool calls: content only outside them, calls as they come
                text = choice.tool_stream.feed(text)
                if finish_reason is not None:
                    rest, calls = choice.tool_stream.finish()
                    text += rest
                    finish_reason = choice.tool_finish_reason(calls)
                deltas = choice.tool_stream.take_deltas()
                if deltas:
                    if text:
                        await write(choice, {"content": text}, lp, None)
                        text, lp = "", None
                    await write(choice, {"tool_calls": deltas}, None, None)
            # A token whose text is held back (part of a UTF-8 character, or maybe a stop string's
            # start) still gets its chunk, with empty text, as vLLM streams it: a client times its
            # first token (and every token after) by chunks, not by text. Tool calls hold their
            # text back by design and stream it when the call is known.
            new_tokens = bool(chunk.token_ids) and not req.echo_only and choice.tool_stream is None
            if not text and not reasoning and lp is None and finish_reason is None and not new_tokens:
                return
            payload = {"content": text} if chat else text
            if reasoning:  # vLLM's delta: the reasoning, and the content when the piece has both
                payload = {**reasoning_delta(reasoning), **({"content": text} if text else {})}
            elif chat and not text and finish_reason is not None:
                payload = {}
            await write(choice, payload, lp, finish_reason)

        async def write(choice: Choice, payload, lp, finish_reason) -> None:
            event = make(request_id, created, req.model, choice.index, payload, lp, finish_reason,
                         choice.stop_reason if finish_reason else None)
            if req.return_token_ids:
                nonlocal prompt_ids_sent
                event["choices"][0]["token_ids"] = choice.take_unsent_ids()
                if not chat and not choice.sent_prompt_ids:
                    event["choices"][0]["prompt_token_ids"] = choice.prompt.token_ids
                    choice.sent_prompt_ids = True
                elif chat and not prompt_ids_sent:
                    event["prompt_token_ids"] = choice.prompt.token_ids
                prompt_ids_sent = True
            if req.continuous_usage:  # vLLM's continuous_usage_stats: this choice's usage so far
                event["usage"] = usage(len(choice.prompt.token_ids), choice.num_tokens, choice.num_cached_tokens)
            await response.write(b"data: " + _encode(event) + b"\n\n")

        await send(*first)
        async for i, chunk in chunks:
            await send(i, chunk)
        if req.include_usage:
            obj = "chat.completion.chunk" if chat else "text_completion"
            await response.write(b"data: " + _encode(usage_chunk(request_id, created, req.model, obj,
                                                                  self._usage(choices, req))) + b"\n\n")
