"""Continuous batching: token budget, chunked prefill, prefix hits, preemption by recompute.

Pure Python (no torch): drive it in tests with fake model outputs.
"""
from __future__ import annotations

import heapq
import time
import itertools
from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    # Parallel lists: request i computes num_scheduled_tokens[i] tokens this step.
    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # since the last step
    # Requests whose blocks were just allocated for KV coming from a prefill instance:
    # (request, number of leading prompt tokens already cached locally, block ids).
    remote_kv_allocations: list[tuple[Request, int, list[int]]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


@dataclass
class ModelOutput:
    """One sampled token per scheduled request that caught up with its known tokens, in order."""
    sampled_token_ids: list[int]
    # Per sampled token: (logprob of the sampled token, [(token id, logprob), ...top-n]) or None.
    logprobs: list | None = None
    # request id -> prompt-token logprob entries computed this step (same entry shape).
    prompt_logprobs: dict[str, list] | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list | None = None
    num_cached_tokens: int = 0
    kv_handle: bytes | None = None  # prefill role: the published prompt blocks
    prompt_logprobs: list | None = None  # with the first token, when asked for
    queue_time: float | None = None  # with the first token: seconds from arrival to first scheduled


_FINISHED = frozenset(s for s in RequestStatus if s.finished)


def check_stop(params, num_output_tokens: int, token: int, eos_token_id: int | None,
               num_tokens: int, max_model_len: int) -> tuple[RequestStatus | None, int | None]:
    """Does `token` (the num_output_tokens-th output) end the request? (status, stop token id)"""
    if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    if num_output_tokens < params.min_tokens:
        return None, None
    if not params.ignore_eos and token == eos_token_id:
        return RequestStatus.FINISHED_STOPPED, None
    if token in params.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED, token
    return None, None


class WaitingQueue:
    """FCFS is a deque; the priority policy orders by (priority, arrival)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list = []
        self._counter = itertools.count()

    def add(self, request: Request, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))
        elif front:
            self._fifo.appendleft(request)
        else:
            self._fifo.append(request)

    def peek(self) -> Request:
        return self._heap[0][3] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, request: Request) -> bool:
        if self.policy == "priority":
            for i, entry in enumerate(self._heap):
                if entry[3] is request:
                    self._heap.pop(i)
                    heapq.heapify(self._heap)
                    return True
            return False
        try:
            self._fifo.remove(request)
            return True
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __iter__(self):
        return iter([e[3] for e in self._heap] if self.policy == "priority" else self._fifo)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 max_model_len: int) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.waiting_for_remote_kv: dict[str, Request] = {}
        self._finished_since_step: list[str] = []
        self.num_preemptions = 0
        # Prefill role: finished requests whose prompt blocks stay pinned for a decode pull.
        self.pinned: dict[str, Request] = {}
        self.newly_pinned: list[Request] = []

    # -- intake ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        if request.remote_kv is not None:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting.add(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_for_remote_kv)

    # -- one step ---------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_step)
        self._finished_since_step = []
        budget = self.config.max_num_batched_tokens
        preempted_any = False
        scheduled_index: dict[str, int] = {}

        running = self.running
        allocate = self.kv.allocate_slots
        scheduled, num_scheduled = out.scheduled, out.num_scheduled_tokens
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            n = len(request.all_token_ids) - request.num_computed_tokens
            if n > budget:
                n = budget
            if n <= 0:
                i += 1
                continue
            while True:
                new_ids = allocate(request, n)
                if new_ids is not None:
                    break
                victim = self._pick_victim()
                running.remove(victim)
                if victim.request_id in scheduled_index:
                    budget += self._unschedule(out, scheduled_index, victim)
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                preempted_any = True
                if victim is request:
                    break
            if new_ids is None:
                continue  # `request` itself was preempted; running[i] is now the next one
            if preempted_any:  # a victim before `request` shifts the list
                i = running.index(request)
            scheduled_index[request.request_id] = len(scheduled)
            scheduled.append(request)
            num_scheduled.append(n)
            budget -= n
            i += 1

        if not preempted_any:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        cfg = self.config
        while len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            request = self.waiting.peek()
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                # Pull model: admit only with room for the whole prompt; no compute budget used.
                n = request.num_prompt_tokens - num_hit_tokens
                new_ids = self.kv.allocate_slots(request, n, hits, cache_now=False)
                if new_ids is None:
                    break
                self.waiting.pop()
                request.num_computed_tokens = num_hit_tokens
                request.num_cached_tokens = num_hit_tokens
                self.waiting_for_remote_kv[request.request_id] = request
                out.remote_kv_allocations.append(
                    (request, num_hit_tokens, list(self.kv.get_block_ids(request.request_id))))
                continue
            n = request.num_tokens - num_hit_tokens
            if n > budget:
                if not cfg.enable_chunked_prefill:
                    break
                n = budget
            new_ids = self.kv.allocate_slots(request, n, hits)
            if new_ids is None:
                break
            self.waiting.pop()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit_tokens
                request.queue_time = time.monotonic() - request.arrival_time
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(request)
            out.num_scheduled_tokens.append(n)
            budget -= n

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _unschedule(self, out: SchedulerOutput, index: dict[str, int], request: Request) -> int:
        j = index.pop(request.request_id)
        n = out.num_scheduled_tokens[j]
        del out.scheduled[j], out.num_scheduled_tokens[j]
        for rid, k in index.items():
            if k > j:
                index[rid] = k - 1
        return n

    def _preempt(self, request: Request) -> None:
        """Recompute later: drop the blocks (the prefix cache may still hold them)."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if request.prompt_logprobs is not None and request.num_output_tokens == 0:
            request.prompt_logprobs = []  # recomputed from the start
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request, front=True)

    # -- results ---------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, model_output: ModelOutput) -> list[EngineCoreOutput]:
        results: list[EngineCoreOutput] = []
        sampled = model_output.sampled_token_ids
        logprobs = model_output.logprobs
        k = 0
        any_finished = False
        prompt_lps = model_output.prompt_logprobs or {}
        finished_states = _FINISHED
        for request, n in zip(out.scheduled, out.num_scheduled_tokens):
            if request.prompt_logprobs is not None and request.request_id in prompt_lps:
                request.prompt_logprobs.extend(prompt_lps[request.request_id])
            request.num_computed_tokens += n
            tokens = request.all_token_ids
            if request.num_computed_tokens < len(tokens):
                continue  # a prefill chunk: nothing sampled yet
            token = sampled[k]
            lp = logprobs[k] if logprobs is not None else None
            k += 1
            if request.status in finished_states:
                continue  # aborted while the step ran
            tokens.append(token)
            status = self._check_stop(request, token)
            result = EngineCoreOutput(request.request_id, [token],
                                      new_logprobs=[lp] if lp is not None else None,
                                      num_cached_tokens=request.num_cached_tokens)
            if len(tokens) - request.num_prompt_tokens == 1:
                result.queue_time = request.queue_time
                if request.prompt_logprobs is not None:
                    result.prompt_logprobs = request.prompt_logprobs
            if status is not None:
                request.status = status
                result.finish_reason = status.finish_reason
                result.stop_reason = request.stop_reason
                self._free_request(request)
                any_finished = True
            results.append(result)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished()]
        return results

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        num_tokens = len(request.all_token_ids)
        num_out = num_tokens - request.num_prompt_tokens
        if (num_out < params.max_tokens and num_tokens < self.max_model_len and token != request.eos_token_id
                and not params.stop_token_ids):
            return None  # the common case, decided without the general function
        status, reason = check_stop(request.sampling_params, request.num_output_tokens, token,
                                    request.eos_token_id, request.num_tokens, self.max_model_len)
        if reason is not None:
            request.stop_reason = reason
        return status

    # -- remote KV and aborts --------------------------------------------------------
    def finish_remote_kv(self, request_id: str, success: bool) -> None:
        """KV for the prompt arrived (or failed: then the prompt is recomputed locally)."""
        request = self.waiting_for_remote_kv.pop(request_id, None)
        if request is None:
            return
        if success:
            request.num_computed_tokens = request.num_prompt_tokens
            self.kv.cache_blocks(request, request.num_prompt_tokens)
        request.status = RequestStatus.RUNNING
        request.remote_kv = None
        self.running.append(request)

    def finish_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Abort (or stop, e.g. on a stop string) requests wherever they are."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        removed = False
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                removed = True
            elif rid in self.waiting_for_remote_kv:
                del self.waiting_for_remote_kv[rid]
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
        if removed:
            self.running = [r for r in self.running if not r.is_finished()]

    def _free_request(self, request: Request) -> None:
        if request.publish_kv and request.status != RequestStatus.FINISHED_ABORTED:
            self.pinned[request.request_id] = request
            self.newly_pinned.append(request)
        else:
            self.kv.free(request)
        self.requests.pop(request.request_id, None)
        self._finished_since_step.append(request.request_id)

    def free_pinned(self, request_id: str) -> None:
        """A decode instance pulled the blocks, or their lease ended: return them."""
        request = self.pinned.pop(request_id, None)
        if request is not None:
            self.kv.free(request)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(self.kv.get_block_ids(rid)) for rid in self.pinned)
