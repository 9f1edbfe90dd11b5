"""Instance discovery: keeps the pool's prefill and decode instances in step with a Service's pods.

Static discovery is the flags themselves (the pool is built from them). The sources here find the
instances of the prefill and decode headless Services: `dns` (their A/AAAA records, resolved
periodically) or `kubernetes` (a watch on their EndpointSlices). Each source calls
`on_change(role, addresses)` on the event loop with the role's full current view; the pool adds
what is new and drains what is gone. A source that cannot reach DNS or the API server keeps its
last view (a lost control plane must not empty a working fleet), logs it once, and retries with
backoff.
"""
from __future__ import annotations

import abc
import logging
from typing import Callable

from services.router.config import RouterConfig

logger = logging.getLogger(__name__)

OnChange = Callable[[str, tuple[str, ...]], None]  # (role, every address of that role now)
POD_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def pod_namespace(path: str = POD_NAMESPACE_FILE) -> str | None:
    """The namespace of the pod this runs in (its service account says), None outside a pod."""
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def hostport(address: str, port: int | str) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


class Backoff:
    """Delays between retries: doubling from `initial_s` up to `max_s`; reset after a success."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self.initial_s, self.max_s = initial_s, max_s
        self._next_s = initial_s
        self.failures = 0

    def next(self) -> float:
        delay, self._next_s = self._next_s, min(self._next_s * 2, self.max_s)
        self.failures += 1
        return delay

    def reset(self) -> None:
        self._next_s, self.failures = self.initial_s, 0


class Discovery(abc.ABC):
    """Finds the instances of each role in `services` (role -> (Service name, port))."""

    kind: str = ""

    def __init__(self, services: dict[str, tuple[str, str]]) -> None:
        self.services = dict(services)
        self.views: dict[str, tuple[str, ...]] = {}  # role -> the addresses last published

    @abc.abstractmethod
    def describe(self, role: str) -> str:
        """Where the role's instances come from, for logs and 503 messages."""

    @abc.abstractmethod
    async def start(self, on_change: OnChange) -> None:
        """Publishes a first view of every role (empty where the source is unreachable), then
        follows changes in the background."""

    @abc.abstractmethod
    async def close(self) -> None:
        ...

    def _changed(self, role: str, addresses: list[str] | tuple[str, ...]) -> bool:
        """Records the role's new view; False when it is the one already published."""
        view = tuple(sorted(set(addresses)))
        if self.views.get(role) == view:
            return False
        self.views[role] = view
        return True

    def _unreachable(self, role: str, backoff: Backoff, error: str, retry_in: float) -> None:
        """One warning per outage (then debug lines), saying the last view is kept."""
        kept = len(self.views.get(role, ()))
        log = logger.warning if backoff.failures == 1 else logger.debug
        log("%s discovery: cannot follow %s (%s); serving from the last view (%d %s instance%s); "
            "retrying in %.1fs", self.kind, self.describe(role), error, kept, role, "" if kept == 1 else "s",
            retry_in)

    def _reachable(self, role: str, backoff: Backoff) -> None:
        if backoff.failures:
            logger.info("%s discovery: recovered, following %s again", self.kind, self.describe(role))
        backoff.reset()


def make_discovery(config: RouterConfig) -> Discovery | None:
    """The source `config.discovery` names; None for static discovery (the pool's own flags)."""
    if config.discovery == "dns":
        from services.router.discovery_dns import DnsDiscovery

        return DnsDiscovery(config.services, config.namespace, config.discovery_interval_s)
    if config.discovery == "kubernetes":
        from services.router.discovery_kubernetes import KubernetesDiscovery

        return KubernetesDiscovery(config.services, config.namespace or "default",
                                   kubeconfig=config.kubeconfig, api_url=config.kube_api_url)
    return None
