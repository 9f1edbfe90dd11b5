"""`pdserve bench` against a real local stack agrees with the services' own Prometheus counters."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from bench.serve import run_benchmark
from bench.workloads import synthetic

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/tests/services")
from service_procs import Service, free_port, metric, poll_until, wait_http_ok  # noqa: E402


@pytest.mark.e2e
def test_bench_counts_match_service_metrics(tiny_model_factory):
    model = tiny_model_factory("llama", max_position_embeddings=512)
    prefill = Service("prefill", model, "--kv-transport", "tcp")
    decode = Service("decode", model, "--kv-transport", "tcp")
    router = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        port = free_port()
        router = subprocess.Popen([sys.executable, "-m", "services.cli", "router", "--model", model,
                                   "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "-1",
                                   "--prefill", prefill.address, "--decode", decode.address])
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/health", router)
        before = metric(decode.metrics_port, "pdserve:generation_tokens_total")
        requests = synthetic(10, "uniform:8:60", "uniform:2:12", vocab_size=500, seed=5)
        summary = asyncio.run(run_benchmark(url, None, requests, rate=20.0, progress=False))
        assert summary["completed"] == 10 and summary["failed"] == 0
        assert summary["total_output_tokens"] == sum(r.output_len for r in requests)
        assert summary["mean_ttft_ms"] > 0 and summary["request_throughput"] > 0
        poll_until(lambda: metric(decode.metrics_port, "pdserve:request_success_total") >= 10, 5)
        assert metric(decode.metrics_port, "pdserve:request_success_total") == 10
        generated = metric(decode.metrics_port, "pdserve:generation_tokens_total") - before
        assert generated == summary["total_output_tokens"]
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        prefill.stop()
        decode.stop()
