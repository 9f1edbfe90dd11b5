"""The router's Prometheus metrics (prefix `pdserve:`), in a registry of its own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Bucket edges as vLLM's, so dashboards carry over.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class RouterMetrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "pdserve:router_requests", "Requests answered by the router, by endpoint and status code.",
            ["endpoint", "status_code"], registry=r)
        self.upstream_retries = Counter(
            "pdserve:router_upstream_retries", "Upstream calls retried on another instance.",
            ["role", "instance", "code"], registry=r)
        self.routing_decisions = Counter(
            "pdserve:router_routing_decisions", "Requests sent to each instance.",
            ["role", "instance"], registry=r)
        self.requests_shed = Counter(
            "pdserve:router_requests_shed", "Requests refused with 429 (code: router_at_capacity, the "
            "router's own cap; overloaded, every engine tried at capacity).", ["code"], registry=r)
        self.client_aborts = Counter(
            "pdserve:router_client_aborts", "Requests the client abandoned (disconnect, cancel).",
            registry=r)
        self.migrations = Counter(
            "pdserve:router_migrations", "Decode streams lost mid-request, by what became of them: "
            "completed / failed / lost_again / closed (on another decode after a migration) or "
            "limit_reached (not migrated: --migration-limit).", ["outcome"], registry=r)
        self.prompt_tokens = Counter(
            "pdserve:router_prompt_tokens", "Prompt tokens routed.", registry=r)
        self.generation_tokens = Counter(
            "pdserve:router_generation_tokens", "Tokens generated and returned.", registry=r)
        self.requests_running = Gauge(
            "pdserve:router_requests_running", "Requests in flight through the router.", registry=r)
        self.instance_healthy = Gauge(
            "pdserve:router_instance_healthy", "1 when the instance's health check says SERVING.",
            ["role", "instance"], registry=r)
        self.incompatible_pairs = Gauge(
            "pdserve:router_incompatible_pairs", "Prefill x decode pairs that cannot move KV between "
            "them (another model, KV layout, transport or sharding): never chosen; /readyz says why.",
            registry=r)
        self.ttft = Histogram(
            "pdserve:router_time_to_first_token_seconds", "Time to first token, as the router sees it.",
            buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(
            "pdserve:router_inter_token_latency_seconds", "Time between tokens, as the router sees it.",
            buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(
            "pdserve:router_e2e_request_latency_seconds", "Request latency, arrival to last token.",
            buckets=E2E_BUCKETS, registry=r)
        self.pd_decisions = Counter(
            "pdserve:router_pd_decisions", "Conditional disaggregation: where each prompt was computed "
            "(prefill_remote | decode_local), and why.", ["decision", "reason"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
