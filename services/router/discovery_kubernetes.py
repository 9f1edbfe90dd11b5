"""Kubernetes discovery: list, then watch, the EndpointSlices of the prefill and decode Services.

The `kubernetes` client is synchronous, so each role's list-and-watch loop runs in a thread of its
own and hands every changed view to the event loop. Each round lists (a full, consistent view that
replaces the last one: nothing missed while disconnected lingers), then watches from the list's
resourceVersion until the server ends the watch; then it lists again. A failure keeps the last
view and retries with backoff. RBAC: get, list and watch on discovery.k8s.io endpointslices.
"""
from __future__ import annotations

import asyncio
import http
import json
import logging
import os
import threading

from services.router.discovery import Backoff, Discovery, OnChange, hostport

logger = logging.getLogger(__name__)

SERVICE_LABEL = "kubernetes.io/service-name"
CONNECT_TIMEOUT_S = 5.0
LIST_TIMEOUT_S = 30.0
JOIN_TIMEOUT_S = 5.0


def slice_addresses(endpoint_slice: dict, port: str) -> list[str]:
    """host:port of the ready endpoints of one EndpointSlice (the API's JSON). `port` is a number
    (used as it is) or the name of one of the slice's ports."""
    if port.isdigit():
        number = int(port)
    else:
        ports = endpoint_slice.get("ports") or []
        number = next((p.get("port") for p in ports if p.get("name") == port), None)
        if number is None and len(ports) == 1 and not ports[0].get("name"):
            number = ports[0].get("port")  # a Service with one port need not name it
        if number is None:
            return []
    out = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue  # unset means ready, as the API defines it; terminating pods are not ready
        out += [hostport(a, number) for a in endpoint.get("addresses") or []]
    return out


def api_client(kubeconfig: str | None = None, api_url: str | None = None):
    """`api_url`: an API server that wants no credentials (kubectl proxy, tests). Else the pod's
    service account, or outside a pod `kubeconfig` (default ~/.kube/config)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    if api_url:
        configuration.host = api_url
    elif kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ:  # in a pod
        config.load_incluster_config(client_configuration=configuration)
    else:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    # No retries inside urllib3 (each one a warning line): the watch loop retries, with backoff.
    configuration.retries = False
    return client.ApiClient(configuration)


def _error_text(e: Exception) -> str:
    from kubernetes.client.exceptions import ApiException

    if isinstance(e, ApiException):
        return f"HTTP {e.status} {e.reason}"
    return f"{type(e).__name__}: {e}"[:300]


class KubernetesDiscovery(Discovery):
    kind = "kubernetes"

    def __init__(self, services: dict[str, tuple[str, str]], namespace: str, *, kubeconfig: str | None = None,
                 api_url: str | None = None, watch_timeout_s: int = 300,
                 backoff_s: tuple[float, float] = (0.5, 30.0)) -> None:
        from kubernetes import client, config

        super().__init__(services)
        self.namespace = namespace
        try:
            self._api = api_client(kubeconfig, api_url)
        except config.ConfigException as e:
            raise ValueError(f"--discovery kubernetes: no Kubernetes API to talk to ({e}); run in a pod, "
                             "or give --kubeconfig or --kube-api-url") from None
        self._endpoint_slices = client.DiscoveryV1Api(self._api)
        self.watch_timeout_s = watch_timeout_s
        self._backoff_s = backoff_s
        self._stop = threading.Event()
        self._watches: dict[str, object] = {}  # role -> its current kubernetes.watch.Watch
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_change: OnChange | None = None

    def describe(self, role: str) -> str:
        name, port = self.services[role]
        return f"the EndpointSlices of Service {self.namespace}/{name} (port {port})"

    async def start(self, on_change: OnChange) -> None:
        self._loop, self._on_change = asyncio.get_running_loop(), on_change
        first_round = {role: asyncio.Event() for role in self.services}
        for role in self.services:
            logger.info("kubernetes discovery: %s instances from %s", role, self.describe(role))
            thread = threading.Thread(target=self._run, args=(role, first_round[role]),
                                      name=f"discovery-{role}", daemon=True)
            thread.start()
            self._threads.append(thread)
        # The first view before serving (or the first failure: then the router starts with none).
        await asyncio.gather(*(event.wait() for event in first_round.values()))

    async def close(self) -> None:
        self._stop.set()
        for w in list(self._watches.values()):
            w.stop()  # shuts the watch's socket down: the thread's blocked read returns at once
        await asyncio.gather(*(asyncio.to_thread(t.join, JOIN_TIMEOUT_S) for t in self._threads))
        self._threads.clear()
        self._api.close()

    def _run(self, role: str, first_round: asyncio.Event) -> None:
        from kubernetes.client.exceptions import ApiException

        name, port = self.services[role]
        backoff = Backoff(*self._backoff_s)
        while not self._stop.is_set():
            try:
                slices, version = self._list(name, port)
                self._reachable(role, backoff)
                self._publish(role, slices)
                self._call_soon(first_round.set)
                self._watch(role, name, port, slices, version)
            except Exception as e:
                if self._stop.is_set():
                    break
                if isinstance(e, ApiException) and e.status == http.HTTPStatus.GONE:
                    continue  # the watch's resourceVersion is too old: list again, at once
                delay = backoff.next()
                self._unreachable(role, backoff, _error_text(e), delay)
                self._call_soon(first_round.set)
                self._stop.wait(delay)

    def _list(self, name: str, port: str) -> tuple[dict[str, list[str]], str | None]:
        """-> (slice name -> its ready addresses, the list's resourceVersion)."""
        resp = self._endpoint_slices.list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"{SERVICE_LABEL}={name}", _preload_content=False,
            _request_timeout=(CONNECT_TIMEOUT_S, LIST_TIMEOUT_S))
        body = json.loads(resp.data)
        slices = {item["metadata"]["name"]: slice_addresses(item, port)
                  for item in body.get("items") or [] if self._owned_by(item, name)}
        return slices, (body.get("metadata") or {}).get("resourceVersion")

    @staticmethod
    def _owned_by(endpoint_slice: dict, name: str) -> bool:
        # The API server filters by the label selector already; a proxy or an emulator may not.
        return ((endpoint_slice.get("metadata") or {}).get("labels") or {}).get(SERVICE_LABEL) == name

    def _watch(self, role: str, name: str, port: str, slices: dict[str, list[str]], version: str | None) -> None:
        from kubernetes import watch

        w = self._watches[role] = watch.Watch()
        if self._stop.is_set():
            return  # close() ran before this watch existed to be stopped
        # timeout_seconds: the server ends the watch (we then list again); the read timeout
        # after it catches a connection that died without a word.
        events = w.stream(self._endpoint_slices.list_namespaced_endpoint_slice, self.namespace,
                          label_selector=f"{SERVICE_LABEL}={name}", resource_version=version,
                          allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout_s,
                          _request_timeout=(CONNECT_TIMEOUT_S, self.watch_timeout_s + LIST_TIMEOUT_S))
        for event in events:
            obj = event["raw_object"]
            if event["type"] == "BOOKMARK" or not self._owned_by(obj, name):
                continue
            if event["type"] == "DELETED":
                slices.pop(obj["metadata"]["name"], None)
            else:  # ADDED, MODIFIED
                slices[obj["metadata"]["name"]] = slice_addresses(obj, port)
            self._publish(role, slices)

    def _publish(self, role: str, slices: dict[str, list[str]]) -> None:
        if self._changed(role, [a for addresses in slices.values() for a in addresses]):
            self._call_soon(self._on_change, role, self.views[role])

    def _call_soon(self, fn, *args) -> None:
        if not self._stop.is_set():
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop is gone: the router is stopping
                pass
