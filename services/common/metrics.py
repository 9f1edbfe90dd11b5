"""Prometheus metrics of an engine service, named as vLLM users know them (prefix pdserve:)."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)

# engine stats key -> (metric name, help); counters are cumulative in the engine core.
_GAUGES = {
    "num_running": ("pdserve:num_requests_running", "Requests in the running batch."),
    "num_waiting": ("pdserve:num_requests_waiting", "Requests waiting (incl. for remote KV)."),
    "kv_cache_usage": ("pdserve:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)."),
    "num_pinned_blocks": ("pdserve:kv_pinned_blocks", "Prefill: KV blocks pinned for decode pulls."),
    "outstanding_tokens": ("pdserve:outstanding_tokens", "Tokens still to compute or generate."),
    "cuda_graphs_captured": ("pdserve:cuda_graphs_captured", "Decode batch sizes with a captured CUDA graph."),
    "lora_adapters_on_device": ("pdserve:lora_adapters_on_device",
                                "LoRA adapters in device memory (at most --max-loras when given)."),
    "lora_adapters_in_host_memory": ("pdserve:lora_adapters_in_host_memory",
                                     "LoRA adapters in host memory (--max-loras; at most --max-cpu-loras when given)."),
    "spec_decode_acceptance_rate": ("pdserve:spec_decode_acceptance_rate",
                                    "Speculative decoding: accepted / proposed tokens since start (0-1)."),
    "spec_decode_mean_accepted_length": ("pdserve:spec_decode_mean_accepted_length",
                                         "Speculative decoding: tokens per verifying row and step "
                                         "(accepted proposals + 1) since start."),
}
_COUNTERS = {
    "prefix_cache_queries": ("pdserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("pdserve:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "num_preemptions": ("pdserve:num_preemptions", "Requests preempted (recomputed later)."),
    "num_requests_shed": ("pdserve:requests_shed", "Requests refused at capacity (RESOURCE_EXHAUSTED)."),
    "kv_published": ("pdserve:kv_published_requests", "Prefill: requests whose KV was published."),
    "kv_pulls_finished": ("pdserve:kv_transfers", "Decode: KV pulls completed."),
    "kv_pull_failures": ("pdserve:kv_transfer_failures", "Decode: KV pulls that failed."),
    "kv_recomputed_fallbacks": ("pdserve:kv_recomputed_fallbacks",
                                "Decode: prompts recomputed locally because KV could not be pulled."),
    "kv_pulls_started": ("pdserve:kv_transfers_started", "Decode: KV pulls started."),
    "kv_released_unpulled": ("pdserve:kv_released_unpulled",
                             "Decode: remote KV given back unread (every block was cached here)."),
    "kv_lease_extensions": ("pdserve:kv_lease_extensions",
                            "Decode: remote leases extended while a request waited for room."),
    "kv_publish_failures": ("pdserve:kv_publish_failures", "Prefill: requests whose KV could not be published."),
    "connector_bytes_received": ("pdserve:kv_transfer_bytes", "Decode: KV bytes pulled."),
    "connector_bytes_sent": ("pdserve:kv_transfer_bytes_sent", "Prefill: KV bytes served."),
    "connector_expired": ("pdserve:kv_expired_leases", "Prefill: leases that expired unpulled."),
    "connector_aborted": ("pdserve:kv_aborted_leases", "Prefill: leases aborted."),
    "kv_events_published": ("pdserve:kv_event_batches_published", "KV event batches sent on the PUB socket."),
    "decode_buffer_steps": ("pdserve:decode_buffer_steps",
                            "Decode-only steps run through the padded persistent buffers."),
    "cuda_graph_replays": ("pdserve:cuda_graph_replays", "Decode steps run by replaying a CUDA graph."),
    "num_async_steps": ("pdserve:async_scheduled_steps",
                        "Steps queued behind the one in flight (--async-scheduling)."),
    "spec_decode_num_drafts": ("pdserve:spec_decode_num_drafts",
                               "Speculative decoding: rows that verified proposals (one per row and step)."),
    "spec_decode_num_draft_tokens": ("pdserve:spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed."),
    "spec_decode_num_accepted_tokens": ("pdserve:spec_decode_num_accepted_tokens",
                                        "Speculative decoding: proposed tokens accepted."),
    "lora_swaps": ("pdserve:lora_swaps",
                   "LoRA adapters brought from host memory to a device slot for a step (--max-loras)."),
    "lora_reloads": ("pdserve:lora_reloads",
                     "LoRA adapters read back from their files, their host copy evicted by --max-cpu-loras."),
    "kv_events_dropped": ("pdserve:kv_events_dropped",
                          "KV events dropped because the publisher's queue was full (subscribers see a gap)."),
}

_PER_POS = "spec_decode_num_accepted_tokens_per_pos_"



def observe_per_token(histogram, seconds: float, tokens: int) -> None:
    """An inter-token latency histogram, fed a streamed update's gap spread over the tokens it
    carries (a --stream-interval, or a consumer that fell behind, sends several at once): it then
    counts tokens at the pace the engine made them, which the planner's latency feedback reads."""
    gap = seconds / max(1, tokens)
    for _ in range(max(1, tokens)):
        histogram.observe(gap)

class EngineStatsCollector:
    """Reads the engine core's counters at scrape time (no bookkeeping on the hot path)."""

    def __init__(self, stats: Callable[[], dict], labels: dict[str, str]) -> None:
        self.stats = stats
        self.labels = labels

    def collect(self):
        stats = self.stats()
        names, values = list(self.labels), list(self.labels.values())
        for key, (name, doc) in _GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, float(stats.get(key, 0)))
            yield g
        for key, (name, doc) in _COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, float(stats.get(key, 0)))
            yield c
        per_pos = CounterMetricFamily("pdserve:spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative decoding: proposals accepted at each position.",
                                      labels=[*names, "position"])
        for key, value in stats.items():
            if key.startswith(_PER_POS):
                per_pos.add_metric([*values, key[len(_PER_POS):]], float(value))
        yield per_pos
        s = SummaryMetricFamily("pdserve:kv_transfer_time_seconds", "Decode: time from pull start to KV in place.",
                                labels=names)
        s.add_metric(values, count_value=stats.get("kv_transfers_timed", 0),
                     sum_value=stats.get("kv_transfer_seconds_total", 0.0))
        yield s


class ServiceMetrics:
    """Request-level metrics observed in the service front end, plus the engine's own."""

    def __init__(self, stats: Callable[[], dict], model_name: str, role: str, engine_id: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "role": role, "engine_id": engine_id}
        self.registry.register(EngineStatsCollector(stats, labels))
        names = list(labels)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, names, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(**labels)

        from prometheus_client import Counter
        self.ttft = hist("pdserve:time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("pdserve:inter_token_latency_seconds", "Time between streamed tokens.")
        self.e2e = hist("pdserve:e2e_request_latency_seconds", "Request latency, arrival to finish.")
        self.queue = hist("pdserve:request_queue_time_seconds", "Time waiting before first scheduled.")
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens processed.", names,
                                     registry=self.registry).labels(**labels)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Tokens generated.", names,
                                         registry=self.registry).labels(**labels)
        self.requests = Counter("pdserve:request_success", "Finished requests by finish reason.",
                                [*names, "finished_reason"], registry=self.registry)
        self.labels = labels

    def finished(self, reason: str) -> None:
        self.requests.labels(**self.labels, finished_reason=reason or "unknown").inc()

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)
