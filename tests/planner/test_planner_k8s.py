"""The planner's Kubernetes side against an emulated API server (real HTTP, the real kubernetes
client): it scales the right Deployment through the scale subresource, and only that one."""
from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kube_emulator import DEPLOYMENTS, ENDPOINTSLICES, KubeEmulator, deployment, endpointslice
from services.planner import k8s
from services.planner.cli import add_planner_parser, build_planner
from services.planner.config import PlannerConfig, RoleTargets
from services.planner.planner import Planner
from services.planner.policy import RoleLoad

NS = "llm"
PREFILL, DECODE = "rel-pdserve-prefill", "rel-pdserve-decode"


@pytest.fixture
def kube():
    emulator = KubeEmulator()
    for ns, name, replicas in ((NS, PREFILL, 1), (NS, DECODE, 2), ("other", PREFILL, 1)):
        emulator.put(DEPLOYMENTS, deployment(ns, name, replicas))
    yield emulator
    emulator.close()


class FixedLoad:
    def __init__(self, loads: dict[str, RoleLoad]) -> None:
        self.loads = loads

    def read(self, roles):
        return {r: self.loads.get(r) for r in roles}


# 4000 prompt tokens/s over 1000 per replica at 70%: 6 prefill replicas. Decode: 2 ready, light load.
LOADS = {"prefill": RoleLoad(pods=1, prompt_tokens_per_s=4000.0, ttft_p90_s=0.4),
         "decode": RoleLoad(pods=2, generation_tokens_per_s=900.0, waiting=0.0, kv_cache_usage=0.3, itl_p90_s=0.02)}
CONFIG = dict(prefill=RoleTargets(max_replicas=8, latency_target_s=1.0, capacity_per_replica=1000),
              decode=RoleTargets(max_replicas=8, latency_target_s=0.05, capacity_per_replica=1000,
                                 kv_cache_usage_target=0.8))


def patches(kube: KubeEmulator) -> list:
    return [r for r in kube.requests() if str(r.method).upper().endswith("PATCH")]


def test_planner_scales_the_prefill_deployment_through_the_scale_subresource(kube, caplog):
    api = k8s.api_client(host=kube.url)
    scaler = k8s.DeploymentScaler(api, NS, {"prefill": PREFILL, "decode": DECODE})
    planner = Planner(PlannerConfig(**CONFIG), FixedLoad(LOADS), scaler)
    with caplog.at_level(logging.INFO, logger="pdserve.planner"):
        decisions = {d.role: d for d in planner.step()}
    assert (decisions["prefill"].current, decisions["prefill"].desired) == (1, 6)
    assert decisions["decode"].direction == "hold"
    assert kube.replicas(NS, PREFILL) == 6
    assert kube.replicas(NS, DECODE) == 2 and kube.replicas("other", PREFILL) == 1
    [patch] = patches(kube)
    assert patch.url.path == f"/apis/apps/v1/namespaces/{NS}/deployments/{PREFILL}/scale"
    assert patch.data == {"spec": {"replicas": 6}}
    assert patch.headers["Content-Type"] in ("application/merge-patch+json", "application/strategic-merge-patch+json")
    [line] = [r.getMessage() for r in caplog.records if "scaled" in r.getMessage()]
    assert line.startswith(f"scaled prefill 1 -> 6 (Deployment {NS}/{PREFILL}): prompt 4e+03 tokens/s needs 6")
    # The next round sees 6 replicas (1 ready, 5 starting) and leaves them be: no second PATCH.
    assert {d.role: d.direction for d in planner.step()} == {"prefill": "hold", "decode": "hold"}
    assert len(patches(kube)) == 1


def test_dry_run_reads_kubernetes_but_never_writes(kube, caplog):
    api = k8s.api_client(host=kube.url)
    scaler = k8s.DeploymentScaler(api, NS, {"prefill": PREFILL, "decode": DECODE})
    planner = Planner(PlannerConfig(**CONFIG, dry_run=True), FixedLoad(LOADS), scaler)
    with caplog.at_level(logging.INFO, logger="pdserve.planner"):
        planner.step()
    assert patches(kube) == [] and kube.replicas(NS, PREFILL) == 1
    assert any(r.getMessage().startswith(f"[dry-run] would scale prefill 1 -> 6 (Deployment {NS}/{PREFILL})")
               for r in caplog.records)
    registry = planner.metrics.registry
    assert registry.get_sample_value("pdserve:planner_desired_replicas", {"role": "prefill"}) == 6
    assert registry.get_sample_value("pdserve:planner_current_replicas", {"role": "prefill"}) == 1
    assert registry.get_sample_value("pdserve:planner_scaling_decisions_total",
                                     {"role": "prefill", "direction": "up", "dry_run": "true"}) == 1


class FakePod:
    """A metrics endpoint whose counters grow at a fixed rate, as a busy engine's would."""

    def __init__(self, role: str, tokens_per_s: float) -> None:
        self.role, self.rate, self.t0 = role, tokens_per_s, time.monotonic()
        pod = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = pod.metrics().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def metrics(self) -> str:
        n = self.rate * (time.monotonic() - self.t0)
        labels = f'model_name="m",role="{self.role}",engine_id="{self.role}-{self.port}"'
        lines = [f"# TYPE pdserve:{name} gauge\npdserve:{name}{{{labels}}} {value}" for name, value in
                 (("num_requests_running", 3), ("num_requests_waiting", 0), ("kv_cache_usage_perc", 0.2),
                  ("outstanding_tokens", 0))]
        if self.role == "prefill":
            lines += ["# TYPE pdserve:prompt_tokens counter", f"pdserve:prompt_tokens_total{{{labels}}} {n}"]
        else:  # one ITL observation per generated token
            itl = "pdserve:inter_token_latency_seconds"
            lines += [f"# TYPE {itl} histogram", f'{itl}_bucket{{{labels},le="0.02"}} {n}',
                      f'{itl}_bucket{{{labels},le="+Inf"}} {n}', f"{itl}_count{{{labels}}} {n}",
                      f"{itl}_sum{{{labels}}} {0.015 * n}"]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_planner_cli_discovers_pods_through_endpointslices_and_scales(kube):
    # 3,850 prompt tokens/s against 700 a pod (1000 at 70%): 5.5 pods, 6 wanted, a rung's margin (9%)
    # either way for the scrapes' own timing, which a busy machine moves.
    pods = [FakePod("prefill", 1925.0), FakePod("prefill", 1925.0), FakePod("decode", 100.0), FakePod("decode", 100.0)]
    try:
        for i, pod in enumerate(pods):  # one slice per pod: a slice's ports hold for all its endpoints
            service = PREFILL if pod.role == "prefill" else DECODE
            kube.put(ENDPOINTSLICES, endpointslice(NS, service, ["127.0.0.1"], [], pod.port)
                     | {"metadata": {"name": f"{service}-{i}", "namespace": NS,
                                     "labels": {"kubernetes.io/service-name": service}}})
        kube.put(ENDPOINTSLICES, endpointslice(NS, PREFILL, [], ["127.0.0.9"], 1) | {
            "metadata": {"name": f"{PREFILL}-starting", "namespace": NS,
                         "labels": {"kubernetes.io/service-name": PREFILL}}})
        api = k8s.api_client(host=kube.url)
        assert k8s.endpointslice_addresses(api, NS, PREFILL, "metrics") == sorted(
            f"127.0.0.1:{p.port}" for p in pods[:2])
        path = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
        listed = [r for r in kube.requests() if r.url.path == path]
        assert listed[-1].params["labelSelector"] == f"kubernetes.io/service-name={PREFILL}"

        parser = argparse.ArgumentParser()
        add_planner_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args([
            "planner", "--kube-api-url", kube.url, "--namespace", NS, "--prefill-deployment", PREFILL,
            "--decode-deployment", DECODE, "--metrics-source", "scrape", "--prefill-service", PREFILL,
            "--decode-service", DECODE, "--prefill-capacity", "1000", "--decode-capacity", "1000"])
        planner = build_planner(args)
        planner.step()  # the first scrape: no rates yet
        assert patches(kube) == []
        # The counters grow by rate x elapsed, so any interval measures the same rates; a longer one
        # keeps the scrape's own latency (which a busy machine stretches) a small part of it.
        time.sleep(3.0)
        decisions = {d.role: d for d in planner.step()}
        assert decisions["prefill"].desired == 6, decisions["prefill"].reason  # 3850 tokens/s / 700
        assert decisions["decode"].direction == "hold", decisions["decode"].reason
        assert kube.replicas(NS, PREFILL) == 6 and kube.replicas(NS, DECODE) == 2
        assert [json.dumps(p.data) for p in patches(kube)] == ['{"spec": {"replicas": 6}}']
    finally:
        for pod in pods:
            pod.close()


def test_dns_discovery_lists_every_address_of_a_name():
    assert "127.0.0.1:50051" in k8s.dns_addresses("localhost", 50051)
    assert k8s.dns_addresses("no-such-service.invalid", 50051) == []
