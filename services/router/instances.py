"""Prefill and decode instances: persistent channels, health checks and load reports."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc
from services.common.auth import ChannelAuth
from services.router.pairing import PairTable

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 256 << 20),
                   ("grpc.max_send_message_length", 256 << 20)]
ROLES = ("prefill", "decode")
CHECK_TIMEOUT_S = 2.0  # one health check or GetLoad: generous, a busy instance is not a dead one


class Instance:
    """One engine instance as the router sees it: stubs over one channel, health, last load."""

    def __init__(self, address: str, role: str, auth: ChannelAuth = ChannelAuth()) -> None:
        assert role in ROLES, role
        self.address = address
        self.role = role
        self.channel = auth.aio_channel(address, CHANNEL_OPTIONS)  # plaintext unless a token or TLS is set
        self.prefill = pb_grpc.PrefillStub(self.channel) if role == "prefill" else None
        self.decode = pb_grpc.DecodeStub(self.channel) if role == "decode" else None
        self.engine = pb_grpc.EngineStub(self.channel)  # Abort, GetLoad: served whatever the role
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.healthy = False
        self.checked = False
        self.draining = False  # discovery removed it: no new requests, in-flight ones finish
        self.reason = "not checked yet"  # why it is unhealthy
        self.load: pb.LoadReport | None = None
        # The LoRA adapters it serves, by its last report and the loads and unloads since (None:
        # not reported yet): a request for an adapter goes to those that have it.
        self.loras: set[str] | None = None
        # Its pairing descriptor (in `load`) is this life's: false from each start until a report
        # comes, for a pod restarted behind the same address may be another version.
        self.described = False
        # Tokens routed here that the last load report cannot show (routed after it was asked
        # for): keeps least-load honest between polls.
        self.routed_tokens = 0
        # Decode streams this router has open here (admitted, pulling KV or generating): fresh
        # where the load report's num_running is up to a poll old, but this router's alone.
        self.streams = 0
        # Prompts this router has computing here (a prefill instance), request id -> the tokens
        # routing added (`RoutingPolicy.added_load`), in the order they were sent.
        self.prefilling: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"{self.role}@{self.address}"

    @property
    def load_score(self) -> int:
        reported = self.load.outstanding_tokens if self.load is not None else 0
        return reported + self.routed_tokens

    @property
    def queued_tokens(self) -> int:
        """Tokens surely waiting behind the step the instance may be running: its load beyond one
        step's budget. A report is made between steps, so its outstanding tokens include the step
        that starts next, which runs while the router reads the report; counting that step as a
        queue made one long prompt in flight look like a queue of its own length. Without the
        budget (an older engine), the whole load."""
        step = self.load.max_num_batched_tokens if self.load is not None else 0
        return max(0, self.load_score - step)

    async def check_health(self, timeout: float) -> tuple[bool, str]:
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return False, f"{e.code().name}: {e.details()}"
        except grpc.aio.UsageError as e:  # the channel closed under the check: it is draining
            return False, str(e)
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            return False, health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        return True, ""

    async def get_load(self, timeout: float) -> pb.LoadReport:
        return await self.engine.GetLoad(pb.LoadRequest(), timeout=timeout)


class InstancePool:
    """The instances (static from flags, or kept current by discovery through `update`) plus
    active health checks and, when asked, load polling.

    A request that finds an instance unreachable marks it unhealthy at once (passive check);
    the next active check brings it back.
    """

    def __init__(self, prefill: tuple[str, ...], decode: tuple[str, ...], metrics, *,
                 health_interval_s: float, load_interval_s: float | None,
                 on_load: Callable[[pb.LoadReport], None] | None = None,
                 drain_grace_s: float = 600.0, sources: dict[str, str] | None = None,
                 auth: ChannelAuth = ChannelAuth()) -> None:
        self._addresses = {"prefill": prefill, "decode": decode}
        self._instances: dict[str, list[Instance]] = {"prefill": [], "decode": []}
        self._metrics = metrics
        self._health_interval_s = health_interval_s
        self._load_interval_s = load_interval_s  # None: one report per instance when it turns healthy
        self._on_load = on_load
        self._tasks: list[asyncio.Task] = []
        # Instances discovery removed: their channels close once in-flight calls end (or the grace).
        self._drain_grace_s = drain_grace_s
        self._draining: dict[Instance, asyncio.Task] = {}
        self._checks: set[asyncio.Task] = set()
        self._sources = sources or {}  # role -> where its instances come from, for messages
        self._auth = auth  # the credentials every channel to an engine carries
        self.pairs = PairTable(metrics)  # which prefill x decode pairs can move KV
        # Awaited with each report fetched (inst, report), before a new instance turns healthy:
        # what must be set up on an engine before requests reach it (the runtime LoRA adapters).
        self.report_listeners: list[Callable[[Instance, pb.LoadReport], Awaitable[None]]] = []

    def instances(self, role: str) -> list[Instance]:
        return self._instances[role]

    def healthy(self, role: str) -> list[Instance]:
        return [i for i in self._instances[role] if i.healthy]

    def unavailable_reason(self, role: str) -> str:
        states = "; ".join(f"{i.address}: {i.reason}" for i in self._instances[role])
        none = f"none found in {self._sources[role]}" if role in self._sources else "none configured"
        return f"no healthy {role} instance ({states or none})"

    async def start(self) -> None:
        for role, addresses in self._addresses.items():
            self._instances[role] = [Instance(a, role, self._auth) for a in addresses]
        await self.check_all()
        self._tasks.append(asyncio.create_task(self._poll(self.check_all, self._health_interval_s)))
        if self._load_interval_s is not None:
            self._tasks.append(asyncio.create_task(self._poll(self.poll_loads, self._load_interval_s)))

    def update(self, role: str, addresses: tuple[str, ...]) -> None:
        """Discovery's new view of a role: new addresses join (checked at once), instances that are
        gone stop receiving requests and drain: their in-flight calls finish, then the channel closes."""
        current = {i.address: i for i in self._instances[role]}
        added = [Instance(a, role, self._auth) for a in addresses if a not in current]
        for inst in (i for a, i in current.items() if a not in addresses):
            inst.draining = True
            with contextlib.suppress(KeyError):  # no series if it was never checked
                self._metrics.instance_healthy.remove(role, inst.address)
            logger.info("%s instance %s removed by discovery; draining its in-flight requests", role, inst.address)
            self._draining[inst] = task = asyncio.create_task(inst.channel.close(self._drain_grace_s))
            task.add_done_callback(lambda _, inst=inst: self._draining.pop(inst, None))
        self._instances[role] = [i for i in self._instances[role] if not i.draining] + added
        for inst in added:
            logger.info("%s instance %s added by discovery", role, inst.address)
        self._refresh_pairs()  # the removed ones' pairs go
        if added:  # checked now, not at the next interval: a new pod serves as soon as it can
            task = asyncio.create_task(self._check(added))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)

    async def close(self) -> None:
        # The router has drained its requests by now: what still drains has nothing left to wait for.
        background = self._tasks + list(self._checks) + list(self._draining.values())
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        self._tasks.clear()
        for role in ROLES:
            await asyncio.gather(*(i.channel.close() for i in self._instances[role]))

    async def _poll(self, fn, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()
            except Exception:  # a poll must never die; log and go on
                logger.exception("instance poll failed")

    async def check_all(self) -> None:
        await self._check(self._instances["prefill"] + self._instances["decode"])

    async def _check(self, instances: list[Instance]) -> None:
        results = await asyncio.gather(*(i.check_health(CHECK_TIMEOUT_S) for i in instances))
        # A first report before an instance takes requests: its limits, its KV events endpoint and
        # the descriptor it is paired by (asked again at each check until one arrives).
        reporting = [i for i, (ok, _) in zip(instances, results)
                     if ok and not i.draining and (not i.healthy or not i.described)]
        if any(i.described for i in reporting):  # back from down: maybe another version now
            for inst in reporting:
                inst.described = False
            self._refresh_pairs()
        await asyncio.gather(*(self._fetch_load(i) for i in reporting))
        for inst, (ok, reason) in zip(instances, results):
            if not inst.draining:  # else removed while it was being checked
                self._set_health(inst, ok, reason)

    def mark_unhealthy(self, inst: Instance, reason: str) -> None:
        self._set_health(inst, False, reason)

    def _set_health(self, inst: Instance, ok: bool, reason: str) -> None:
        if inst.draining:
            return  # gone from the pool (a late passive check): no log line, no metric
        if ok != inst.healthy or not inst.checked:
            if ok:
                logger.info("%s instance %s is healthy", inst.role, inst.address)
            else:
                logger.warning("%s instance %s is unhealthy: %s", inst.role, inst.address, reason)
        inst.healthy, inst.reason, inst.checked = ok, reason, True
        self._metrics.instance_healthy.labels(inst.role, inst.address).set(1 if ok else 0)

    def _refresh_pairs(self) -> None:
        self.pairs.refresh(self._instances["prefill"], self._instances["decode"])

    async def poll_loads(self) -> None:
        await asyncio.gather(*(self._fetch_load(i) for role in ROLES for i in self.healthy(role)))

    async def _fetch_load(self, inst: Instance) -> None:
        # What was routed before the ask went out reached the engine first (the same channel) and
        # is in the report; what was routed while the report was on its way is not: it stays.
        routed_before = inst.routed_tokens
        try:
            report = await inst.get_load(timeout=CHECK_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            logger.debug("GetLoad from %s failed: %s", inst, e.code().name)
            return
        previous, inst.load = inst.load, report
        inst.loras = {a.name for a in report.lora_adapters} if report.lora_enabled else set()
        inst.routed_tokens = max(0, inst.routed_tokens - routed_before)
        if not inst.described or previous.HasField("pairing") != report.HasField("pairing") or (
                previous.pairing != report.pairing):  # a first descriptor, or a pod of another version
            inst.described = True
            self._refresh_pairs()
        if self._on_load is not None:
            self._on_load(report)
        for listener in self.report_listeners:
            try:
                await listener(inst, report)
            except Exception:  # a listener's failure must not stop the health checks
                logger.exception("acting on %s's load report failed", inst)
