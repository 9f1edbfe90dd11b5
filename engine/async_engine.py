"""asyncio front end of an engine: add_request -> async stream of outputs; abort."""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import AsyncIterator, Awaitable, Callable

from engine import lora_errors
from engine.config import EngineConfig
from engine.core_client import Abort, AddRequest, CallResult, InprocClient, LoadLoRA, MPClient, UnloadLoRA
from engine.outputs import OutputKind, OutputProcessor, RequestOutput, merge_delta
from engine.processor import InputProcessor, load_tokenizer
from engine.request import (DuplicateRequestError, EngineDeadError, EngineOverloadedError, InvalidRequestError,
                            SamplingParams, check_priority)
from engine.scheduler import EngineCoreOutput

logger = logging.getLogger(__name__)


class InflightPrompts:
    """Prompt tokens in flight as KV they will hold: a full block that several prompts share (a
    tenant's system prompt, the same cache_salt) counts once, as the prefix cache stores it once.
    Counting every prompt whole refused a burst of one long prefix at a fraction of the cache.

    Blocks are keyed by a chained hash of their tokens (the process's own: an undercount on a
    collision, never an error); without prefix caching nothing is shared and prompts count whole."""

    def __init__(self, block_size: int, shared: bool) -> None:
        self.block_size, self.shared = block_size, shared
        self.total = 0
        self._refs: dict[int, int] = {}  # block key -> prompts in flight holding it
        self._held: dict[str, tuple[list[int], int]] = {}  # request -> its block keys, its other tokens

    def _keys(self, token_ids, cache_salt: str | None) -> list[int]:
        if not self.shared:
            return []
        keys, key, bs = [], hash(("salt", cache_salt)), self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            key = hash((key, tuple(token_ids[start:start + bs])))
            keys.append(key)
        return keys

    def cost(self, token_ids, cache_salt: str | None = None) -> tuple[int, list[int]]:
        """Tokens the prompt would add, and its block keys (for add)."""
        keys = self._keys(token_ids, cache_salt)
        new_blocks = sum(1 for k in keys if k not in self._refs)
        return new_blocks * self.block_size + len(token_ids) - len(keys) * self.block_size, keys

    def add(self, request_id: str, token_ids, keys: list[int]) -> None:
        rest = len(token_ids) - len(keys) * self.block_size
        for k in keys:
            n = self._refs.get(k, 0)
            if n == 0:
                self.total += self.block_size
            self._refs[k] = n + 1
        self.total += rest
        self._held[request_id] = (keys, rest)

    def remove(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is None:
            return
        keys, rest = held
        self.total -= rest
        for k in keys:
            n = self._refs[k] - 1
            if n == 0:
                del self._refs[k]
                self.total -= self.block_size
            else:
                self._refs[k] = n

    def clear(self) -> None:
        self._refs.clear()
        self._held.clear()
        self.total = 0


class AsyncEngine:
    """Create with `await AsyncEngine.create(model, ...)`. `multiprocess=True` runs the engine
    core in its own process (the services' mode); False runs it in a thread (tests, tools)."""

    def __init__(self, config: EngineConfig, multiprocess: bool, detokenize: bool = True) -> None:
        self.config = config
        self.multiprocess = multiprocess
        self.tokenizer = load_tokenizer(config.model.path)
        # Services stream token ids and leave text to the router: no detokenizing there, but for
        # the requests with text stop strings, which stop where one matches (as in vLLM's front
        # end): not generating on past it until the router, a stream interval later, aborts them.
        self.output_processor = OutputProcessor(self.tokenizer if detokenize else None, OutputKind.DELTA,
                                                config.stream_interval, stop_tokenizer=self.tokenizer)
        self.streams: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client = None
        self.processor: InputProcessor | None = None
        self.dead: EngineDeadError | None = None
        self._death_callbacks: list[Callable[[EngineDeadError], None]] = []
        # Admission control: requests and prompt tokens in flight (set once the core reports
        # its KV cache size); beyond them a request is shed with EngineOverloadedError.
        self.max_inflight_requests = self.max_inflight_tokens = 0
        self._inflight = InflightPrompts(config.cache.block_size, config.cache.enable_prefix_caching)
        self.num_requests_shed = 0
        # The LoRA adapters served now, name -> path: --lora-modules' and those loaded since.
        self.lora_adapters: dict[str, str] = config.lora.paths if config.lora is not None else {}
        self._lora_lock = asyncio.Lock()  # one load / unload at a time: the checks stay true
        # LoadLoRA / UnloadLoRA sent, by call id: (the answer's future, what to do when it succeeds)
        self._calls: dict[int, tuple[asyncio.Future, Callable[[], None]]] = {}
        self._call_ids = itertools.count()

    @classmethod
    async def create(cls, model: str, multiprocess: bool = False, detokenize: bool = True,
                     kv_connector_factory=None, **engine_kwargs) -> "AsyncEngine":
        """kv_connector_factory: builds the KV connector's two sides inside the engine-core
        process (see engine.kv_connector); it must be picklable when multiprocess=True."""
        if model == "tiny":
            from engine.tiny import default_tiny_model
            model = default_tiny_model()
        self = cls(EngineConfig.create(model=model, **engine_kwargs), multiprocess, detokenize)
        self.loop = asyncio.get_running_loop()
        if multiprocess:
            self.client = MPClient(self.config, self._on_core_outputs, kv_connector_factory,
                                   on_death=self._on_core_death, on_result=self._on_call_result)
            await self.client.start()
        else:
            self.client = await asyncio.to_thread(
                InprocClient, self.config, self._threadsafe_on_core_outputs, kv_connector_factory,
                lambda code: self.loop.call_soon_threadsafe(self._on_core_death, code),
                lambda result: self.loop.call_soon_threadsafe(self._on_call_result, result))
        info = self.client.info
        self.processor = InputProcessor(self.tokenizer, info.max_model_len, info.vocab_size,
                                        self.lora_adapters if self.config.lora is not None else None)
        sc = self.config.scheduler
        kv_tokens = info.num_blocks * self.config.cache.block_size
        self.max_inflight_requests = sc.max_num_seqs + (
            2 * sc.max_num_seqs if sc.max_waiting_requests is None else sc.max_waiting_requests)
        self.max_inflight_tokens = kv_tokens + (kv_tokens if sc.max_waiting_tokens is None else sc.max_waiting_tokens)
        logger.info("engine ready (%s core): max_model_len=%d, %d KV blocks",
                    "process" if multiprocess else "thread", info.max_model_len, info.num_blocks)
        return self

    @property
    def max_model_len(self) -> int:
        return self.processor.max_model_len

    def on_death(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call `callback` (on the event loop) if the engine core dies."""
        self._death_callbacks.append(callback)

    def _on_core_death(self, exitcode: int | None) -> None:
        self.dead = EngineDeadError(f"the engine core process died (exit code {exitcode})")
        streams, self.streams = self.streams, {}
        self._inflight.clear()
        for q in streams.values():
            q.put_nowait(self.dead)
        calls, self._calls = self._calls, {}
        for future, _ in calls.values():
            if not future.done():
                future.set_exception(self.dead)
        for callback in self._death_callbacks:
            callback(self.dead)

    def _on_call_result(self, result: CallResult) -> None:
        pending = self._calls.pop(result.call_id, None)
        if pending is None:
            return
        future, on_success = pending
        if not result.error_type:  # the front end's view changes with the core's, whoever still waits
            on_success()
        if not future.done():
            future.set_result(result)

    async def _call(self, message, on_success: Callable[[], None]) -> None:
        """Sends a LoadLoRA / UnloadLoRA and waits for the core's answer (it comes between steps);
        `on_success` runs when the core has done it, even if the waiter is gone by then. The core's
        refusal is raised as its LoRAAdapterError subclass."""
        if self.dead is not None:
            raise self.dead
        future = self.loop.create_future()
        self._calls[message.call_id] = (future, on_success)
        self.client.send(message)
        result = await future
        if result.error_type:
            error = getattr(lora_errors, result.error_type, None)
            if not (isinstance(error, type) and issubclass(error, lora_errors.LoRAAdapterError)):
                error = lora_errors.LoRAAdapterError
            raise error(result.error)

    def _check_lora_enabled(self, name: str) -> None:
        if self.config.lora is None:
            raise lora_errors.LoRANotEnabledError("LoRA is not enabled on this engine: start it with --enable-lora")
        if not name:
            raise lora_errors.LoRAAdapterError("lora_name must be a non-empty string")

    async def load_lora_adapter(self, name: str, path: str) -> bool:
        """Loads a LoRA adapter at run time (vLLM's /v1/load_lora_adapter): requests may name it
        once this returns. False when it was loaded from that path already (nothing to do). Raises
        a LoRAAdapterError subclass: not enabled, the name taken by another path, the checkpoint
        unreadable or not one this serves (then nothing changed). A caller that stops waiting
        does not stop the load: the lock is held until the core has answered."""
        return await asyncio.shield(_detached(self._load_lora(name, path)))

    async def _load_lora(self, name: str, path: str) -> bool:
        async with self._lora_lock:
            self._check_lora_enabled(name)
            if not path:
                raise lora_errors.LoRAAdapterError("lora_path must be a non-empty string")
            loaded = self.lora_adapters.get(name)
            if loaded == path:
                return False
            if loaded is not None:
                raise lora_errors.LoRAAdapterExistsError(f"LoRA adapter {name!r} is already loaded (from {loaded})")
            await self._call(LoadLoRA(next(self._call_ids), name, path),
                             lambda: self.lora_adapters.__setitem__(name, path))
            return True

    async def unload_lora_adapter(self, name: str) -> None:
        """Unloads an adapter (vLLM's /v1/unload_lora_adapter): requests naming it are refused from
        now on; those running finish on it, and its memory is freed once they have."""
        await asyncio.shield(_detached(self._unload_lora(name)))

    async def _unload_lora(self, name: str) -> None:
        async with self._lora_lock:
            self._check_lora_enabled(name)
            if name not in self.lora_adapters:
                raise lora_errors.LoRAAdapterNotFoundError(f"LoRA adapter {name!r} is not loaded")
            del self.lora_adapters[name]  # before the core hears: no later request is sent with it
            await self._call(UnloadLoRA(next(self._call_ids), name), lambda: None)

    def _threadsafe_on_core_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        self.loop.call_soon_threadsafe(self._on_core_outputs, outputs)

    def _on_core_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        request_outputs, stopped = self.output_processor.process(outputs)
        if stopped:  # a stop string matched in the front end: the core stops generating
            self.client.send(Abort(stopped))
        for out in request_outputs:
            q = self.streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
                if out.finished:
                    del self.streams[out.request_id]
                    self._inflight.remove(out.request_id)

    def stats(self) -> dict:
        """The engine core's latest counters (running/waiting, KV usage, pinned blocks, ...) and
        the front end's own (requests shed by admission control)."""
        stats = dict(self.client.stats()) if self.client is not None else {}
        stats["num_requests_shed"] = self.num_requests_shed
        return stats

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, prefill_only: bool = False, publish_kv: bool = False,
                    remote_kv: bytes | None = None,
                    first_token_id: int | None = None) -> tuple[str, asyncio.Queue]:
        """Validate and queue; raises InvalidRequestError before anything is queued.

        Prefill role: prefill_only=True stops after the first token, with the request's real
        stop rules (the final output has a finish_reason only when that token ends it);
        publish_kv=True then keeps the prompt's blocks for a decode pull (the final output
        carries kv_handle). Decode role: remote_kv + first_token_id continue a request whose
        prompt was prefilled elsewhere."""
        if self.dead is not None:
            raise self.dead
        token_ids = self.processor.to_token_ids(prompt)
        self.processor.validate(token_ids, params)
        if first_token_id is not None and not 0 <= first_token_id < self.processor.vocab_size:
            raise InvalidRequestError(f"first token id {first_token_id} is outside the vocabulary")
        if params.n != 1:  # one request, one sample: n > 1 is fanned out by the router or LLM.generate
            raise InvalidRequestError(f"n must be 1 for a single engine request, got {params.n}")
        check_priority(priority, self.config.scheduler.policy)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.streams:
            raise DuplicateRequestError(f"request id {rid!r} is already in use by a request in flight")
        added, keys = self._inflight.cost(token_ids, params.cache_salt)
        if self.streams and (len(self.streams) >= self.max_inflight_requests
                             or self._inflight.total + added > self.max_inflight_tokens):
            self.num_requests_shed += 1
            raise EngineOverloadedError(
                f"the engine is at capacity ({len(self.streams)} requests, {self._inflight.total} prompt "
                f"tokens in flight, shared prefixes once; limits {self.max_inflight_requests} and "
                f"{self.max_inflight_tokens})")
        if publish_kv and not prefill_only:
            raise InvalidRequestError("publish_kv needs prefill_only")
        q: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = q
        self._inflight.add(rid, token_ids, keys)
        self.output_processor.add(rid, prompt if isinstance(prompt, str) else None, token_ids, params,
                                  find_stop=not prefill_only,
                                  output_prefix=(first_token_id,) if first_token_id is not None else ())
        self.client.send(AddRequest(rid, token_ids, params, self.processor.eos_token_id, priority,
                                    prefill_only, publish_kv, remote_kv, first_token_id))
        return rid, q

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None,
                       priority: int = 0, admitted: Callable[[], Awaitable[None]] | None = None,
                       **disagg) -> AsyncIterator[RequestOutput]:
        """Stream deltas (the tokens and text each step added); leaving the loop early (or
        cancellation) aborts the request. `disagg`: prefill_only / publish_kv / remote_kv /
        first_token_id, as add_request takes them. `admitted` is awaited once the engine has
        taken the request (past admission control), before its first output."""
        rid, q = self.add_request(prompt, params, request_id, priority, **disagg)
        finished = False
        held = None  # an engine death found while merging: raised after what came before it
        try:
            if admitted is not None:
                await admitted()
            while not finished:
                if held is not None:
                    out, held = held, None
                else:
                    out = await q.get()
                if isinstance(out, EngineDeadError):
                    finished = True  # nothing left to abort
                    raise out
                # Behind the engine (a slow client, a busy event loop): the queued deltas go
                # out as one, so a backlog costs one message, not one per step.
                while not out.finished and not q.empty():
                    later = q.get_nowait()
                    if isinstance(later, EngineDeadError):
                        held = later
                        break
                    out = merge_delta(out, later)
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; for a finished prefill, free its pinned KV now. A
        `generate()` still waiting on the request ends with a final, aborted output."""
        q = self.streams.pop(request_id, None)
        if q is not None:
            self._inflight.remove(request_id)
            final = self.output_processor.abort(request_id)
            if final is not None:
                q.put_nowait(final)
        if self.client is not None:
            self.client.send(Abort([request_id]))

    async def shutdown(self) -> None:
        if self.client is not None:
            if isinstance(self.client, MPClient):
                self.client.stop_watching()
            await asyncio.to_thread(self.client.shutdown)
            self.client = None


def _detached(coro) -> asyncio.Task:
    """A task that finishes whether or not its caller still waits (its error then only logged)."""
    task = asyncio.get_running_loop().create_task(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                           or logger.info("LoRA call finished with nobody waiting: %s", t.exception()))
    return task
