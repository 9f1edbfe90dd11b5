"""What the engine gives back to users, and the front-end step that builds it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.request import SamplingParams
from engine.scheduler import EngineCoreOutput


class OutputKind(enum.Enum):
    """What each RequestOutput holds (as vLLM's RequestOutputKind)."""
    CUMULATIVE = 0  # everything generated so far, every step
    DELTA = 1  # only what this step added (streaming front ends: no O(n^2) copies)
    FINAL_ONLY = 2  # one output per request, when it finishes (the offline LLM API)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list | None = None  # per token: {token_id: logprob} (sampled first, then top-n)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    delta_text: str = ""  # text added by this update (streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    kv_handle: bytes | None = None  # prefill role: the published prompt blocks
    # Per prompt token after the first: {token_id: logprob} (prompt token first, then top-n).
    prompt_logprobs: list | None = None
    # Per prompt token after the first: its rank in the distribution it was read from (1: the
    # likeliest; vLLM's Logprob.rank), beside prompt_logprobs.
    prompt_logprob_ranks: list[int] | None = None
    queue_time: float | None = None  # engine-side: arrival to first scheduled (first output only)


def merge_delta(out: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two DELTA outputs of one request, in order, as one (a consumer that fell behind gets one
    update, not a backlog of them, as vLLM's output collector): `out`, extended in place."""
    a, b = out.outputs[0], later.outputs[0]
    a.text += b.text
    a.token_ids += b.token_ids
    if a.logprobs is not None and b.logprobs is not None:
        a.logprobs += b.logprobs
    a.finish_reason, a.stop_reason = b.finish_reason, b.stop_reason
    out.delta_text += later.delta_text
    out.delta_token_ids += later.delta_token_ids
    out.finished = later.finished
    out.num_cached_tokens = later.num_cached_tokens
    out.kv_handle = later.kv_handle if later.kv_handle is not None else out.kv_handle
    if out.prompt_logprobs is None:
        out.prompt_logprobs, out.prompt_logprob_ranks = later.prompt_logprobs, later.prompt_logprob_ranks
    if out.queue_time is None:
        out.queue_time = later.queue_time
    return out


def _entry(token_id: int, lp) -> dict[int, float]:
    """(logprob, top-n pairs) -> {token_id: logprob, top ids...}, the chosen token first."""
    entry = {token_id: lp[0]}
    entry.update({t: v for t, v in lp[1] if t not in entry})
    return entry


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer) -> None:
        """`tokenizer` None: no text (and no stop strings looked for)."""
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, params) if tokenizer is not None else None
        self.token_ids: list[int] = []
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = None
        self.prompt_logprob_ranks: list[int] | None = None
        self.streamed = False  # an update went out (the first always goes at once)
        self.held: RequestOutput | None = None  # DELTA updates short of the stream interval
        self.interval = 1  # this request's stream interval (the processor sets it)


# Logprob entries (a token's and each of its top-n) one update may carry: updates travel as single
# gRPC messages (64 MiB; an entry is about 11 bytes on the wire), so a request asking for a wide
# top-n gets its tokens a few an update whatever the stream interval (prompt logprobs, sent whole
# with the first, are bounded by the router).
MAX_LOGPROB_ENTRIES_PER_MESSAGE = 4 << 20


def logprobs_interval(interval: int, n: int | None) -> int:
    """Tokens per update for a request with top-n logprobs: `interval` unless so many tokens'
    logprobs would not fit in one message."""
    if n is None:
        return interval
    return max(1, min(interval, MAX_LOGPROB_ENTRIES_PER_MESSAGE // (n + 1)))


class OutputProcessor:
    """Detokenizes core outputs; finds stop strings (the core must then be told to stop).

    stream_interval (DELTA only; vLLM's and SGLang's --stream-interval): a request's updates after
    its first carry at least this many tokens, or finish it. Every token still arrives, in fewer
    messages: each hop of a stream (the service's gRPC, the router, the client's HTTP) pays per
    message, which a GPU's decode batch of hundreds makes the serving path's cost. A request's
    SamplingParams.stream_interval raises its own interval above this one (never below)."""

    def __init__(self, tokenizer, kind: OutputKind = OutputKind.CUMULATIVE, stream_interval: int = 1,
                 stop_tokenizer=None) -> None:
        """`tokenizer` None: token ids only, no text; `stop_tokenizer` then still detokenizes
        the requests that have text stop strings, to stop them where they match (the services:
        the router makes the text, and finds the same stop string)."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.tokenizer = tokenizer
        self.stop_tokenizer = tokenizer if tokenizer is not None else stop_tokenizer
        self.kind = kind
        self.stream_interval = stream_interval if kind is OutputKind.DELTA else 1
        self.states: dict[str, RequestState] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams, find_stop: bool = True, output_prefix: tuple[int, ...] = ()) -> None:
        """find_stop False: the request's stop strings are left to whoever reads its tokens (a
        prefill's one token: its KV is published before the front end could see a match).
        output_prefix: output this request has before this engine's (a decode's first token, which
        the prefill sampled): read for stop strings, so one spanning it and this engine's first
        tokens stops here too; not shown again."""
        tokenizer = self.tokenizer
        if tokenizer is None and params.stop and find_stop:
            tokenizer = self.stop_tokenizer
        state = RequestState(request_id, prompt, prompt_token_ids, params, tokenizer)
        if state.detokenizer is not None and output_prefix:
            state.detokenizer.add_prefix(list(output_prefix))
        if self.kind is OutputKind.DELTA:
            state.interval = logprobs_interval(max(self.stream_interval, params.stream_interval or 1),
                                               params.logprobs)
        self.states[request_id] = state

    def abort(self, request_id: str) -> RequestOutput | None:
        """The final, aborted output of a request still in flight (None if there is none)."""
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        out = self._make(state, "", [], None, "abort", None, True)
        return out if state.held is None else merge_delta(state.held, out)

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        outputs, stopped = [], []
        final_only = self.kind is OutputKind.FINAL_ONLY
        for co in core_outputs:
            state = self.states.get(co.request_id)
            if state is None:
                continue
            finish_reason, stop_reason = co.finish_reason, co.stop_reason
            new_ids = co.new_token_ids
            delta = ""
            if state.detokenizer is not None:
                delta = state.detokenizer.add_tokens(new_ids, finished=co.finished)
                if state.detokenizer.stopped_on is not None:
                    if not co.finished:  # a stop string matched here: the core must stop too
                        stopped.append(co.request_id)
                    finish_reason, stop_reason = "stop", state.detokenizer.stopped_on
            finished = co.finished or finish_reason is not None
            new_lps = None
            if state.logprobs is not None and co.new_logprobs:
                new_lps = [_entry(tok, lp) for tok, lp in zip(new_ids, co.new_logprobs)]
                if self.kind is not OutputKind.DELTA:
                    state.logprobs.extend(new_lps)
            if self.kind is not OutputKind.DELTA:
                state.token_ids.extend(new_ids)
            if co.prompt_logprobs is not None:
                state.prompt_logprobs = [_entry(tok, lp) for tok, lp in
                                         zip(state.prompt_token_ids[1:], co.prompt_logprobs)]
                state.prompt_logprob_ranks = [lp[2] for lp in co.prompt_logprobs]
            if finished:
                del self.states[co.request_id]
            elif final_only:
                continue
            out = self._make(state, delta, new_ids, new_lps, finish_reason, stop_reason, finished,
                             co.num_cached_tokens)
            out.kv_handle = co.kv_handle
            out.prompt_logprobs, out.prompt_logprob_ranks = state.prompt_logprobs, state.prompt_logprob_ranks
            out.queue_time = co.queue_time
            if state.interval > 1:
                out = self._interval(state, out)
                if out is None:
                    continue
            outputs.append(out)
        return outputs, stopped

    def _interval(self, state: RequestState, out: RequestOutput) -> RequestOutput | None:
        """`out` with the updates held before it, or None while it stays short of the interval."""
        if state.held is not None:
            out, state.held = merge_delta(state.held, out), None
        if out.finished or not state.streamed or len(out.outputs[0].token_ids) >= state.interval:
            state.streamed = True
            return out
        state.held = out
        return None

    def _make(self, state: RequestState, delta: str, new_ids: list[int], new_logprobs: list | None,
              finish_reason, stop_reason, finished: bool, num_cached_tokens: int = 0) -> RequestOutput:
        if self.kind is OutputKind.DELTA:
            completion = CompletionOutput(0, delta, list(new_ids), finish_reason, stop_reason,
                                          (new_logprobs or []) if state.logprobs is not None else None)
        else:
            text = state.detokenizer.text if state.detokenizer is not None else ""
            completion = CompletionOutput(0, text, list(state.token_ids), finish_reason, stop_reason,
                                          state.logprobs)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion],
                             finished, num_cached_tokens, delta, list(new_ids))
