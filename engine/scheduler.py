"""Continuous batching: token budget, chunked prefill, prefix hits, preemption by recompute,
and KV loaded from (or kept for) another engine through the KV connector's scheduler side.

Pure Python (no torch): drive it in tests with fake model outputs.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import DuplicateRequestError, Request, RequestStatus
from engine.scheduler_output import EngineCoreOutput, ModelOutput, SchedulerOutput
from engine.waiting_queue import WaitingQueue

if TYPE_CHECKING:
    from engine.kv_connector import KVConnectorOutput, KVConnectorScheduler
    from engine.kv_events import ZmqEventPublisher
    from engine.spec_decode.config import SpeculativeConfig


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


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int,
                 connector: "KVConnectorScheduler | None" = None,
                 kv_event_publisher: "ZmqEventPublisher | None" = None,
                 speculative: "SpeculativeConfig | None" = None, max_loras: int | None = None) -> None:
        self.config = config
        self.max_loras = max_loras  # --max-loras: distinct LoRA adapters among the running at most
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.connector = connector
        # Each step's KV events (blocks stored, evicted) go out in one batch when the step ends.
        self.kv_event_publisher = kv_event_publisher
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        # Admitted (they hold blocks and a seat in the batch) while their KV is loaded remotely.
        self.waiting_for_remote_kv: dict[str, Request] = {}
        # Finished requests whose blocks the connector still uses: published for another
        # engine's pull, or an aborted load still writing into them.
        self.finished_holding_blocks: dict[str, Request] = {}
        self._finished_since_step: list[str] = []
        # Blocks allocated per request since the model runner last heard of it.
        self._unsent_block_ids: dict[str, list[int]] = {}
        self.num_preemptions = 0
        # Speculative decoding: the most proposals a row verifies per step, and the KV slots a row
        # holds past its verified tokens for a draft model's own writes.
        self.max_spec_tokens = speculative.num_speculative_tokens if speculative is not None else 0
        self.num_lookahead_slots = speculative.num_lookahead_slots if speculative is not None else 0
        self._kept_blocks: dict[str, int] = {}  # for the model runner's block tables
        self.spec_num_drafts = 0  # rows that verified proposals
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * self.max_spec_tokens

    # -- intake ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.finished_holding_blocks:
            # A finished request whose blocks are still held keeps its id: a second one would
            # share its KV manager entry, and free blocks under the first one's transfer.
            raise DuplicateRequestError(f"request id {request.request_id!r} is already in use")
        if (request.remote_kv is not None or request.publish_kv) and self.connector is None:
            raise ValueError("this engine has no KV connector: it cannot take part in disaggregation")
        if request.remote_kv is not None:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        if self.connector is not None:
            self.connector.add_request(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_transfers(self) -> bool:
        """Finished requests whose blocks come back only when the connector says so."""
        return bool(self.finished_holding_blocks)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_for_remote_kv)

    @property
    def num_seats_taken(self) -> int:
        """Against max_num_seqs: requests running and requests admitted to load remote KV."""
        return len(self.running) + len(self.waiting_for_remote_kv)

    # -- one step ---------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_step, num_kept_blocks=self._kept_blocks)
        self._finished_since_step = []
        self._kept_blocks = {}
        budget = self.config.max_num_batched_tokens
        preempted_any = False
        scheduled_index: dict[str, int] = {}

        running = self.running
        scheduled, num_scheduled = out.scheduled, out.num_scheduled_tokens
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            n = len(request.all_token_ids) - request.num_computed_tokens
            spec = request.spec_token_ids
            if spec:
                spec = self._trim_proposals(request, spec, n, budget)
                n += len(spec)
            if n > budget:
                n = budget
            if n <= 0:
                i += 1
                continue
            lookahead = 0
            if self.num_lookahead_slots and request.num_computed_tokens + n >= request.num_tokens:
                lookahead = min(self.num_lookahead_slots, self.max_model_len - request.num_computed_tokens - n)
            while True:
                new_ids = self._allocate(request, n + lookahead)
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
            self._add_scheduled(out, request, n)
            if spec:
                out.spec_token_ids[request.request_id] = spec
            budget -= n
            i += 1

        if not preempted_any:
            self._schedule_waiting(out, budget)
        assert self.num_seats_taken <= self.config.max_num_seqs, "max_num_seqs exceeded"
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta()
        return out

    def _trim_proposals(self, request: Request, spec: list[int], n: int, budget: int) -> list[int]:
        """The proposals a decode-phase row verifies: within the step's budget (the row's own token
        first), max_tokens and max_model_len (the target's token after them must still be one the
        request may produce)."""
        if n != 1:
            return []  # proposals follow the known tokens: a row still catching up has none
        p = request.sampling_params
        limit = min(self.max_spec_tokens, budget - 1, p.max_tokens - request.num_output_tokens - 1,
                    self.max_model_len - request.num_tokens - 1)
        return spec[:limit] if limit > 0 else []

    def _allocate(self, request: Request, n: int, hits=(), cache_now: bool = True) -> list[int] | None:
        new_ids = self.kv.allocate_slots(request, n, hits, cache_now=cache_now)
        if new_ids:
            self._unsent_block_ids.setdefault(request.request_id, []).extend(new_ids)
        return new_ids

    def _add_scheduled(self, out: SchedulerOutput, request: Request, n: int) -> None:
        out.scheduled.append(request)
        out.num_scheduled_tokens.append(n)
        out.new_block_ids.append(self._unsent_block_ids.pop(request.request_id, []))

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        cfg = self.config
        skipped: list[Request] = []  # --max-loras: for an adapter too many, passed over this step
        adapters = self._active_adapters()  # None without --max-loras
        while len(self.waiting) and budget > 0 and self.num_seats_taken < cfg.max_num_seqs:
            request = self.waiting.peek()
            name = request.sampling_params.lora_name
            if adapters is not None and name is not None and name not in adapters \
                    and len(adapters) >= self.max_loras:  # one too many: passed over, keeping its place
                skipped.append(self.waiting.pop())
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                admitted = self._admit_remote(request, hits, num_hit_tokens)
                if admitted is None:
                    break
                if admitted:
                    if adapters is not None and name is not None:
                        adapters.add(name)
                    continue
                request.status = RequestStatus.WAITING  # nothing to load: compute it here
            n = request.num_tokens - num_hit_tokens
            if n > budget:
                if not cfg.enable_chunked_prefill:
                    break
                n = budget
            if self._allocate(request, n, hits) is None:
                break
            self.waiting.pop()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit_tokens
                request.queue_time = time.monotonic() - request.arrival_time
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_scheduled(out, request, n)
            budget -= n
            if adapters is not None and name is not None:
                adapters.add(name)
        for request in reversed(skipped):  # back where they were, ahead of the rest
            self.waiting.add(request, front=True)

    def _active_adapters(self) -> set[str] | None:
        """--max-loras (vLLM's rule): the adapters of the requests running or loading their KV; a
        waiting request for one more than the cap is passed over this step, keeping its place,
        and the requests behind it go on. None without the cap."""
        if self.max_loras is None:
            return None
        return self._running_adapters()

    def _running_adapters(self) -> set[str]:
        """The adapters of the requests running or loading their KV."""
        active = {r.sampling_params.lora_name for r in self.running}
        active.update(r.sampling_params.lora_name for r in self.waiting_for_remote_kv.values())
        active.discard(None)
        return active

    def adapters_to_run(self) -> set[str]:
        """The adapters the next step may run (--max-cpu-loras stages them in host memory first):
        those of the requests running or loading their KV, then those of the waiting requests
        `_schedule_waiting` could admit (in the order it pops them, as many as there are free
        seats) while --max-loras has room, as it admits them."""
        active = self._running_adapters()
        for request in self.waiting.first(max(0, self.config.max_num_seqs - self.num_seats_taken)):
            if self.max_loras is not None and len(active) >= self.max_loras:
                break
            if request.sampling_params.lora_name is not None:
                active.add(request.sampling_params.lora_name)
        return active

    def _admit_remote(self, request: Request, hits, num_hit_tokens: int) -> bool | None:
        """Pull model: admit only with room for the whole prompt; no compute budget used.
        True: admitted to load; False: nothing to load, compute it here; None: not now."""
        num_external = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        if num_external is None:
            return None
        if num_external == 0:
            return False
        if self._allocate(request, request.num_prompt_tokens - num_hit_tokens, hits, cache_now=False) is None:
            return None
        self.waiting.pop()
        request.num_computed_tokens = request.num_cached_tokens = num_hit_tokens
        request.queue_time = time.monotonic() - request.arrival_time
        self.waiting_for_remote_kv[request.request_id] = request
        self.connector.update_state_after_alloc(request, self.kv.get_block_ids(request.request_id),
                                                num_external)
        return True

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _unschedule(self, out: SchedulerOutput, index: dict[str, int], request: Request) -> int:
        j = index.pop(request.request_id)
        n = out.num_scheduled_tokens[j]
        del out.scheduled[j], out.num_scheduled_tokens[j], out.new_block_ids[j]
        out.spec_token_ids.pop(request.request_id, None)
        for rid, k in index.items():
            if k > j:
                index[rid] = k - 1
        return n

    def _preempt(self, request: Request) -> None:
        """Recompute later: drop the blocks (the prefix cache may still hold them)."""
        self.kv.free(request)
        self._unsent_block_ids.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        self._kept_blocks.pop(request.request_id, None)
        if request.prompt_logprobs is not None and request.num_output_tokens == 0:
            request.prompt_logprobs = []  # recomputed from the start
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request, front=True)

    # -- results ---------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, model_output: ModelOutput) -> list[EngineCoreOutput]:
        results: list[EngineCoreOutput] = []
        sampled = model_output.sampled_token_ids
        runs = model_output.sampled_token_runs
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
            if runs is None:
                new_tokens = [sampled[k]]
                lps = [logprobs[k]] if logprobs is not None and logprobs[k] is not None else None
            else:
                new_tokens = runs[k]
                lps = logprobs[k] if logprobs is not None else None
            k += 1
            if request.status in finished_states:
                continue  # aborted while the step ran
            request.spec_token_ids = []  # verified now, or not at all
            if out.spec_token_ids:
                self._settle_proposals(request, len(out.spec_token_ids.get(request.request_id, ())), new_tokens)
            # Token by token: a stop in the middle of an accepted run drops the tokens after it.
            for j, token in enumerate(new_tokens):
                tokens.append(token)
                status = self._check_stop(request, token)
                if status is not None:
                    new_tokens = new_tokens[:j + 1]
                    break
            result = EngineCoreOutput(request.request_id, new_tokens,
                                      new_logprobs=lps[:len(new_tokens)] if lps is not None else None,
                                      num_cached_tokens=request.num_cached_tokens)
            if len(tokens) - request.num_prompt_tokens == len(new_tokens):
                result.queue_time = request.queue_time
                if request.prompt_logprobs is not None:
                    result.prompt_logprobs = request.prompt_logprobs
            if status is not None:
                request.status = status
                result.finished = True
                result.finish_reason = status.finish_reason
                result.stop_reason = request.stop_reason
                result.kv_handle = self._free_request(request)
                any_finished = True
            results.append(result)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished()]
        if model_output.kv_connector_output is not None:
            self._update_from_kv_output(model_output.kv_connector_output)
        if self.kv_event_publisher is not None:
            events = self.kv.take_events()
            if events:
                self.kv_event_publisher.publish(events)
        return results

    def _settle_proposals(self, request: Request, num_spec: int, new_tokens: list[int]) -> None:
        """Rejected proposals were computed but are not tokens: step num_computed_tokens back over
        them and release the blocks only they needed."""
        if num_spec == 0:
            return
        num_accepted = len(new_tokens) - 1
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_spec
        self.spec_num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.spec_accepted_per_pos[pos] += 1
        num_rejected = num_spec - num_accepted
        if num_rejected:
            request.num_computed_tokens -= num_rejected
            kept = self.kv.free_tail(request, request.num_computed_tokens + max(1, self.num_lookahead_slots))
            if kept is not None:
                self._kept_blocks[request.request_id] = kept

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        if request.structured_output is not None:
            status = self._advance_grammar(request, token)
            if status is not None:
                return status
        params = request.sampling_params
        num_tokens = len(request.all_token_ids)
        num_out = num_tokens - request.num_prompt_tokens
        if (num_out < params.max_tokens and num_tokens < self.max_model_len and token != request.eos_token_id
                and not params.stop_token_ids and not request.prefill_only):
            return None  # the common case, decided without the general function
        status, reason = check_stop(request.sampling_params, request.num_output_tokens, token,
                                    request.eos_token_id, request.num_tokens, self.max_model_len)
        if reason is not None:
            request.stop_reason = reason
        if status is None and request.prefill_only:
            return RequestStatus.FINISHED_REMOTE_DECODE
        return status

    @staticmethod
    def _advance_grammar(request: Request, token: int) -> RequestStatus | None:
        """Structured outputs: the matcher takes each appended token; a grammar that has reached
        its end (it accepted its stop token) finishes the request with "stop"."""
        grammar = request.structured_output
        if not grammar.accept_token(token):  # the mask allowed it: a broken invariant, not input
            request.stop_reason = f"structured outputs: sampled token {token} does not match the grammar"
            return RequestStatus.FINISHED_ABORTED
        return RequestStatus.FINISHED_STOPPED if grammar.is_terminated() else None

    # -- KV connector and aborts --------------------------------------------------------
    def _update_from_kv_output(self, kv_out: "KVConnectorOutput") -> None:
        self.connector.update_connector_output(kv_out)
        for rid in kv_out.finished_recving:
            self._remote_kv_done(rid, success=True)
        for rid in kv_out.failed_recving:
            self._remote_kv_done(rid, success=False)  # recomputed here from what is cached
        for rid in kv_out.finished_sending:
            self._release_held_blocks(rid)

    def _remote_kv_done(self, request_id: str, success: bool) -> None:
        request = self.waiting_for_remote_kv.pop(request_id, None)
        if request is None:  # finished (aborted) while loading: its blocks are free to go now
            self._release_held_blocks(request_id)
            return
        if success:
            request.num_computed_tokens = request.num_prompt_tokens
            self.kv.cache_blocks(request, request.num_prompt_tokens)
        request.status = RequestStatus.RUNNING
        request.remote_kv = None
        self.running.append(request)

    def _release_held_blocks(self, request_id: str) -> None:
        request = self.finished_holding_blocks.pop(request_id, None)
        if request is not None:
            self.kv.free(request)

    def finish_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Abort (or stop, e.g. on a stop string) requests wherever they are; a finished request
        whose blocks are still held for a transfer has that transfer cancelled."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        removed = False
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                if rid in self.finished_holding_blocks:
                    self.connector.cancel(rid)  # its blocks come back with the connector's report
                continue
            if request.status == RequestStatus.RUNNING:
                removed = True
            elif self.waiting_for_remote_kv.pop(rid, None) is None:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
        if removed:
            self.running = [r for r in self.running if not r.is_finished()]

    def _free_request(self, request: Request) -> bytes | None:
        """Returns the KV handle when the connector keeps the blocks for another engine."""
        rid = request.request_id
        delay_free, kv_handle = False, None
        if self.connector is not None:
            delay_free, kv_handle = self.connector.request_finished(request, self.kv.get_block_ids(rid))
        if delay_free:
            self.finished_holding_blocks[rid] = request
        else:
            self.kv.free(request)
        self._unsent_block_ids.pop(rid, None)
        self.requests.pop(rid, None)
        self._finished_since_step.append(rid)
        return kv_handle

    @property
    def num_held_blocks(self) -> int:
        """Blocks of finished requests kept for transfers (published, or being aborted)."""
        return sum(len(self.kv.get_block_ids(rid)) for rid in self.finished_holding_blocks)
