"""Kubernetes for the planner: Deployment replica counts through the scale subresource, and
instance discovery (EndpointSlices of a Service, or DNS of a headless Service).

The discovery helpers are independent of the planner: the router's `--discovery` can use them.
"""
from __future__ import annotations

import logging
import socket

logger = logging.getLogger("pdserve.planner")


def api_client(kubeconfig: str | None = None, host: str | None = None):
    """In a pod: its service account. Else `kubeconfig` (or ~/.kube/config). `host` alone: an
    unauthenticated API server at that URL (tests, `kubectl proxy`)."""
    from kubernetes import client, config

    if host:
        configuration = client.Configuration()
        configuration.host = host
        return client.ApiClient(configuration)
    if kubeconfig is None:
        try:
            config.load_incluster_config()
            return client.ApiClient()
        except config.ConfigException:
            pass
    return config.new_client_from_config(config_file=kubeconfig)


def in_cluster_namespace(default: str = "default") -> str:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip() or default
    except OSError:
        return default


class DeploymentScaler:
    """Reads and sets `spec.replicas` of one Deployment per role, through `deployments/scale`
    (the subresource `kubectl scale` and the HorizontalPodAutoscaler use: RBAC can grant it alone)."""

    def __init__(self, api, namespace: str, deployments: dict[str, str]) -> None:
        from kubernetes import client

        self.apps = client.AppsV1Api(api)
        self.namespace, self.deployments = namespace, dict(deployments)

    def describe(self, role: str) -> str:
        return f"Deployment {self.namespace}/{self.deployments[role]}"

    def get_replicas(self, role: str) -> int:
        scale = self.apps.read_namespaced_deployment_scale(self.deployments[role], self.namespace)
        return int(scale.spec.replicas or 0)

    def set_replicas(self, role: str, replicas: int) -> None:
        self.apps.patch_namespaced_deployment_scale(self.deployments[role], self.namespace,
                                                    {"spec": {"replicas": int(replicas)}})


def _hostport(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def endpointslice_addresses(api, namespace: str, service: str, port_name: str) -> list[str]:
    """host:port of every ready endpoint of a Service (its EndpointSlices), on the named port.
    RBAC: list on discovery.k8s.io endpointslices."""
    from kubernetes import client

    label = "kubernetes.io/service-name"
    slices = client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(namespace, label_selector=f"{label}={service}")
    out: list[str] = []
    for s in slices.items:
        if (s.metadata.labels or {}).get(label) != service:
            continue  # the server filtered already; a proxy or an emulator may not have
        port = next((p.port for p in (s.ports or []) if p.name == port_name), None)
        if port is None:
            continue
        for ep in s.endpoints or []:
            if ep.conditions is not None and ep.conditions.ready is False:
                continue  # unset means ready, as the API defines it
            out += [_hostport(a, port) for a in ep.addresses if _hostport(a, port) not in out]
    return sorted(out)


def dns_addresses(name: str, port: int) -> list[str]:
    """host:port of every address a (headless Service's) DNS name resolves to: one per ready pod."""
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        logger.warning("cannot resolve %s: %s", name, e)
        return []
    return sorted({_hostport(info[4][0], port) for info in infos})
