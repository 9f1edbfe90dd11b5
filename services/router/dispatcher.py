"""One request's trip through the fleet: prefill (retried elsewhere on failure) then a decode stream,
which moves to another decode when its instance is lost mid-stream (migration)."""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from engine.block_hash import lora_key
from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.router.errors import ModelNotFound, RouterError, overloaded
from services.router.instances import Instance, InstancePool
from services.router.pd_policy import PdPolicy
from services.router.policy import RouteRequest, RoutingPolicy

logger = logging.getLogger(__name__)

Code = grpc.StatusCode
# Worth another instance: the failure says something about that instance, not the request.
RETRYABLE = {Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.UNKNOWN, Code.INTERNAL, Code.ABORTED,
             Code.CANCELLED, Code.RESOURCE_EXHAUSTED}
# A decode stream that broke this way after sending tokens lost its instance (killed, restarted,
# the engine core died, the connection reset), not the request: it goes on elsewhere. An explicit
# ABORTED, bad input or our own deadline is the request's fate, never migrated.
LOST = {Code.UNAVAILABLE, Code.UNKNOWN, Code.INTERNAL, Code.CANCELLED, Code.DATA_LOSS}
ABORT_TIMEOUT_S = 2.0


@dataclass
class TokenChunk:
    """Tokens as the engines produced them; the first chunk may carry prompt logprobs."""
    token_ids: list[int]
    logprobs: list = field(default_factory=list)  # pb.TokenLogprob per token, when asked for
    finish_reason: str | None = None
    stop_reason: str | None = None
    prompt_logprobs: list | None = None  # pb.TokenLogprob per prompt token after the first
    num_cached_tokens: int = 0


def _upstream_error(inst: Instance, e: grpc.aio.AioRpcError) -> RouterError:
    if e.code() == Code.INVALID_ARGUMENT:
        return RouterError(400, e.details() or "invalid request")
    return RouterError(502, f"{inst.role} instance {inst.address} failed: {e.code().name}: {e.details()}",
                       type="upstream_error")


class StreamLost(Exception):
    """A decode stream broke after it began: its instance is gone, the request may go on elsewhere."""

    def __init__(self, inst: Instance, reason: str) -> None:
        super().__init__(reason)
        self.inst = inst
        self.reason = reason


def continued_sampling(sampling: pb.SamplingParams, num_generated: int) -> pb.SamplingParams:
    """The same knobs (seed included) for a request that already has `num_generated` tokens (sent
    again as the prompt's tail): the token budgets shrink by them, the output penalties and bad
    words still count them as output; prompt logprobs were sent already."""
    s = pb.SamplingParams()
    s.CopyFrom(sampling)
    s.max_tokens = sampling.max_tokens - num_generated
    s.min_tokens = max(0, sampling.min_tokens - num_generated)
    s.resumed_tokens = sampling.resumed_tokens + num_generated  # a grammar resumes after them too
    s.ClearField("prompt_logprobs")
    return s


def _refuse_abort(inst: Instance, finish_reason: str | None) -> None:
    """An engine's "abort" is an error, never the end of a shorter answer (engines send ABORTED
    now; this keeps an older or foreign engine's abort from passing for a finished request)."""
    if finish_reason == "abort":
        raise RouterError(502, f"{inst.role} instance {inst.address} aborted the request",
                          type="upstream_error", code="upstream_aborted")


class Dispatcher:
    def __init__(self, pool: InstancePool, policy: RoutingPolicy, metrics, *, disaggregated: bool,
                 request_timeout_s: float, prefill_timeout_s: float, max_attempts: int,
                 migration_limit: int = 0, pd_policy: "PdPolicy | None" = None,
                 lora_paths: dict[str, str] | None = None) -> None:
        self.pool = pool
        # adapter name -> path: its prefix-cache key for routing (the served map: adapters come and go)
        self.lora_paths = lora_paths if lora_paths is not None else {}
        self.lora_streams: collections.Counter[str] = collections.Counter()  # requests running per adapter
        self.lora_last_used: dict[str, float] = {}  # adapter -> when a request last began with it
        self.policy = policy
        self.pd_policy = pd_policy  # disaggregated mode: prefill remotely, or on the decode itself
        self.metrics = metrics
        self.disaggregated = disaggregated
        self.request_timeout_s = request_timeout_s
        self.prefill_timeout_s = prefill_timeout_s
        self.max_attempts = max_attempts
        self.migration_limit = migration_limit
        self._background: set[asyncio.Task] = set()

    def _lora_key(self, sampling: pb.SamplingParams) -> tuple | None:
        return lora_key(sampling.lora_name or None, self.lora_paths)

    def check_available(self) -> None:
        """503 up front, before anything is streamed, when a role has no healthy instance, or no
        healthy prefill can pair with a healthy decode."""
        needs_prefill = self.disaggregated and not (
            self.pd_policy is not None and self.pd_policy.serves_without_prefill())
        for role in ("prefill", "decode") if needs_prefill else ("decode",):
            if not self.pool.healthy(role):  # else the decode instances compute the prompts
                raise RouterError(503, self.pool.unavailable_reason(role), code="no_healthy_instance")
        if needs_prefill:
            self._candidates("prefill", [], self.pool.healthy("decode"))

    def _can_pair(self, inst: Instance, other: Instance) -> bool:
        prefill, decode = (inst, other) if inst.role == "prefill" else (other, inst)
        return self.pool.pairs.can_pair(prefill, decode)

    def _paired(self, role: str, exclude, pair_with: list[Instance] | None) -> tuple[list[Instance], list[Instance]]:
        """(healthy instances of `role` not excluded, those of them that pair with one of
        `pair_with`); no pairing asked (None, or no instance to pair with): the same list twice."""
        healthy = [i for i in self.pool.healthy(role) if i not in exclude]
        if not pair_with:
            return healthy, healthy
        return healthy, [i for i in healthy if any(self._can_pair(i, o) for o in pair_with)]

    def _candidates(self, role: str, exclude, pair_with: list[Instance] | None) -> list[Instance]:
        """What a pick may choose from; a 503 naming every refused pair when some are healthy
        but none pairs (another model, KV layout, transport or sharding): at once, not a hang."""
        healthy, paired = self._paired(role, exclude, pair_with)
        if healthy and not paired:
            ours, theirs = (healthy, pair_with) if role == "prefill" else (pair_with, healthy)
            raise RouterError(503, self.pool.pairs.why_unpaired(ours, theirs), code="no_compatible_pair")
        return paired

    def _pick(self, route: RouteRequest, exclude: list[Instance],
              pair_with: list[Instance] | None = None) -> Instance:
        """`pair_with`: a prefill's possible decodes, or a decode's prefill (KV will move
        between them); None for a decode that computes the prompt itself."""
        candidates = self._candidates(route.role, exclude, pair_with)
        candidates = _serving(candidates, route.lora) or candidates  # those with the request's adapter
        if not candidates:
            reason = self.pool.unavailable_reason(route.role) if not exclude else (
                f"no other healthy {route.role} instance to retry on")
            raise RouterError(503, reason, code="no_healthy_instance")
        inst = self.policy.select(candidates, route)
        added = self.policy.added_load(inst, route)
        inst.routed_tokens += added
        if route.role == "prefill":
            inst.prefilling[route.request_id] = added  # until its Prefill call ends
        self.metrics.routing_decisions.labels(route.role, inst.address).inc()
        return inst

    def _can_retry(self, role: str, tried: list[Instance], exclude: list[Instance] = (),
                   pair_with: list[Instance] | None = None) -> bool:
        return len(tried) < self.max_attempts and bool(self._paired(role, [*tried, *exclude], pair_with)[1])

    def _failed(self, inst: Instance, request_id: str, e: grpc.aio.AioRpcError, retrying: bool) -> None:
        if e.code() == Code.UNAVAILABLE:
            self.pool.mark_unhealthy(inst, f"UNAVAILABLE: {e.details()}")
        if retrying:
            logger.warning("request %s: %s instance %s failed (%s: %s); retrying on another instance",
                           request_id, inst.role, inst.address, e.code().name, e.details())
            self.metrics.upstream_retries.labels(inst.role, inst.address, e.code().name).inc()

    @staticmethod
    def _remaining(deadline: float) -> float:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise RouterError(504, "the request timed out", code="timeout")
        return left

    async def stream(self, request_id: str, prompt_token_ids: list[int], sampling: pb.SamplingParams,
                     priority: int = 0) -> AsyncIterator[TokenChunk]:
        """Yields token chunks until one has a finish_reason. A decode lost mid-stream hands the
        request to another one (prompt + the tokens so far), up to `migration_limit` times, and the
        chunks run on as if nothing happened. Closing it early (a stop string, a client gone)
        cancels the decode stream and aborts a prefill whose KV was not pulled."""
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        lora = sampling.lora_name
        if lora:
            if lora not in self.lora_paths:  # unloaded since the request was read: never half-run
                raise ModelNotFound(lora)
            self.lora_streams[lora] += 1
            self.lora_last_used[lora] = time.monotonic()
        generated: list[int] = []
        lost: list[Instance] = []  # decodes that lost this request: it is not sent to them again
        upstream_id, params = request_id, sampling
        migrating, outcome = False, "closed"  # a migration under way, and how it ended
        try:
            while True:
                try:
                    async for chunk in self._attempt(upstream_id, prompt_token_ids + generated, params,
                                                     priority, deadline, lost):
                        generated += chunk.token_ids
                        if chunk.finish_reason is not None:
                            outcome = "completed"  # the reader may close us at this yield
                        yield chunk
                    return
                except StreamLost as e:
                    self._abort_later(e.inst, upstream_id)  # it may be alive, only cut off from us
                    if sampling.max_tokens - len(generated) <= 0:  # lost with its last token sent
                        outcome = "completed"
                        yield TokenChunk([], finish_reason="length")
                        return  # nothing left to migrate
                    if migrating:
                        self.metrics.migrations.labels("lost_again").inc()
                    migrating = False
                    lost.append(e.inst)
                    if len(lost) > self.migration_limit:
                        self.metrics.migrations.labels("limit_reached").inc()
                        raise RouterError(502, f"{e.reason}; not migrated: the migration limit "
                                               f"({self.migration_limit}) is reached",
                                          code="migration_limit_reached") from None
                    logger.warning("request %s lost after %d tokens (%s); migrating it to another "
                                   "decode instance (migration %d of at most %d)", request_id,
                                   len(generated), e.reason, len(lost), self.migration_limit)
                    upstream_id = f"{request_id}-m{len(lost)}"  # the old id may still be held there
                    params = continued_sampling(sampling, len(generated))
                    migrating = True
        except (GeneratorExit, asyncio.CancelledError):
            raise  # the reader stopped: a stop string, or the client left
        except BaseException:
            outcome = "failed"
            raise
        finally:
            if migrating:
                self.metrics.migrations.labels(outcome).inc()
            if lora:
                self.lora_streams[lora] -= 1
                if not self.lora_streams[lora]:
                    del self.lora_streams[lora]

    async def _attempt(self, request_id: str, prompt_token_ids: list[int], sampling: pb.SamplingParams,
                       priority: int, deadline: float, lost: list[Instance]) -> AsyncIterator[TokenChunk]:
        """One upstream request: prefill (when disaggregated) then a decode stream; raises
        StreamLost when the decode instance is lost after it began."""
        decode_route = RouteRequest(request_id, "decode", prompt_token_ids, sampling.cache_salt or None,
                                    max_new_tokens=sampling.max_tokens, lora=self._lora_key(sampling))
        local = not self.disaggregated
        if not local and self.pd_policy is not None:
            decision = self.pd_policy.decide(decode_route, lost)
            decode_route, local = decision.route, not decision.disaggregate
        if local:
            req = pb.DecodeRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                   sampling=sampling, priority=priority)
            async for chunk in self._decode(decode_route, req, deadline, lost):
                yield chunk
            return
        pinned: Instance | None = None  # prefill instance holding KV that no decode has pulled yet
        try:
            prefill, resp = await self._prefill(request_id, prompt_token_ids, sampling, priority, deadline,
                                                lost)
            # The prefill engine ran the request with its real parameters: its finish reason is
            # the answer, and when it has one nothing was published and no decode follows.
            finish = resp.finish_reason or None
            _refuse_abort(prefill, finish)
            if finish is None:
                pinned = prefill
            first = TokenChunk([resp.first_token_id],
                               [resp.first_logprob] if resp.HasField("first_logprob") else [],
                               finish_reason=finish, stop_reason=resp.stop_reason or None,
                               prompt_logprobs=list(resp.prompt_logprobs), num_cached_tokens=resp.num_cached_tokens)
            if finish is not None:
                yield first
                return
            req = pb.DecodeRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                   sampling=sampling, first_token_id=resp.first_token_id,
                                   kv_handle=resp.kv_handle, priority=priority)
            # The first token waits for a decode to take the request: when every decode is full
            # the client gets a 429 before anything was streamed, not a broken stream.
            async for chunk in self._decode(decode_route, req, deadline, lost, first=first, prefill=prefill):
                if chunk is not first:
                    pinned = None  # decode answered: it pulled the KV (or recomputed) and prefill freed it
                yield chunk
        finally:
            if pinned is not None:
                self._abort_later(pinned, request_id)

    async def _prefill(self, request_id: str, prompt_token_ids: list[int], sampling: pb.SamplingParams,
                       priority: int, deadline: float, lost: list[Instance]) -> tuple[Instance, pb.PrefillResponse]:
        req = pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                sampling=sampling, publish_kv=True, priority=priority)
        route = RouteRequest(request_id, "prefill", prompt_token_ids, sampling.cache_salt or None,
                             max_new_tokens=1, lora=self._lora_key(sampling))
        tried: list[Instance] = []
        failures: list[str] = []
        codes: set[grpc.StatusCode] = set()
        while True:
            decodes = [d for d in self.pool.healthy("decode") if d not in lost]  # only a prefill one can pull from
            decodes = _serving(decodes, route.lora) or decodes  # those with the request's adapter
            inst = self._pick(route, tried, decodes)
            tried.append(inst)
            try:
                timeout = min(self.prefill_timeout_s, self._remaining(deadline))
                return inst, await inst.prefill.Prefill(req, timeout=timeout)
            except asyncio.CancelledError:
                self._abort_later(inst, request_id)  # it may have pinned the KV already
                raise
            except grpc.aio.AioRpcError as e:
                if e.code() not in RETRYABLE:
                    raise _upstream_error(inst, e) from None
                self._abort_later(inst, request_id)  # timed out or half-failed: free what it holds
                failures.append(f"{inst.address}: {e.code().name}: {e.details()}")
                codes.add(e.code())
                retrying = self._can_retry("prefill", tried, pair_with=decodes)
                self._failed(inst, request_id, e, retrying)
                self._remaining(deadline)
                if not retrying and Code.RESOURCE_EXHAUSTED in codes:  # full, or full and down
                    raise overloaded("prefill", len(tried)) from None
                if not retrying:
                    raise RouterError(503, f"prefill failed on {len(tried)} instance(s): "
                                           f"{'; '.join(failures)}", code="upstream_failed") from None
            finally:
                inst.prefilling.pop(request_id, None)

    async def _decode(self, route: RouteRequest, req: pb.DecodeRequest, deadline: float, lost: list[Instance],
                      first: TokenChunk | None = None, prefill: Instance | None = None) -> AsyncIterator[TokenChunk]:
        """The decode stream, retried on another instance until it yields a token; `first` (the
        prefill's token) is yielded as soon as an instance has taken the request. With `prefill`
        (whose KV it pulls), only a decode that pairs with it is chosen."""
        tried: list[Instance] = []
        codes: set[grpc.StatusCode] = set()
        pair_with = [prefill] if prefill is not None else None
        while True:
            inst = self._pick(route, [*lost, *tried], pair_with)
            tried.append(inst)
            call = inst.decode.Decode(req, timeout=self._remaining(deadline))
            received = False
            inst.streams += 1
            open_here = True  # counted in inst.streams until the engine finishes it or the stream ends
            try:
                if first is not None:
                    # Headers come when the engine admitted the request (or with a refusal,
                    # which the loop below raises); an engine that sends none before its first
                    # token only delays this one.
                    await call.initial_metadata()
                    if not call.done():
                        chunk, first = first, None
                        yield chunk
                async for msg in call:
                    if first is not None:
                        chunk, first = first, None
                        yield chunk
                    received = True
                    _refuse_abort(inst, msg.finish_reason)
                    if msg.finish_reason:  # finished there; the reader may never resume this generator
                        inst.streams -= 1
                        open_here = False
                    yield TokenChunk(list(msg.token_ids), list(msg.logprobs),
                                     finish_reason=msg.finish_reason or None,
                                     stop_reason=msg.stop_reason or None,
                                     prompt_logprobs=list(msg.prompt_logprobs) or None,
                                     num_cached_tokens=msg.num_cached_tokens)
                    if msg.finish_reason:
                        return
                raise StreamLost(inst, f"decode instance {inst.address} ended the stream without a finish reason")
            except grpc.aio.AioRpcError as e:
                if e.code() == Code.DEADLINE_EXCEEDED:
                    self._remaining(deadline)  # the request's own deadline: 504
                if received and e.code() in LOST:
                    self._failed(inst, req.request_id, e, retrying=False)
                    raise StreamLost(inst, f"decode instance {inst.address} failed mid-stream: "
                                           f"{e.code().name}: {e.details()}") from None
                # Before the first token a decode failure is retried: nothing was shown yet, and
                # the new instance pulls the same KV (or recomputes the prompt if it is gone).
                if received or e.code() not in RETRYABLE:
                    raise _upstream_error(inst, e) from None
                codes.add(e.code())
                retrying = self._can_retry("decode", tried, lost, pair_with)
                self._failed(inst, req.request_id, e, retrying)
                self._remaining(deadline)
                if not retrying and Code.RESOURCE_EXHAUSTED in codes:  # full, or full and down
                    raise overloaded("decode", len(tried)) from None
                if not retrying:
                    raise _upstream_error(inst, e) from None
            finally:
                if open_here:
                    inst.streams -= 1
                if not call.done():
                    call.cancel()  # the decode engine sees the cancellation and aborts the request

    def _abort_later(self, inst: Instance, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort(inst, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, inst: Instance, request_id: str) -> None:
        try:
            resp = await inst.engine.Abort(pb.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S)
            logger.debug("aborted %s on %s (found=%s)", request_id, inst, resp.found)
        except grpc.aio.AioRpcError as e:
            logger.debug("abort of %s on %s failed: %s", request_id, inst, e.code().name)
        except grpc.aio.UsageError:  # the instance left the pool and its channel is closing
            logger.debug("abort of %s on %s skipped: channel closed", request_id, inst)

    async def lora_idle(self, name: str) -> None:
        """Returns once no request of this router runs with the adapter `name` (a request ends at
        its deadline at the latest)."""
        while self.lora_streams.get(name):
            await asyncio.sleep(0.05)

    async def drain(self) -> None:
        """Waits for the aborts still on their way."""
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)


def _serving(instances: list[Instance], lora: tuple | None) -> list[Instance]:
    """Those of `instances` that serve the LoRA adapter of `lora` (its prefix-cache key; None: the
    base model, which every instance serves); an instance not reported yet is taken to."""
    if lora is None:
        return instances
    return [i for i in instances if i.loras is None or lora[1] in i.loras]
