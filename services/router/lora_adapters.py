"""LoRA adapters loaded and unloaded at run time, through the router (vLLM's /v1/load_lora_adapter
and /v1/unload_lora_adapter, on when --allow-runtime-lora-updating or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING is set).

A load goes to every healthy engine, prefill and decode alike (a request's adapter runs on both):
all of them load it (or had it from that path), or those that loaded it for this call unload it
again and the caller gets the first refusal. Once loaded it is a model name like --lora-modules'
(the served map is the ServedModel's and the dispatcher's, changed in place). An unload takes the
name off the router at once and off the engines once this router's requests on it have finished
(so none is refused halfway, between its prefill and its decode; one read before and dispatched
after is a 404). Each engine report goes to `sync`: an engine without one of these adapters (it
joined later, or restarted) gets it loaded, before it turns healthy; one that kept an adapter
unloaded while it was out of reach unloads it.

With --lora-resolver-dir DIR (vLLM's filesystem LoRA resolver, VLLM_LORA_RESOLVER_CACHE_DIR), a
request naming a model the router does not serve loads DIR/<name> that way first, once however
many requests ask at the same time; a name that did not load is not tried again for a minute. At
most --lora-resolver-max-loras adapters loaded so stay: one more unloads the one whose last request
began longest ago (once its running requests finish; a later request loads it again).

The state is this router's: with several router replicas, load through each (or list the adapter
in --lora-modules, which every engine and router reads at start).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import grpc

from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.router.errors import RouterError, bad_request
from services.router.instances import ROLES, Instance, InstancePool

logger = logging.getLogger(__name__)

# A name the resolver may look up: a folder's name, never a path (no "/", no "..").
RESOLVABLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
UNRESOLVED_TTL_S = 60.0  # a name that did not load is not tried again for this long
UNRESOLVED_MAX = 4096  # names remembered as not loading, at most (the oldest go first)
CALL_TIMEOUT_S = 120.0  # one engine's load: reading a checkpoint from a network volume can take a while
BUSY_WAIT_S = 10.0  # an engine still finishing the name's previous adapter is asked again this long
SYNC_RETRY_S = 30.0  # an engine that refused a runtime adapter is asked again after this long
GONE_MAX = 1024  # unloads remembered for the engines they did not reach, at most
# An engine's answers that say nothing of what it did: a rollback unloads there too.
_UNANSWERED = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE,
               grpc.StatusCode.UNKNOWN)
_HTTP = {grpc.StatusCode.ALREADY_EXISTS: 400, grpc.StatusCode.INVALID_ARGUMENT: 400,
         grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.ABORTED: 409,
         grpc.StatusCode.RESOURCE_EXHAUSTED: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504}


class RuntimeLoRA:
    def __init__(self, served: dict[str, str], pool: InstancePool, reserved_names: tuple[str, ...],
                 idle: Callable[[str], Awaitable[None]], resolver_dir: str | None = None,
                 resolver_max: int = 32, last_used: dict[str, float] | None = None) -> None:
        self.served = served  # every adapter clients may name -> its path (--lora-modules' too)
        self.loaded: dict[str, str] = {}  # those loaded through this router: kept on every engine
        self.pool = pool
        self.reserved = frozenset(reserved_names)  # the base model's served names
        self.idle = idle  # idle(name): returns once no request of this router runs with the adapter
        self._lock = asyncio.Lock()  # one load / unload at a time, and never beside a sync
        self._unloading: dict[str, asyncio.Task] = {}  # name -> its unload on the engines, under way
        # Unloaded through this router (and not loaded since) -> (its path, the engines it did not reach)
        self._missed: dict[str, tuple[str, set[str]]] = {}
        self._syncing: dict[str, asyncio.Task] = {}  # an engine's address -> its sync under way
        self._sync_failed: dict[tuple[str, str], float] = {}  # (address, adapter) -> when it refused
        self.resolver_dir = resolver_dir  # --lora-resolver-dir, as the engines see it
        self.resolver_max = resolver_max  # adapters the resolver keeps loaded at most
        self.resolved: list[str] = []  # those it loaded, still loaded
        self.last_used = last_used if last_used is not None else {}  # adapter -> when its last request began
        self._resolving: dict[str, asyncio.Task] = {}
        self._unresolved: collections.OrderedDict[str, float] = collections.OrderedDict()  # name -> when it failed

    async def resolve(self, name: str) -> bool:
        """--lora-resolver-dir: makes `name` a served adapter by loading DIR/name on every engine;
        False when it is not one (no resolver, not a folder's name, or it did not load)."""
        if self.resolver_dir is None or not RESOLVABLE_NAME.fullmatch(name) or name in self.reserved:
            return False
        if name in self.served:
            return True
        failed = self._unresolved.get(name)
        if failed is not None and time.monotonic() - failed < UNRESOLVED_TTL_S:
            return False
        task = self._resolving.get(name)
        if task is None:  # the first request for it loads it; the others wait for that
            task = self._resolving[name] = asyncio.create_task(self._resolve(name))
            task.add_done_callback(lambda _: self._resolving.pop(name, None))
        return await asyncio.shield(task)

    async def _resolve(self, name: str) -> bool:
        path = os.path.join(self.resolver_dir, name)
        # Those unloaded by hand meanwhile are gone; those still loading (this one too) keep their place.
        self.resolved = [n for n in self.resolved if n in self.served or n in self._resolving]
        while len(self.resolved) >= self.resolver_max:  # room first: the least recently used goes
            loaded = [n for n in self.resolved if n not in self._resolving]
            if not loaded:
                break  # all of them loading at once: a moment over the cap
            victim = min(loaded, key=lambda n: self.last_used.get(n, 0.0))
            self.resolved.remove(victim)
            with contextlib.suppress(RouterError):  # unloaded by hand meanwhile
                await self.unload(victim)
            logger.info("LoRA resolver: %s unloaded to make room for %s (--lora-resolver-max-loras %d)",
                        victim, name, self.resolver_max)
        self.resolved.append(name)
        try:
            await self.load(name, path)
        except RouterError as e:
            self.resolved.remove(name)
            if name in self.served:
                return True  # loaded meanwhile by a call of its own
            if e.status in (400, 404):  # the engines had no such adapter there: remembered a while
                self._unresolved[name] = time.monotonic()
                self._unresolved.move_to_end(name)
                while len(self._unresolved) > UNRESOLVED_MAX:
                    self._unresolved.popitem(last=False)
            logger.info("LoRA resolver: no adapter %s loaded from %s: %s", name, path, e.message)
            return False
        self._unresolved.pop(name, None)
        self.last_used[name] = time.monotonic()  # new: not the first to go
        return True

    async def load(self, name, path) -> None:
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided as non-empty strings.",
                              "lora_name" if not isinstance(name, str) or not name else "lora_path")
        if name in self.reserved:
            raise bad_request(f"'{name}' is a name of the base model; an adapter needs a name of its own",
                              "lora_name")
        # The engines' part goes on if the caller leaves (a client gone): no engine is left half-way.
        await asyncio.shield(_detached(self._load(name, path)))

    async def _load(self, name: str, path: str) -> None:
        pending = self._unloading.get(name)
        if pending is not None:  # unloaded a moment ago (a new version, say): the old one goes first
            await asyncio.shield(pending)
        async with self._lock:
            if name in self.served or name in self._unloading:
                raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name",
                                  code="lora_adapter_exists")
            targets = self._targets()
            results = await asyncio.gather(*(self._call(i, "load", name, path) for i in targets))
            failed = [(inst, r) for inst, r in zip(targets, results) if isinstance(r, Failed)]
            if failed:  # those that loaded it now unload it again (not those that had it before), and
                # those whose answer did not come (the load may have gone on there)
                undo = [inst for inst, r in zip(targets, results)
                        if (r.code in _UNANSWERED if isinstance(r, Failed) else r.loaded)]
                await asyncio.gather(*(self._call(i, "unload", name) for i in undo))
                said = [(inst, r) for inst, r in failed if r.code not in _UNANSWERED]  # a reason first
                raise _refusal(*(said or failed)[0], name)
            self.served[name] = self.loaded[name] = path
            self._missed.pop(name, None)
            for inst in targets:
                _note(inst, name, True)
        logger.info("LoRA adapter %s loaded from %s on %d engines", name, path, len(targets))

    async def unload(self, name) -> None:
        """Takes the name off the router now (its new requests are a 404); the engines unload it
        once this router's requests running on it have finished (on it), in the background."""
        if not isinstance(name, str) or not name:
            raise bad_request("'lora_name' must be provided as a non-empty string.", "lora_name")
        async with self._lock:
            if name not in self.served:
                raise RouterError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                                  code="lora_adapter_not_found")
            path = self.served.pop(name)
            self.loaded.pop(name, None)
            task = asyncio.create_task(self._unload_engines(name, path))
            self._unloading[name] = task
            task.add_done_callback(lambda _: self._unloading.pop(name, None))

    async def _unload_engines(self, name: str, path: str) -> None:
        await self.idle(name)
        async with self._lock:
            targets = [i for role in ROLES for i in self.pool.healthy(role)]
            results = await asyncio.gather(*(self._call(i, "unload", name) for i in targets))
            # The engines it did not reach unload it when they next report it (if it is not loaded again).
            done = {i.address for i, r in zip(targets, results)
                    if not isinstance(r, Failed) or r.code == grpc.StatusCode.NOT_FOUND}
            missed = {i.address for role in ROLES for i in self.pool.instances(role)} - done
            if missed and name not in self.served:
                self._missed[name] = (path, missed)
                while len(self._missed) > GONE_MAX:
                    del self._missed[next(iter(self._missed))]
        for inst, r in zip(targets, results):  # NOT_FOUND: that engine never had it (a --lora-modules gap)
            if inst.address in done:
                _note(inst, name, False)
            else:
                logger.warning("LoRA adapter %s (%s): unload on %s failed (%s: %s); it goes when that engine "
                               "next reports it", name, path, inst, r.code.name, r.details)
        logger.info("LoRA adapter %s unloaded from %d engines", name, len(targets))

    async def close(self) -> None:
        """At the router's stop, its requests drained: the unloads under way finish."""
        for task in self._syncing.values():
            task.cancel()
        await asyncio.gather(*list(self._unloading.values()), *self._syncing.values(), return_exceptions=True)

    async def sync(self, inst: Instance, report: pb.LoadReport) -> None:
        """An engine's report: loads onto it the adapters loaded through this router that it lacks
        (it joined, or restarted), and unloads those unloaded through this router that it still has
        (it was out of reach then). Awaited before an instance turns healthy; for one already
        serving it runs beside the health checks. An engine that refused one is asked again after
        SYNC_RETRY_S."""
        if not report.lora_enabled:
            return
        has = {a.name: a.path for a in report.lora_adapters}
        now = time.monotonic()
        missing = [(n, p) for n, p in self.loaded.items()
                   if has.get(n) != p and now - self._sync_failed.get((inst.address, n), -SYNC_RETRY_S) >= SYNC_RETRY_S]
        strays = [(n, p) for n, p in has.items() if self._stray(inst, n, p)]
        if not missing and not strays:
            return
        if not inst.healthy:
            await self._sync(inst, missing, strays)
        elif inst.address not in self._syncing:
            task = self._syncing[inst.address] = asyncio.create_task(self._sync(inst, missing, strays))
            task.add_done_callback(lambda _: self._syncing.pop(inst.address, None))

    async def _sync(self, inst: Instance, missing: list[tuple[str, str]], strays: list[tuple[str, str]]) -> None:
        async with self._lock:
            for name, path in missing:
                if self.loaded.get(name) != path:
                    continue  # unloaded (or replaced) while this waited
                r = await self._call(inst, "load", name, path)
                if not isinstance(r, Failed):
                    _note(inst, name, True)
                    self._sync_failed.pop((inst.address, name), None)
                    logger.info("LoRA adapter %s loaded onto %s, which lacked it", name, inst)
                    continue
                self._sync_failed[(inst.address, name)] = time.monotonic()
                logger.error("LoRA adapter %s could not be loaded onto %s, which lacks it (%s: %s); its requests "
                             "there will be refused; asked again in %.0fs", name, inst, r.code.name, r.details,
                             SYNC_RETRY_S)
            for name, path in strays:
                if not self._stray(inst, name, path):
                    continue  # loaded again meanwhile
                r = await self._call(inst, "unload", name)
                if not isinstance(r, Failed) or r.code == grpc.StatusCode.NOT_FOUND:
                    _note(inst, name, False)
                    missed = self._missed.get(name)
                    if missed is not None:
                        missed[1].discard(inst.address)
                        if not missed[1]:
                            del self._missed[name]
                    logger.info("LoRA adapter %s, unloaded while %s was out of reach, unloaded there", name, inst)

    def _stray(self, inst: Instance, name: str, path: str) -> bool:
        """`inst` still has an adapter this router unloaded while it was out of reach."""
        missed = self._missed.get(name)
        return name not in self.served and missed is not None and missed[0] == path and inst.address in missed[1]

    def _targets(self) -> list[Instance]:
        decode = self.pool.healthy("decode")
        if not decode:
            raise RouterError(503, self.pool.unavailable_reason("decode"), code="no_healthy_instance")
        return self.pool.healthy("prefill") + decode

    @staticmethod
    async def _call(inst: Instance, what: str, name: str, path: str = "") -> pb.LoRAAdapterResponse | Failed:
        """One engine's load or unload; ABORTED (the name's previous adapter still finishing its
        requests there) is tried again for up to BUSY_WAIT_S."""
        deadline = time.monotonic() + BUSY_WAIT_S
        while True:
            try:
                if what == "load":
                    return await inst.engine.LoadLoRAAdapter(
                        pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path), timeout=CALL_TIMEOUT_S)
                return await inst.engine.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name=name),
                                                           timeout=CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.ABORTED and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    continue
                return Failed(e.code(), e.details() or "")
            except grpc.aio.UsageError as e:  # its channel closed: discovery removed it meanwhile
                return Failed(grpc.StatusCode.UNAVAILABLE, str(e))


@dataclass(frozen=True)
class Failed:
    """An engine's refusal of a load or unload."""
    code: grpc.StatusCode
    details: str


def _note(inst: Instance, name: str, serves: bool) -> None:
    """What routing knows of an instance's adapters, after a load or unload there."""
    if inst.loras is not None:
        (inst.loras.add if serves else inst.loras.discard)(name)


def _detached(coro) -> asyncio.Task:
    task = asyncio.get_running_loop().create_task(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: a caller gone is no error
    return task


def _refusal(inst: Instance, failed: Failed, name: str) -> RouterError:
    status = _HTTP.get(failed.code, 502)
    code = {400: "lora_adapter_refused", 404: "lora_adapter_not_found", 409: "lora_adapter_busy",
            503: "lora_adapter_no_memory"}.get(status, "upstream_error")
    return RouterError(status, f"LoRA adapter '{name}' was not loaded: {inst.role} instance {inst.address} "
                       f"refused it ({failed.code.name}: {failed.details}); no engine kept it",
                       param="lora_path" if failed.code == grpc.StatusCode.INVALID_ARGUMENT else None, code=code)
