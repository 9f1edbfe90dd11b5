"""Router discovery: the instances follow a Service's pods (Kubernetes EndpointSlices through an
emulated API server that the real `kubernetes` client talks HTTP to, or DNS records), removed
instances drain, and a lost API server or DNS leaves the router serving from its last view."""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import socket

import aiohttp.test_utils
import aiohttp.web
import kmock
import pytest
from kubernetes import client

from services.router.cli import add_router_parser, config_from_args
from services.router.config import RouterConfig
from services.router.discovery import Backoff, pod_namespace
from services.router.discovery_dns import DnsDiscovery, resolve_host, service_dns_name
from services.router.discovery_kubernetes import slice_addresses
from services.router.server import Router

from router_fakes import KVRegistry, start_fake
from router_harness import Stack, wait_until

NS = "serving"
ENDPOINTSLICES = kmock.resource("discovery.k8s.io", "v1", "endpointslices")
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 3}


class _GoesAwayAtOnce(aiohttp.test_utils.RawTestServer):
    """Stops as a crashed API server does: open watch streams are cut, not waited for."""

    async def _make_runner(self, debug: bool = True, **kwargs):
        server = aiohttp.web.Server(self._handler, loop=self._loop, debug=debug, **kwargs)
        return aiohttp.web.ServerRunner(server, debug=debug, shutdown_timeout=0.1, **kwargs)


class KubeApi:
    """kmock's KubernetesEmulator on 127.0.0.1 (on the tests' event loop), which can be stopped and
    started again on the same port with its objects kept; the test writes EndpointSlices to it
    with the real client, as the EndpointSlice controller would (the emulator has no controllers)."""

    def __init__(self, lt) -> None:
        self.lt, self.port, self.server = lt, None, None
        self.k = lt.run(self._enter())
        self.start()

    @staticmethod
    async def _enter():
        k = kmock.KubernetesEmulator()
        await k.__aenter__()
        k.resources[ENDPOINTSLICES] = kmock.ResourceInfo(namespaced=True, kind="EndpointSlice")
        return k

    def start(self) -> None:
        async def start() -> int:
            self.server = kmock.Server(self.k, port=self.port, server_cls=_GoesAwayAtOnce)
            await self.server.__aenter__()
            return self.server.port

        self.port = self.lt.run(start())
        self.url = f"http://127.0.0.1:{self.port}"
        self.slices = client.DiscoveryV1Api(client.ApiClient(client.Configuration(host=self.url)))

    def stop(self) -> None:
        self.lt.run(self.server.__aexit__(None, None, None))
        self.server = None

    def close(self) -> None:
        if self.server is not None:
            self.stop()
        self.lt.run(self.k.__aexit__(None, None, None))

    def add_pod(self, service: str, pod: str, port: int, ready: bool = True) -> None:
        """One slice per pod: every fake listens on 127.0.0.1, each on a port of its own."""
        self.slices.create_namespaced_endpoint_slice(NS, {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": pod, "namespace": NS, "labels": {"kubernetes.io/service-name": service}},
            "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": ready},
                           "targetRef": {"kind": "Pod", "name": pod, "namespace": NS}}],
            "ports": [{"name": "metrics", "port": 9090, "protocol": "TCP"},
                      {"name": "grpc", "port": port, "protocol": "TCP"}]})

    def set_ready(self, pod: str, ready: bool) -> None:
        self.slices.patch_namespaced_endpoint_slice(pod, NS, {"endpoints": [
            {"addresses": ["127.0.0.1"], "conditions": {"ready": ready, "terminating": not ready}}]})

    def delete_while_down(self, pod: str) -> None:
        async def delete() -> None:
            self.k.objects[ENDPOINTSLICES, NS, pod].delete()
        self.lt.run(delete())


@pytest.fixture
def kube_api(loop_thread):
    api = KubeApi(loop_thread)
    yield api
    api.close()


@pytest.fixture
def make_router(loop_thread, tiny_model_path, tokenizer):
    """make_router(**config) -> a started Router (HTTP only) and the Stack helpers around it."""
    made = []

    def make(**config) -> Stack:
        cfg = dict(model=tiny_model_path, served_model_name="tiny", host="127.0.0.1", port=0, grpc_port=-1,
                   health_check_interval_s=0.1, drain_timeout_s=5.0)
        router = Router(RouterConfig(**{**cfg, **config}), tokenizer=tokenizer)
        loop_thread.run(router.start())
        made.append(Stack(loop_thread, router, [], []))
        return made[-1]

    yield make
    for stack in made:
        loop_thread.run(stack.router.stop())


@pytest.fixture
def fakes(loop_thread):
    """fakes(role, **kwargs) -> a started fake engine; all share one KV registry."""
    registry, started = KVRegistry(), []

    def start(role: str, **kwargs):
        started.append(loop_thread.run(start_fake(role, registry, name=f"{role}-{len(started)}", **kwargs)))
        return started[-1]

    yield start
    for server in started:
        loop_thread.run(server.stop(0))


def healthy(stack: Stack, role: str) -> set[str]:
    return {i.address for i in stack.router.pool.healthy(role)}


def known(stack: Stack, role: str) -> set[str]:
    return {i.address for i in stack.router.pool.instances(role)}


def kube_router(make_router, api: KubeApi) -> Stack:
    return make_router(discovery="kubernetes", prefill_service="prefill", decode_service="decode", namespace=NS,
                       kube_api_url=api.url)


def test_kubernetes_discovery_follows_endpointslices_and_drains_removed_pods(kube_api, make_router, fakes, caplog):
    caplog.set_level(logging.INFO, logger="services.router")
    p0, d0 = fakes("prefill"), fakes("decode", token_delay=0.05)
    kube_api.add_pod("prefill", "prefill-0", p0.port)
    kube_api.add_pod("decode", "decode-0", d0.port)
    kube_api.add_pod("decode", "decode-starting", 1, ready=False)  # not ready: never routed to
    kube_api.add_pod("other", "other-0", 2)  # another Service's slice (the emulator ignores selectors)
    stack = kube_router(make_router, kube_api)
    wait_until(lambda: healthy(stack, "prefill") == {p0.address} and healthy(stack, "decode") == {d0.address},
               what="the first view")
    assert known(stack, "decode") == {d0.address}
    assert stack.post("/v1/completions", COMPLETION)[0] == 200

    # A pod comes up: its instance joins and takes requests.
    p1 = fakes("prefill")
    kube_api.add_pod("prefill", "prefill-1", p1.port)
    wait_until(lambda: healthy(stack, "prefill") == {p0.address, p1.address}, what="prefill-1 added")
    for _ in range(4):
        assert stack.post("/v1/completions", COMPLETION)[0] == 200
    assert len(p1.engine.requests) >= 1 and len(p0.engine.requests) >= 2

    # A pod stops being ready mid-stream: no new requests go to it, the stream in flight finishes.
    d1 = fakes("decode")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        inflight = pool.submit(stack.sse, "/v1/completions", {**COMPLETION, "max_tokens": 40, "stream": True})
        wait_until(lambda: d0.engine.running, what="a stream in flight on decode-0")
        kube_api.add_pod("decode", "decode-1", d1.port)
        kube_api.set_ready("decode-0", False)
        wait_until(lambda: known(stack, "decode") == healthy(stack, "decode") == {d1.address},
                   what="decode-0 drained, decode-1 added")
        assert d0.engine.running, "the stream should still be in flight"
        served_by_d0 = len(d0.engine.requests)
        assert stack.post("/v1/completions", COMPLETION)[0] == 200
        events = inflight.result(30)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert len(d0.engine.requests) == served_by_d0 and not d0.engine.cancelled and len(d1.engine.requests) == 1
    gauge = stack.router.metrics.registry.get_sample_value
    assert gauge("pdserve:router_instance_healthy", {"role": "decode", "instance": d0.address}) is None
    assert gauge("pdserve:router_instance_healthy", {"role": "decode", "instance": d1.address}) == 1.0
    assert f"decode instance {d0.address} removed by discovery" in caplog.text

    # The API server goes away: the router keeps serving from its last view and retries.
    kube_api.stop()
    wait_until(lambda: "cannot follow the EndpointSlices of Service serving/prefill" in caplog.text,
               what="the outage logged")
    assert "serving from the last view (2 prefill instances)" in caplog.text
    for _ in range(3):
        assert stack.post("/v1/completions", COMPLETION)[0] == 200
    assert healthy(stack, "prefill") == {p0.address, p1.address} and healthy(stack, "decode") == {d1.address}

    # It comes back: a fresh list replaces the view, so what changed meanwhile is not missed.
    kube_api.delete_while_down("prefill-1")
    kube_api.start()
    wait_until(lambda: known(stack, "prefill") == {p0.address}, timeout=20, what="the view after the outage")
    assert "recovered, following the EndpointSlices of Service serving/prefill (port grpc) again" in caplog.text
    assert stack.post("/v1/completions", COMPLETION)[0] == 200


def test_kubernetes_discovery_starts_without_the_api_and_catches_up(kube_api, make_router, fakes, tmp_path):
    d0 = fakes("decode")
    kube_api.add_pod("decode", "decode-0", d0.port)
    kube_api.stop()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: emulated, cluster: {{server: "{kube_api.url}"}}}}]
users: [{{name: nobody, user: {{}}}}]
contexts: [{{name: emulated, context: {{cluster: emulated, user: nobody, namespace: {NS}}}}}]
current-context: emulated
""")
    stack = make_router(discovery="kubernetes", decode_service="decode", namespace=NS, kubeconfig=str(kubeconfig))
    status, _, body = stack.post("/v1/completions", COMPLETION)
    assert status == 503 and "none found in the EndpointSlices of Service serving/decode" in body["error"]["message"]
    kube_api.start()
    wait_until(lambda: healthy(stack, "decode") == {d0.address}, timeout=20, what="decode-0 after the API is up")
    assert stack.post("/v1/completions", COMPLETION)[0] == 200  # colocated: no prefill Service


def test_endpointslice_ready_endpoints_and_ports():
    endpoint_slice = {
        "ports": [{"name": "metrics", "port": 9090}, {"name": "grpc", "port": 50051}],
        "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                      {"addresses": ["10.0.0.2"]},  # no conditions: ready, as the API defines it
                      {"addresses": ["10.0.0.3"], "conditions": {"ready": False, "serving": True, "terminating": True}},
                      {"addresses": ["fd00::4"], "conditions": {}}]}
    assert slice_addresses(endpoint_slice, "grpc") == ["10.0.0.1:50051", "10.0.0.2:50051", "[fd00::4]:50051"]
    assert slice_addresses(endpoint_slice, "7000") == ["10.0.0.1:7000", "10.0.0.2:7000", "[fd00::4]:7000"]
    assert slice_addresses(endpoint_slice, "kv") == []
    one_unnamed_port = {"ports": [{"port": 50061}], "endpoints": [{"addresses": ["10.0.0.5"]}]}
    assert slice_addresses(one_unnamed_port, "grpc") == ["10.0.0.5:50061"]
    assert slice_addresses({"ports": [{"name": "grpc", "port": 1}], "endpoints": None}, "grpc") == []


class Records:
    """An injected resolver: name -> addresses, or the socket.gaierror the name raises now."""

    def __init__(self, answers: dict) -> None:
        self.answers = answers

    async def __call__(self, name: str, port: int) -> list[str]:
        answer = self.answers[name]
        if isinstance(answer, Exception):
            raise answer
        return list(answer)


def test_dns_discovery_publishes_changes_and_keeps_its_view_when_dns_fails(loop_thread, caplog):
    caplog.set_level(logging.DEBUG, logger="services.router.discovery")
    records = Records({"prefill.ns.svc": ["10.0.0.1"], "decode.ns.svc": ["fd00::2", "10.0.0.2", "10.0.0.2"]})
    changes = []
    dns = DnsDiscovery({"prefill": ("prefill", "50051"), "decode": ("decode", "50061")}, "ns", 60.0,
                       resolver=records, backoff_s=(0.25, 1.0))

    async def scenario():
        await dns.start(lambda role, view: changes.append((role, view)))
        backoff = Backoff(0.25, 1.0)
        assert sorted(changes) == [("decode", ("10.0.0.2:50061", "[fd00::2]:50061")),
                                   ("prefill", ("10.0.0.1:50051",))]
        assert await dns.refresh("decode", backoff) == 60.0 and len(changes) == 2  # unchanged: not published
        records.answers["decode.ns.svc"] = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        assert [await dns.refresh("decode", backoff) for _ in range(4)] == [0.25, 0.5, 1.0, 1.0]
        assert len(changes) == 2 and dns.views["decode"] == ("10.0.0.2:50061", "[fd00::2]:50061")
        records.answers["decode.ns.svc"] = ["10.0.0.3"]
        assert await dns.refresh("decode", backoff) == 60.0
        records.answers["decode.ns.svc"] = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        await dns.refresh("decode", backoff)  # the name is gone: the Service has no ready pod
        await dns.close()

    loop_thread.run(scenario())
    assert changes[2:] == [("decode", ("10.0.0.3:50061",)), ("decode", ())]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "serving from the last view (2 decode instances)" in warnings[0].getMessage()
    assert "recovered, following DNS name decode.ns.svc (port 50061) again" in caplog.text


def test_dns_discovery_resolves_again_every_interval(loop_thread):
    records = Records({"decode.ns.svc": ["10.0.0.1"]})
    dns = DnsDiscovery({"decode": ("decode", "50061")}, "ns", 0.01, resolver=records)

    async def scenario():
        changed = asyncio.Event()
        await dns.start(lambda role, view: changed.set())
        changed.clear()
        records.answers["decode.ns.svc"] = ["10.0.0.1", "10.0.0.9"]
        await asyncio.wait_for(changed.wait(), 10)
        await dns.close()

    loop_thread.run(scenario())
    assert dns.views["decode"] == ("10.0.0.1:50061", "10.0.0.9:50061")


def test_dns_names():
    assert service_dns_name("pdserve-decode", "serving") == "pdserve-decode.serving.svc"
    assert service_dns_name("pdserve-decode", None) == "pdserve-decode"  # the pod's search path
    assert service_dns_name("decode.other.svc.cluster.local", "serving") == "decode.other.svc.cluster.local"


def test_dns_discovery_resolves_localhost_for_real(make_router, fakes, loop_thread):
    assert "127.0.0.1" in loop_thread.run(resolve_host("localhost", 80))
    p0, d0 = fakes("prefill"), fakes("decode")
    stack = make_router(discovery="dns", prefill_service=f"localhost:{p0.port}", decode_service=f"localhost:{d0.port}")
    wait_until(lambda: healthy(stack, "prefill") == {p0.address} and healthy(stack, "decode") == {d0.address},
               what="localhost resolved")
    assert stack.post("/v1/completions", COMPLETION)[0] == 200


def config_from(*argv) -> RouterConfig:
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers(dest="command"))
    return config_from_args(parser.parse_args(["router", *argv]))


def test_discovery_flags_and_env_vars(monkeypatch):
    for name, value in {"DECODE_SERVICE": "pdserve-decode", "DISCOVERY_NAMESPACE": "serving",
                        "KUBE_API_URL": "http://127.0.0.1:1"}.items():
        monkeypatch.setenv(f"PDSERVE_ROUTER_{name}", value)
    c = config_from("--discovery", "kubernetes", "--prefill-service", "pdserve-prefill:50051")
    assert c.services == {"prefill": ("pdserve-prefill", "50051"), "decode": ("pdserve-decode", "grpc")}
    assert (c.discovery, c.namespace, c.kube_api_url, c.disaggregated) == ("kubernetes", "serving",
                                                                           "http://127.0.0.1:1", True)
    monkeypatch.delenv("PDSERVE_ROUTER_DISCOVERY_NAMESPACE")
    c = config_from("--discovery", "dns", "--decode-service", "d", "--service-port", "50061",
                    "--discovery-interval", "2")
    assert c.services == {"decode": ("d", "50061")} and c.discovery_interval_s == 2.0 and not c.disaggregated
    assert c.namespace == pod_namespace()  # outside a pod: None


def test_pod_namespace(tmp_path):
    (tmp_path / "namespace").write_text("serving\n")
    assert pod_namespace(str(tmp_path / "namespace")) == "serving"
    assert pod_namespace(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("argv,message", [
    (["--decode-service", "d"], "need --discovery dns or kubernetes"),
    (["--discovery", "dns"], "needs --decode-service"),
    (["--discovery", "dns", "--decode-service", "d"], "needs a port number"),
    (["--discovery", "kubernetes", "--decode-service", "d", "--decode", "h:1"], "list static instances"),
    (["--discovery", "kubernetes", "--decode-service", "d.other"], "a Service name"),
    (["--discovery", "kubernetes", "--decode-service", "d:0"], r"must be name\[:port\]"),
])
def test_bad_discovery_flags(argv, message):
    with pytest.raises(ValueError, match=message):
        config_from(*argv)
