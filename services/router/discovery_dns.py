"""DNS discovery: the A/AAAA records of a headless Service (one per ready pod), resolved periodically."""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Awaitable, Callable

from services.router.discovery import Backoff, Discovery, OnChange, hostport

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (name, port) -> IP addresses; raises socket.gaierror
# The name exists nowhere or has no address: a headless Service with no ready pod. Any other
# failure (EAI_AGAIN: no answer from the DNS server) says nothing about the pods.
NO_ADDRESSES = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


async def resolve_host(name: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


def service_dns_name(service: str, namespace: str | None) -> str:
    """`<service>.<namespace>.svc` (the resolver's search path completes the cluster domain); a
    name with a dot is taken as it is; with no namespace known the bare name is left to the search
    path, which starts with the pod's own namespace."""
    if "." in service or not namespace:
        return service
    return f"{service}.{namespace}.svc"


class DnsDiscovery(Discovery):
    kind = "dns"

    def __init__(self, services: dict[str, tuple[str, str]], namespace: str | None, interval_s: float, *,
                 resolver: Resolver = resolve_host, backoff_s: tuple[float, float] = (0.5, 30.0)) -> None:
        super().__init__(services)
        self.names = {role: (service_dns_name(name, namespace), int(port))
                      for role, (name, port) in services.items()}
        self.interval_s = interval_s
        self._resolver = resolver
        self._backoff_s = backoff_s
        self._on_change: OnChange | None = None
        self._tasks: list[asyncio.Task] = []

    def describe(self, role: str) -> str:
        name, port = self.names[role]
        return f"DNS name {name} (port {port})"

    async def start(self, on_change: OnChange) -> None:
        self._on_change = on_change
        backoffs = {role: Backoff(*self._backoff_s) for role in self.names}
        for role in self.names:
            logger.info("dns discovery: %s instances from %s, every %.1fs", role, self.describe(role),
                        self.interval_s)
        # The first view before serving: a router that starts with no instance answers 503.
        delays = await asyncio.gather(*(self.refresh(role, backoffs[role]) for role in self.names))
        self._tasks = [asyncio.create_task(self._follow(role, backoffs[role], delay))
                       for role, delay in zip(self.names, delays)]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _follow(self, role: str, backoff: Backoff, delay: float) -> None:
        while True:
            await asyncio.sleep(delay)
            delay = await self.refresh(role, backoff)

    async def refresh(self, role: str, backoff: Backoff) -> float:
        """Resolves the role's name once and publishes a changed view; -> seconds to the next try."""
        name, port = self.names[role]
        try:
            addresses = await self._resolver(name, port)
        except Exception as e:  # a resolver failure must not end the loop
            if not (isinstance(e, socket.gaierror) and e.errno in NO_ADDRESSES):
                delay = backoff.next()
                self._unreachable(role, backoff, f"{type(e).__name__}: {e}", delay)
                return delay
            addresses = []
        self._reachable(role, backoff)
        if self._changed(role, [hostport(a, port) for a in addresses]):
            self._on_change(role, self.views[role])
        return self.interval_s
