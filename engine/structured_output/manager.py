"""Grammars for the engine core: compiled off the step loop, cached, one matcher per request.

A request with structured outputs waits (status WAITING_FOR_FSM) here, outside the scheduler,
until its grammar is compiled; the scheduler never sees a request it could not run. Its matcher
is then made by accepting the output tokens it already has (a decode continuing a prefill's
first token, a migrated request's tokens so far), so every way into the engine is one rule.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading

from engine.request import Request, RequestStatus
from engine.structured_output.backends import AfterReasoningMatcher, GrammarBackend, GrammarError, Matcher, make_backend
from engine.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class StructuredOutputRequest:
    """One request's grammar: its compile (a future, maybe shared) and then its matcher.

    For speculative decoding: `validate_tokens` and `fill_bitmask_for_proposals` read the
    grammar along proposed tokens and leave it where it was; `accept_token` / `rollback` move it.
    """

    def __init__(self, params: StructuredOutputsParams, compiled: concurrent.futures.Future) -> None:
        self.params = params
        self.compiled = compiled
        self.matcher: Matcher | None = None
        self.rejected_token: int | None = None  # a sampled token the grammar refused (a bug)

    def accept_token(self, token_id: int) -> bool:
        if self.matcher.accept_token(token_id):
            return True
        self.rejected_token = token_id
        return False

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask, row: int) -> None:
        self.matcher.fill_bitmask(bitmask, row)

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of token_ids the grammar would accept; no state change."""
        return self.matcher.validate_tokens(token_ids)

    def fill_bitmask_for_proposals(self, proposals: list[int], bitmask, start_row: int) -> int:
        """Rows start_row + j, j = 0..len(proposals): what the grammar allows after the first j
        proposals (the target model's verification of k proposals samples k + 1 positions).
        Returns how many proposals the grammar accepts; rows past that one are left as they
        were (their positions can never be accepted). The matcher ends where it started."""
        accepted = 0
        self.matcher.fill_bitmask(bitmask, start_row)
        for j, token in enumerate(proposals):
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            accepted += 1
            self.matcher.fill_bitmask(bitmask, start_row + j + 1)
        if accepted:
            self.matcher.rollback(accepted)
        return accepted


def _reusable(future: concurrent.futures.Future) -> bool:
    """A compile in flight or done is shared; one that failed is too when the spec was at fault
    (it would fail again), not when something else broke (a retry may succeed)."""
    if not future.done():
        return True
    error = future.exception()
    return error is None or isinstance(error, GrammarError)


class StructuredOutputManager:
    """Owns the grammar backends (made on first use: they need the tokenizer), a bounded LRU of
    compiles keyed by (backend, kind, spec, options), and the requests waiting for theirs."""

    def __init__(self, tokenizer_path: str, vocab_size: int, max_cached_grammars: int = 256,
                 num_compile_threads: int = 2) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.max_cached_grammars = max_cached_grammars
        self._pool = concurrent.futures.ThreadPoolExecutor(num_compile_threads, thread_name_prefix="grammar")
        self._cache: collections.OrderedDict[tuple, concurrent.futures.Future] = collections.OrderedDict()
        self._backends: dict[str, GrammarBackend] = {}
        self._backend_lock = threading.Lock()
        self._tokenizer = None
        self.waiting: dict[str, Request] = {}  # request id -> request, in arrival order
        self.num_compiles = 0
        self.num_cache_hits = 0

    # -- intake ---------------------------------------------------------------
    def add(self, request: Request) -> bool:
        """Attach the request's grammar; True when it must wait for the compile (it is then
        held here, status WAITING_FOR_FSM), False when it can be scheduled now."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return False
        key = params.cache_key
        future = self._cache.get(key)
        if future is not None and _reusable(future):
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
        else:  # first sight, or an earlier attempt failed for a reason other than the spec
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            self.num_compiles += 1
            while len(self._cache) > self.max_cached_grammars:
                self._cache.popitem(last=False)
        request.structured_output = StructuredOutputRequest(params, future)
        request.status = RequestStatus.WAITING_FOR_FSM
        self.waiting[request.request_id] = request
        return True

    def remove(self, request_ids) -> None:
        for rid in request_ids:
            self.waiting.pop(rid, None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def take_settled(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The waiting requests whose compile finished: (ready to schedule, [(failed, why)])."""
        ready, failed = [], []
        for rid, request in list(self.waiting.items()):
            so = request.structured_output
            if not so.compiled.done():
                continue
            del self.waiting[rid]
            try:
                backend, compiled = so.compiled.result()
                so.matcher = self._backend(backend).matcher(compiled)
                if so.params.reasoning_end:
                    so.matcher = AfterReasoningMatcher(so.matcher, so.params.reasoning_end)
            except GrammarError as e:
                failed.append((request, str(e)))
                continue
            except Exception as e:  # the backend itself broke: still this request's failure alone
                logger.exception("structured outputs: compiling the grammar of %s failed", rid)
                failed.append((request, f"structured outputs: the grammar could not be compiled ({e})"))
                continue
            # A resumed request's earlier output (the prompt's last sampling_params.resumed_tokens
            # tokens, checked against the prompt's length on admission) and this engine's.
            replay = request.output_history
            bad = next((t for t in replay if not so.matcher.accept_token(t)), None)
            if bad is not None:
                failed.append((request, f"structured outputs: output token {bad} (generated before this "
                                        "engine resumed the request) does not match the grammar"))
                continue
            request.status = RequestStatus.WAITING
            ready.append(request)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until some waiting request's compile finishes (or timeout)."""
        futures = [r.structured_output.compiled for r in self.waiting.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    # -- compiling (worker threads) ----------------------------------------------
    def _compile(self, params: StructuredOutputsParams) -> tuple[str, object]:
        """(the backend that compiled it, the compiled grammar). auto: xgrammar, and llguidance
        for a spec xgrammar refuses (as vLLM's auto: a schema feature, a Lark grammar); if both
        refuse, xgrammar's reason is the one reported."""
        name = params.resolved_backend
        try:
            return name, self._backend(name).compile(params)
        except GrammarError as error:
            if params.backend != "auto":
                raise
            try:
                return "llguidance", self._backend("llguidance").compile(params)
            except GrammarError:
                raise error from None

    def _backend(self, name: str) -> GrammarBackend:
        with self._backend_lock:
            backend = self._backends.get(name)
            if backend is None:
                if self._tokenizer is None:
                    from engine.processor import load_tokenizer

                    self._tokenizer = load_tokenizer(self.tokenizer_path)
                eos = self._tokenizer.eos_token_id
                backend = self._backends[name] = make_backend(name, self._tokenizer, self.vocab_size,
                                                              [eos] if eos is not None else [])
            return backend

    def stats(self) -> dict:
        return {"grammar_compiles": self.num_compiles, "grammar_cache_hits": self.num_cache_hits,
                "num_waiting_for_grammar": len(self.waiting)}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
