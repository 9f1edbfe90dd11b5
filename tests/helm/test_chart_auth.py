"""Who may reach the engines, as the chart renders it: the engines' token in a Secret, mutual TLS from a
TLS Secret (health on a plaintext port for kubelet), and NetworkPolicies that let gRPC in only from the
router, KV pulls only from decode pods and metrics from where the values say."""
from __future__ import annotations

import functools

from chart_tools import by_kind, container, render

ENGINES = ("prefill", "decode")


@functools.cache
def rendered(value_set: str | None = None, **sets) -> list[dict]:
    return render("3", value_set, sets or None)


def env_of(deployment: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container(deployment).get("env", [])}


def selects(peer: dict, role: str) -> bool:
    return peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == role


def rules_for_port(policy: dict, port: str) -> list[dict]:
    """The ingress rules that open `port` (a rule with no ports opens every port)."""
    return [r for r in policy["spec"]["ingress"] if "ports" not in r or any(p["port"] == port for p in r["ports"])]


def test_by_default_every_engine_demands_a_token_the_router_holds():
    docs = rendered()
    secret = by_kind(docs, "Secret")["pd-pdserve-engine-auth"]
    assert set(secret["data"]) == {"token"}
    deployments = by_kind(docs, "Deployment")
    for role in ("router", *ENGINES):
        ref = env_of(deployments[f"pd-pdserve-{role}"])["PDSERVE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "pd-pdserve-engine-auth", "key": "token"}, role
    assert by_kind(docs, "Secret")["pd-pdserve-kv"]["data"]["kv-secret"] != secret["data"]["token"]


def test_the_token_from_an_existing_secret_or_none():
    docs = rendered(**{"engineAuth.token.existingSecret": "mine", "engineAuth.token.key": "t"})
    assert "pd-pdserve-engine-auth" not in by_kind(docs, "Secret")
    router = by_kind(docs, "Deployment")["pd-pdserve-router"]
    assert env_of(router)["PDSERVE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "mine", "key": "t"}
    docs = rendered(**{"engineAuth.token.enabled": False})
    assert "pd-pdserve-engine-auth" not in by_kind(docs, "Secret")
    assert not any("PDSERVE_AUTH_TOKEN" in env_of(d) for d in by_kind(docs, "Deployment").values())


def test_mutual_tls_mounts_the_secret_and_kubelet_probes_the_plaintext_health_port():
    deployments = by_kind(rendered("engine-mtls"), "Deployment")
    for role in ("router", *ENGINES):
        spec = deployments[f"pd-pdserve-{role}"]["spec"]["template"]["spec"]
        volume = next(v for v in spec["volumes"] if v["name"] == "engine-tls")
        assert volume["secret"]["secretName"] == "pdserve-engine-tls"
        mount = next(m for m in container(deployments[f"pd-pdserve-{role}"])["volumeMounts"]
                     if m["name"] == "engine-tls")
        assert mount == {"name": "engine-tls", "mountPath": "/etc/pdserve/tls", "readOnly": True}
    router = container(deployments["pd-pdserve-router"])
    assert {"--engine-ssl-ca-certs=/etc/pdserve/tls/ca.crt", "--engine-ssl-certfile=/etc/pdserve/tls/tls.crt",
            "--engine-ssl-keyfile=/etc/pdserve/tls/tls.key",
            "--engine-ssl-server-name=pdserve-engine.llm.svc"} <= set(router["args"])
    assert env_of(deployments["pd-pdserve-router"])["PDSERVE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"][
        "name"] == "pdserve-engine-token"
    for role in ENGINES:
        c = container(deployments[f"pd-pdserve-{role}"])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert f"--health-port={ports['health']}" in c["args"] and "--ssl-ca-certs=/etc/pdserve/tls/ca.crt" in c["args"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": ports["health"]} != {"port": ports["grpc"]}


def test_network_policies_let_grpc_in_from_the_router_and_kv_from_decode_only():
    docs = rendered()
    policies = by_kind(docs, "NetworkPolicy")
    assert set(policies) == {"pd-pdserve-prefill", "pd-pdserve-decode"}
    deployments = by_kind(docs, "Deployment")
    for role in ENGINES:
        policy = policies[f"pd-pdserve-{role}"]
        pod_labels = deployments[f"pd-pdserve-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        [grpc] = rules_for_port(policy, "grpc")
        assert len(grpc["from"]) == 1 and selects(grpc["from"][0], "router")
        [metrics] = rules_for_port(policy, "metrics")
        assert "from" not in metrics  # default: Prometheus may scrape from anywhere
        # every port a rule names is a port of the pods it guards
        named = {p["name"] for p in container(deployments[f"pd-pdserve-{role}"])["ports"]}
        assert {p["port"] for r in policy["spec"]["ingress"] for p in r.get("ports", [])} <= named
    [kv] = rules_for_port(policies["pd-pdserve-prefill"], "kv")
    assert len(kv["from"]) == 1 and selects(kv["from"][0], "decode")
    assert len(policies["pd-pdserve-decode"]["spec"]["ingress"]) == 2  # gRPC and metrics: nothing pulls from decode


def test_ucx_and_nccl_open_every_port_between_prefill_and_decode_only():
    for transport in ("ucx", "nccl"):
        policies = by_kind(rendered(**{"kvTransfer.transport": transport}), "NetworkPolicy")
        for role, peer in (("prefill", "decode"), ("decode", "prefill")):
            open_rules = [r for r in policies[f"pd-pdserve-{role}"]["spec"]["ingress"] if "ports" not in r]
            assert len(open_rules) == 1 and [selects(p, peer) for p in open_rules[0]["from"]] == [True]


def test_metrics_sources_are_configurable_and_the_planner_keeps_its_scrapes():
    policies = by_kind(rendered("engine-mtls"), "NetworkPolicy")
    for policy in policies.values():
        [metrics] = rules_for_port(policy, "metrics")
        sources = metrics["from"]
        assert sources[0] == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        assert selects(sources[1], "planner")
        [health] = rules_for_port(policy, "health")
        assert "from" not in health  # probes come from the node; health says serving or not, nothing else


def test_network_policies_can_be_turned_off():
    assert by_kind(rendered(**{"networkPolicy.enabled": False}), "NetworkPolicy") == {}


def router_parts(docs: list[dict]) -> tuple[dict, dict, dict]:
    """(the router's container, its pod spec, the helm test pod)."""
    router = by_kind(docs, "Deployment")["pd-pdserve-router"]
    [test_pod] = by_kind(docs, "Pod").values()
    return container(router), router["spec"]["template"]["spec"], test_pod


def test_the_router_serves_https_from_its_tls_secret():
    plain, _, test_pod = router_parts(rendered())
    assert not any(a.startswith("--ssl-") for a in plain["args"])
    assert plain["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert test_pod["spec"]["containers"][0]["env"][0]["value"].startswith("http://")

    docs = rendered(**{"router.tls.secretName": "router-cert"})
    c, spec, test_pod = router_parts(docs)
    ssl_args = [a for a in c["args"] if a.startswith("--ssl-")]
    assert ssl_args == ["--ssl-certfile=/etc/pdserve/router-tls/tls.crt",
                        "--ssl-keyfile=/etc/pdserve/router-tls/tls.key"]
    volume = next(v for v in spec["volumes"] if v["name"] == "router-tls")
    assert volume["secret"]["secretName"] == "router-cert"
    assert {"name": "router-tls", "mountPath": "/etc/pdserve/router-tls", "readOnly": True} in c["volumeMounts"]
    # kubelet probes over HTTPS (it does not check the certificate); the Service says https.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS"
    http = next(p for p in by_kind(docs, "Service")["pd-pdserve-router"]["spec"]["ports"] if p["name"] == "http")
    assert http["appProtocol"] == "https"
    # helm test reaches it over HTTPS with the Secret mounted (its CA checks the chain).
    test_c = test_pod["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in test_c["env"]}["ROUTER_URL"].startswith("https://pd-pdserve-router.")
    assert test_pod["spec"]["volumes"][0]["secret"]["secretName"] == "router-cert"
    assert "ca.crt" in test_c["command"][-1] and "context=context" in test_c["command"][-1]
    # The engines' side is untouched: no router certificate there.
    for role in ENGINES:
        engine = by_kind(docs, "Deployment")[f"pd-pdserve-{role}"]
        assert not any(v["name"] == "router-tls" for v in engine["spec"]["template"]["spec"]["volumes"])


def test_client_certificates_optional_or_required():
    c, _, _ = router_parts(rendered(**{"router.tls.secretName": "router-cert",
                                       "router.tls.clientCertificates": "optional"}))
    assert "--ssl-ca-certs=/etc/pdserve/router-tls/ca.crt" in c["args"] and "--ssl-cert-reqs=1" in c["args"]
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    c, _, test_pod = router_parts(rendered("router-tls"))
    assert "--ssl-cert-reqs=2" in c["args"]
    # kubelet presents no client certificate: the probes can only see the port listening.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["tcpSocket"] == {"port": "http"} and "httpGet" not in c[probe]
    env = {e["name"]: e.get("value") for e in test_pod["spec"]["containers"][0]["env"]}
    assert env["CLIENT_CERT"] == "1"  # helm test presents the Secret's own certificate


def test_prometheus_scrapes_the_router_over_https():
    for clients, with_cert in (("none", False), ("required", True)):
        docs = rendered(**{"router.tls.secretName": "router-cert", "router.tls.clientCertificates": clients,
                           "metrics.serviceMonitor.enabled": True})
        [monitor] = by_kind(docs, "ServiceMonitor").values()
        http = next(e for e in monitor["spec"]["endpoints"] if e["port"] == "http")
        assert http["scheme"] == "https" and http["tlsConfig"]["insecureSkipVerify"] is True
        assert ("cert" in http["tlsConfig"]) is with_cert
        if with_cert:
            assert http["tlsConfig"]["keySecret"] == {"name": "router-cert", "key": "tls.key"}
        annotations = by_kind(docs, "Deployment")["pd-pdserve-router"]["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scheme"] == "https"
    [monitor] = by_kind(rendered(**{"metrics.serviceMonitor.enabled": True}), "ServiceMonitor").values()
    assert all("scheme" not in e for e in monitor["spec"]["endpoints"])


def test_client_certificates_need_the_secret():
    from chart_tools import template

    result = template("3", None, {"router.tls.clientCertificates": "required"}, check=False)
    assert result.returncode != 0 and "router.tls.secretName" in result.stderr
    result = template("3", None, {"router.tls.clientCertificates": "sometimes"}, check=False)
    assert result.returncode != 0 and "clientCertificates" in result.stderr
