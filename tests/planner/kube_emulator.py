"""An emulated Kubernetes API server (kmock) on 127.0.0.1, run on its own event loop so that
the synchronous kubernetes client (and the planner) talk real HTTP to it from the test thread."""
from __future__ import annotations

import asyncio
import threading

import kmock

DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
ENDPOINTSLICES = kmock.resource("discovery.k8s.io", "v1", "endpointslices")


def deployment(namespace: str, name: str, replicas: int) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}}},
            "status": {"replicas": replicas, "readyReplicas": replicas}}


def endpointslice(namespace: str, service: str, ready: list[str], not_ready: list[str], port: int) -> dict:
    endpoints = [{"addresses": [ip], "conditions": {"ready": ok}} for ips, ok in ((ready, True), (not_ready, False))
                 for ip in ips]
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": f"{service}-abcde", "namespace": namespace,
                         "labels": {"kubernetes.io/service-name": service}},
            "endpoints": endpoints, "ports": [{"name": "grpc", "port": 50051, "protocol": "TCP"},
                                              {"name": "metrics", "port": port, "protocol": "TCP"}]}


class KubeEmulator:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._stop = asyncio.Event()
        started = self.run(self._start(), wait=False)
        self.url = started.result(30)

    def run(self, coro, wait: bool = True):
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(30) if wait else future

    async def _start(self) -> str:
        ready: asyncio.Future = self.loop.create_future()
        self._task = self.loop.create_task(self._serve(ready))
        return await ready

    async def _serve(self, ready: asyncio.Future) -> None:
        async with kmock.KubernetesEmulator() as k, kmock.Server(k) as server:
            self.k = k
            # The scale subresource answers with an autoscaling/v1 Scale, as a real API server does
            # (the emulator itself applies the PATCH to the stored Deployment's spec).
            k["get", DEPLOYMENTS, kmock.subresource("scale")] << self._scale
            k["patch", DEPLOYMENTS, kmock.subresource("scale")] << self._scale
            ready.set_result(str(server.url).rstrip("/"))
            await self._stop.wait()

    def _scale(self, request) -> dict:
        obj = self.k.objects[DEPLOYMENTS, request.namespace, request.name]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": request.name, "namespace": request.namespace},
                "spec": {"replicas": obj["spec"]["replicas"]},
                "status": {"replicas": obj["status"]["replicas"], "selector": f"app={request.name}"}}

    def put(self, resource, obj: dict) -> None:
        async def put() -> None:
            meta = obj["metadata"]
            self.k.objects[resource, meta["namespace"], meta["name"]] = obj
        self.run(put())

    def replicas(self, namespace: str, name: str) -> int:
        async def get() -> int:
            return self.k.objects[DEPLOYMENTS, namespace, name]["spec"]["replicas"]
        return self.run(get())

    def requests(self) -> list:
        async def get() -> list:
            return list(self.k)
        return self.run(get())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        asyncio.run_coroutine_threadsafe(asyncio.wait_for(self._task, 10), self.loop).result(15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
