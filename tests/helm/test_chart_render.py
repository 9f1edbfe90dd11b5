"""The chart lints and renders with Helm 3 and Helm 4 for every value set, every manifest
validates strictly against the Kubernetes schemas, and what it renders is what a user needs."""
from __future__ import annotations

import functools

import pytest

from chart_tools import (KUBE_VERSIONS, NAMESPACE, by_kind, container, helm, lint, render, template, validate,
                         CHART)

HELMS = ("3", "4")
VALUE_SETS = (None, "cpu-only", "gpu-ucx-rdma", "hpa", "planner", "ingress", "model-pvc", "engine-mtls", "kv-events",
              "tensor-parallel", "router-tls")
ENGINES = ("pd-pdserve-prefill", "pd-pdserve-decode")


@functools.cache
def rendered(value_set: str | None, major: str = "3") -> list[dict]:
    return render(major, value_set)


@pytest.mark.parametrize("major", HELMS)
@pytest.mark.parametrize("value_set", VALUE_SETS, ids=lambda v: v or "defaults")
def test_chart_lints_renders_and_validates_strictly(major, value_set):
    lint(major, value_set)
    docs = rendered(value_set, major)
    errors = [e for version in KUBE_VERSIONS for doc in docs for e in validate(doc, version)]
    assert errors == [], "\n".join(errors)
    assert set(by_kind(docs, "Deployment")) >= {"pd-pdserve-router", *ENGINES}


def test_strict_validation_rejects_what_kubernetes_would():
    deployment = dict(by_kind(rendered(None), "Deployment")["pd-pdserve-prefill"])
    deployment["spec"] = dict(deployment["spec"], replica=2)  # a typo: the API server would reject it
    assert any("replica" in e for e in validate(deployment, KUBE_VERSIONS[0]))


def pod_specs(docs):
    for d in docs:
        if d["kind"] == "Deployment":
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]
        elif d["kind"] == "Pod":
            yield d["metadata"]["name"], d["spec"]


@pytest.mark.parametrize("value_set", VALUE_SETS, ids=lambda v: v or "defaults")
def test_every_pod_is_non_root_with_a_read_only_root_and_gpus_requested_as_limited(value_set):
    for name, spec in pod_specs(rendered(value_set)):
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"]
            limits, requests = c.get("resources", {}).get("limits", {}), c.get("resources", {}).get("requests", {})
            for resource in (r for r in limits if "/" in r):  # GPUs, RDMA NICs: requests = limits
                assert requests.get(resource) == limits[resource], (name, resource)


def test_gpu_engines_get_one_gpu_each_and_the_router_none():
    docs = rendered(None)
    deployments = by_kind(docs, "Deployment")
    for name in ENGINES:
        assert container(deployments[name])["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in container(deployments["pd-pdserve-router"])["resources"].get("limits", {})
    cpu = by_kind(rendered("cpu-only"), "Deployment")
    assert not any("nvidia.com/gpu" in str(container(d)["resources"]) for d in cpu.values())
    assert "--model=tiny" in container(cpu["pd-pdserve-prefill"])["args"]


def test_engines_probe_grpc_health_with_a_generous_startup_and_the_router_http_health():
    for name, d in by_kind(rendered(None), "Deployment").items():
        c = container(d)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        startup = c["startupProbe"]
        if name in ENGINES:
            assert c["readinessProbe"]["grpc"] == {"port": ports["grpc"]} == startup["grpc"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60  # download + load a model
        else:  # alive is not ready: an engine outage takes routers out of the Service, never restarts them
            assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
            assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"} == startup["httpGet"]


def test_router_finds_the_engines_through_their_headless_services():
    docs = rendered(None)
    services = by_kind(docs, "Service")
    router = container(by_kind(docs, "Deployment")["pd-pdserve-router"])
    assert "--discovery=dns" in router["args"]
    for role in ("prefill", "decode"):
        svc = services[f"pd-pdserve-{role}"]
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
        grpc = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert f"--{role}-service=pd-pdserve-{role}:{grpc}" in router["args"]
    assert by_kind(docs, "Role") == {}  # dns discovery needs no API rights
    assert by_kind(docs, "Deployment")["pd-pdserve-router"]["spec"]["template"]["spec"][
        "automountServiceAccountToken"] is False


def test_defaults_download_from_hugging_face_and_share_the_kv_secret():
    docs = rendered(None)
    secret = by_kind(docs, "Secret")["pd-pdserve-kv"]
    for name in ENGINES:
        spec = by_kind(docs, "Deployment")[name]["spec"]["template"]["spec"]
        [init] = spec["initContainers"]
        assert init["name"] == "download-model"
        env = {e["name"]: e for e in container({"spec": {"template": {"spec": spec}}})["env"]}
        assert env["PDSERVE_KV_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
        dshm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert dshm["emptyDir"]["medium"] == "Memory"
    prefill_env = {e["name"]: e for e in container(by_kind(docs, "Deployment")["pd-pdserve-prefill"])["env"]}
    assert prefill_env["PDSERVE_KV_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_ucx_over_rdma_sets_ucx_and_asks_for_the_nics():
    docs = rendered("gpu-ucx-rdma")
    for name in ENGINES:
        c = container(by_kind(docs, "Deployment")[name])
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert "--kv-transport=ucx" in c["args"]
        assert env["UCX_TLS"] == "rc,cuda_copy,cuda_ipc" and env["UCX_NET_DEVICES"] == "mlx5_0:1"
        assert c["resources"]["requests"]["rdma/rdma_shared_device_a"] == 1
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        init_env = {e["name"]: e for e in by_kind(docs, "Deployment")[name]["spec"]["template"]["spec"][
            "initContainers"][0]["env"]}
        assert init_env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    router = container(by_kind(docs, "Deployment")["pd-pdserve-router"])
    assert "IPC_LOCK" not in str(router["securityContext"]) and "rdma" not in str(router["resources"])


def test_shm_puts_prefill_and_decode_side_by_side_on_the_host_network():
    docs = render("3", "cpu-only", {"kvTransfer.transport": "shm", "kvTransfer.shm.sizeLimit": "2Gi"})
    for name in ENGINES:
        spec = by_kind(docs, "Deployment")[name]["spec"]["template"]["spec"]
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert next(v for v in spec["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "2Gi"
    decode = by_kind(docs, "Deployment")["pd-pdserve-decode"]["spec"]["template"]["spec"]
    [term] = decode["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "prefill"
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert [e for v in KUBE_VERSIONS for d in docs for e in validate(d, v)] == []


def test_hpa_per_role_owns_the_replica_count_and_the_service_monitor_scrapes_every_role():
    docs = rendered("hpa")
    deployments, hpas = by_kind(docs, "Deployment"), by_kind(docs, "HorizontalPodAutoscaler")
    assert set(hpas) == {"pd-pdserve-router", *ENGINES}
    for name, hpa in hpas.items():
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert "replicas" not in deployments[name]["spec"]  # helm upgrade must not undo the HPA
        assert deployments[name]["metadata"]["labels"]["pdserve.io/scaled-by"] == "hpa"
    assert hpas["pd-pdserve-decode"]["spec"]["minReplicas"] == 2
    metrics = {m["pods"]["metric"]["name"] for m in hpas["pd-pdserve-prefill"]["spec"]["metrics"]}
    assert "pdserve_prompt_tokens_per_second" in metrics
    [monitor] = by_kind(docs, "ServiceMonitor").values()
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = [s for s in by_kind(docs, "Service").values() if selector.items() <= s["metadata"]["labels"].items()]
    ports = {p["name"] for s in scraped for p in s["spec"]["ports"]}
    assert {s["metadata"]["name"] for s in scraped} == {"pd-pdserve-router", *ENGINES}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_planner_scales_only_its_deployments_and_the_router_lists_endpointslices():
    docs = rendered("planner")
    deployments, roles = by_kind(docs, "Deployment"), by_kind(docs, "Role")
    planner = container(deployments["pd-pdserve-planner"])
    [scale, slices] = roles["pd-pdserve-planner"]["rules"]
    assert scale["resources"] == ["deployments/scale"] and set(scale["resourceNames"]) == set(ENGINES)
    assert set(scale["verbs"]) == {"get", "patch", "update"} and slices["resources"] == ["endpointslices"]
    for name in ENGINES:
        role = name.rsplit("-", 1)[1]
        assert f"--{role}-deployment={name}" in planner["args"] and f"--{role}-service={name}" in planner["args"]
        assert "replicas" not in deployments[name]["spec"]
        assert deployments[name]["metadata"]["labels"]["pdserve.io/scaled-by"] == "planner"
    assert "pdserve.io/scaled-by" not in deployments["pd-pdserve-router"]["metadata"]["labels"]
    assert f"--namespace={NAMESPACE}" in planner["args"] and "--metrics-source=scrape" in planner["args"]
    router = deployments["pd-pdserve-router"]
    assert "--discovery=kubernetes" in container(router)["args"]
    assert router["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    assert roles["pd-pdserve-router"]["rules"][0]["resources"] == ["endpointslices"]
    binding = by_kind(docs, "RoleBinding")["pd-pdserve-router"]
    assert binding["subjects"][0]["name"] == router["spec"]["template"]["spec"]["serviceAccountName"]


def test_ingress_routes_to_the_router_service():
    docs = rendered("ingress")
    [ingress] = by_kind(docs, "Ingress").values()
    service = by_kind(docs, "Service")["pd-pdserve-router"]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == service["metadata"]["name"]
    assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
    assert service["spec"]["type"] == "LoadBalancer" and ingress["spec"]["tls"][0]["secretName"] == "llm-example-tls"
    env = {e["name"]: e for e in container(by_kind(docs, "Deployment")["pd-pdserve-router"])["env"]}
    assert env["PDSERVE_ROUTER_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "pdserve-api-key"


def test_lora_adapters_reach_both_engines_and_the_router():
    deployments = by_kind(rendered("model-pvc"), "Deployment")
    pairs = ["qwen-sql=/models/adapters/sql", "qwen-support=/models/adapters/support"]
    for role in ("prefill", "decode"):
        args = container(deployments[f"pd-pdserve-{role}"])["args"]
        at = args.index("--lora-modules")
        assert "--enable-lora" in args and "--max-lora-rank=32" in args and args[at + 1:at + 3] == pairs
    args = container(deployments["pd-pdserve-router"])["args"]
    at = args.index("--lora-modules")
    assert args[at + 1:at + 3] == pairs and "--enable-lora" not in args and "--allow-runtime-lora-updating" in args
    assert "--lora-resolver-dir=/models/adapters" in args
    plain = by_kind(rendered(None), "Deployment")
    assert not any("lora" in a for a in container(plain["pd-pdserve-decode"])["args"])
    assert not any("lora" in a for a in container(plain["pd-pdserve-router"])["args"])
    # Runtime adapters alone: engines with --enable-lora and no --lora-modules.
    runtime = by_kind(render("3", None, {"engine.lora.runtimeUpdating": True}), "Deployment")
    args = container(runtime["pd-pdserve-decode"])["args"]
    assert "--enable-lora" in args and "--lora-modules" not in args and "--max-lora-rank=16" in args
    assert not any(a.startswith("--max-loras") for a in args)
    capped = by_kind(render("3", None, {"engine.lora.runtimeUpdating": True, "engine.lora.maxLoras": 4}),
                     "Deployment")
    for role in ("prefill", "decode"):
        assert "--max-loras=4" in container(capped[f"pd-pdserve-{role}"])["args"]
        assert not any(a.startswith("--max-cpu-loras") for a in container(capped[f"pd-pdserve-{role}"])["args"])
    host_capped = by_kind(render("3", None, {"engine.lora.runtimeUpdating": True, "engine.lora.maxLoras": 4,
                                             "engine.lora.maxCpuLoras": 16}), "Deployment")
    for role in ("prefill", "decode"):
        assert "--max-cpu-loras=16" in container(host_capped[f"pd-pdserve-{role}"])["args"]
    for values, error in (({"engine.lora.maxCpuLoras": 16}, "set it too"),
                          ({"engine.lora.maxLoras": 4, "engine.lora.maxCpuLoras": 2}, "must be >= engine.lora.maxLoras (4)")):
        result = template("3", None, {"engine.lora.runtimeUpdating": True, **values}, check=False)
        assert result.returncode != 0 and error in result.stderr, result.stderr
    assert "--allow-runtime-lora-updating" in container(runtime["pd-pdserve-router"])["args"]
    assert not any("resolver" in a for a in container(runtime["pd-pdserve-router"])["args"])
    result = template("3", None, {"engine.lora.resolverDir": "/models/adapters"}, check=False)
    assert result.returncode != 0 and "set engine.lora.runtimeUpdating too" in result.stderr
    # Under tensor parallelism every rank holds its shard of each adapter: the same flags.
    sharded = container(by_kind(render("3", "model-pvc", {"decode.tensorParallelSize": 2}),
                                "Deployment")["pd-pdserve-decode"])["args"]
    assert "--tensor-parallel-size=2" in sharded and "--enable-lora" in sharded


def test_model_from_a_pvc_is_mounted_read_only_and_nothing_is_downloaded():
    docs = rendered("model-pvc")
    for name in (*ENGINES, "pd-pdserve-router"):
        spec = by_kind(docs, "Deployment")[name]["spec"]["template"]["spec"]
        assert "initContainers" not in spec
        volume = next(v for v in spec["volumes"] if v["name"] == "model")
        assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        assert "--model=/models/qwen2.5-7b-instruct" in container({"spec": {"template": {"spec": spec}}})["args"]
    planner = container(by_kind(docs, "Deployment")["pd-pdserve-planner"])
    assert "--dry-run" in planner["args"] and f'--prometheus-selector=namespace="{NAMESPACE}"' in planner["args"]


def test_helm_test_pod_sends_a_completion_through_the_router():
    docs = rendered(None)
    [pod] = by_kind(docs, "Pod").values()
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    service = by_kind(docs, "Service")["pd-pdserve-router"]
    assert env["ROUTER_URL"] == f"http://pd-pdserve-router.{NAMESPACE}.svc:{service['spec']['ports'][0]['port']}"
    assert "/v1/completions" in pod["spec"]["containers"][0]["command"][-1]


def test_notes_say_how_to_reach_the_router_send_a_request_and_watch_scaling():
    # Helm 4 renders NOTES without a cluster (`install --dry-run=client`); Helm 3 still asks one for its version.
    out = helm("4", "install", "pd", str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
               "-f", str(CHART.parents[1] / "tests" / "helm" / "values" / "planner.yaml")).stdout
    notes = out[out.index("NOTES:"):]
    assert "kubectl -n llm port-forward svc/pd-pdserve-router 8000:80" in notes
    assert "/v1/completions" in notes and '"model": "Qwen/Qwen2.5-1.5B-Instruct"' in notes
    assert "prefill: the planner" in notes and "logs -f deploy/pd-pdserve-planner" in notes


def test_gpu_memory_utilization_reaches_both_engines_and_parses():
    """engine.gpuMemoryUtilization: each engine sizes its KV cache to that share of its GPU."""
    import argparse

    from services.decode.cli import add_parsers as add_decode_parsers
    from services.prefill.cli import add_parser as add_prefill_parser

    p = argparse.ArgumentParser(prog="pdserve")
    sub = p.add_subparsers(dest="command", required=True)
    add_prefill_parser(sub)
    add_decode_parsers(sub)
    docs = render("3", "gpu-ucx-rdma", sets={"engine.kvCacheMemoryGb": None, "engine.gpuMemoryUtilization": 0.9})
    for name in ENGINES:
        args = container(by_kind(docs, "Deployment")[name])["args"]
        assert "--gpu-memory-utilization=0.9" in args and not any(a.startswith("--kv-cache-memory-gb") for a in args)
        parsed = p.parse_args(args)
        assert parsed.gpu_memory_utilization == 0.9 and parsed.kv_cache_memory_gb is None
        assert parsed.quantized_weights == "dequantize" and not any("quantized" in a for a in args)
        assert parsed.kv_cache_dtype == "auto" and not any("kv-cache-dtype" in a for a in args)
    docs = render("3", "gpu-ucx-rdma", sets={"engine.quantizedWeights": "keep", "engine.kvCacheDtype": "fp8"})
    for name in ENGINES:
        parsed = p.parse_args(container(by_kind(docs, "Deployment")[name])["args"])
        assert (parsed.quantized_weights, parsed.kv_cache_dtype) == ("keep", "fp8")
