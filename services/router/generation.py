"""Token chunks from the fleet -> text chunks: incremental detokenization, stop strings, latency metrics."""
from __future__ import annotations

import contextlib
import itertools
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from engine.detokenizer import IncrementalDetokenizer

from services.common.metrics import observe_per_token
from services.router.dispatcher import Dispatcher
from services.router.errors import RouterError
from services.router.sampling import PreparedPrompt
from services.router.served_model import ServedModel


# What a client may name its request (HTTP X-Request-Id, gRPC request_id).
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass
class TextChunk:
    text: str
    token_ids: list[int]
    logprobs: list = field(default_factory=list)  # pb.TokenLogprob per token in token_ids
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    prompt_logprobs: list | None = None  # first chunk only, when asked for
    num_cached_tokens: int = 0


class TextGenerator:
    """Shared by the HTTP gateway and the gRPC Generate front."""

    def __init__(self, dispatcher: Dispatcher, model: ServedModel, metrics) -> None:
        self.dispatcher = dispatcher
        self.model = model
        self.metrics = metrics
        self._id_prefix = secrets.token_hex(6)  # this router's; a counter is cheaper than uuid4
        self._ids = itertools.count()

    def new_request_id(self, kind: str) -> str:
        return f"{kind}-{self._id_prefix}{next(self._ids):x}"

    def upstream_request_id(self, request_id: str) -> str:
        """The engines' key for one request: unique even when clients reuse an X-Request-Id (a
        duplicate would be refused, and an Abort would reach the other client's request); it
        starts with the client's id, for the logs."""
        return f"{request_id}.{self._id_prefix}{next(self._ids):x}"

    async def stream(self, request_id: str, prompt: PreparedPrompt) -> AsyncIterator[TextChunk]:
        """Ends with a chunk that has a finish_reason; closing it early aborts the request."""
        m = self.metrics
        detok = IncrementalDetokenizer(self.model.codec, prompt.params)
        start = last = time.monotonic()
        first = True
        m.prompt_tokens.inc(len(prompt.token_ids))
        m.requests_running.inc()
        try:
            chunks = self.dispatcher.stream(self.upstream_request_id(request_id), prompt.token_ids,
                                            prompt.sampling, prompt.priority)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    now = time.monotonic()
                    if first:
                        m.ttft.observe(now - start)
                    else:
                        observe_per_token(m.itl, now - last, len(chunk.token_ids))
                    last = now
                    seen = len(detok.token_ids)
                    text = detok.add_tokens(chunk.token_ids, finished=chunk.finish_reason is not None)
                    used = len(detok.token_ids) - seen  # a stop string drops the tokens after it
                    m.generation_tokens.inc(used)
                    out = TextChunk(text, chunk.token_ids[:used], chunk.logprobs[:used],
                                    chunk.finish_reason, chunk.stop_reason,
                                    chunk.prompt_logprobs if first else None, chunk.num_cached_tokens)
                    first = False
                    if detok.stopped_on is not None:
                        out.finish_reason, out.stop_reason = "stop", detok.stopped_on
                    elif out.stop_reason is not None and out.stop_reason.isdigit():
                        out.stop_reason = int(out.stop_reason)
                    yield out
                    if out.finish_reason is not None:
                        m.e2e.observe(time.monotonic() - start)
                        return
            raise RouterError(502, "the decode stream ended without a finish reason", type="upstream_error")
        finally:
            m.requests_running.dec()
