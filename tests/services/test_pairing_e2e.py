"""Pre-flight pair validation with real processes: a decode whose KV block size differs from the
prefill's is refused at the router's first GetLoad and never receives a request."""
from __future__ import annotations

import concurrent.futures
import http.client
import json

from service_procs import Service, poll_until
from stack import NUM_BLOCKS, RouterProcess


def _complete(port: int, prompt: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": 6, "temperature": 0}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_decode_of_another_block_size_is_never_paired(e2e_model):
    kv = ("--kv-transport", "tcp", "--num-blocks", NUM_BLOCKS)
    prefill = Service("prefill", e2e_model, *kv, "--block-size", "16")
    good = Service("decode", e2e_model, *kv, "--block-size", "16")
    odd = Service("decode", e2e_model, *kv, "--block-size", "32")
    engines = [prefill, good, odd]
    router = None
    try:
        for s in engines:
            s.wait_ready()
        descriptor = odd.load().pairing  # what the router's handshake reads
        assert (descriptor.kv_block_size, descriptor.kv_transport, descriptor.total_kv_heads,
                descriptor.tensor_parallel_size) == (32, "tcp", 2, 1)
        assert descriptor.model_fingerprint == prefill.load().pairing.model_fingerprint
        router = RouterProcess(e2e_model, [prefill.address], [good.address, odd.address])
        router.wait_ready(len(engines))
        assert poll_until(lambda: router.metric("pdserve:router_incompatible_pairs") == 1, 10)

        prompts = [f"Request number {i} asks" for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: _complete(router.port, p), prompts))
        assert all(status == 200 and body["usage"]["completion_tokens"] == 6 for status, body in results), results

        # The odd decode never saw a request (round robin would have sent it half); the good one
        # took every one, its KV pulled from the prefill.
        assert router.metric("pdserve:router_routing_decisions_total", {"role": "decode", "instance": odd.address}) == 0
        assert odd.metric("pdserve:request_success_total") == 0
        assert poll_until(lambda: good.metric("pdserve:request_success_total") == len(prompts), 10)
        # The engine core's counters reach /metrics with its next stats snapshot, a moment later.
        assert poll_until(lambda: good.metric("pdserve:kv_transfers_total") == len(prompts), 10), \
            good.metric("pdserve:kv_transfers_total")
        assert good.metric("pdserve:kv_recomputed_fallbacks_total") == 0
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=10)
        conn.request("GET", "/readyz")
        ready = json.loads(conn.getresponse().read())
        conn.close()
        assert ready["incompatible_pairs"] == [{"prefill": prefill.address, "decode": odd.address,
                                                "reason": "KV block size 16 vs 32"}]
        assert f"prefill {prefill.address} and decode {odd.address} cannot pair: KV block size 16 vs 32" \
            in router.output(200)
    finally:
        codes = {p.name: p.stop() for p in ([router] if router else []) + engines}
    assert all(code == 0 for code in codes.values()), codes
