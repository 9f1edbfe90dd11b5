"""Faults: failed or killed prefill instances are retried elsewhere; clients that leave abort upstream."""
from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import signal

import grpc
import pytest

from router_harness import wait_until
from router_fakes import client_ids, fake_process, toy_generate


def completions(stack, n: int, **body):
    """n concurrent non-streamed completions -> [(status, body)]."""
    body = {"prompt": "Hello world", "max_tokens": 4, **body}
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(stack.post, "/v1/completions", body) for _ in range(n)]
        return [(f.result()[0], f.result()[2]) for f in futures]


def test_failing_prefill_is_retried_on_another(make_stack, tokenizer):
    stack = make_stack(prefill=2, decode=1, prefill_kwargs=[
        {"fail": grpc.StatusCode.UNAVAILABLE, "fail_times": -1}, {}])
    results = completions(stack, 6)
    expected = tokenizer.decode(toy_generate(tokenizer.encode("Hello world"), 4)[0])
    assert all(status == 200 and body["choices"][0]["text"] == expected for status, body in results), results
    retried = stack.metric("pdserve:router_upstream_retries_total",
                           {"role": "prefill", "instance": stack.prefills[0].address, "code": "UNAVAILABLE"})
    assert retried >= 1
    assert len(stack.prefills[1].engine.requests) == 6


def test_prefill_killed_with_requests_in_flight(make_stack):
    stack = make_stack(prefill=2, decode=1)
    doomed = stack.prefills[0]
    doomed.engine.gate = asyncio.Event()  # its prefills hang until it dies
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stack.post, "/v1/completions", {"prompt": f"p {i}", "max_tokens": 3})
                   for i in range(6)]
        wait_until(lambda: len(doomed.engine.running) >= 2, what="requests in flight on the doomed prefill")
        stack.lt.run(doomed.stop(0))
        results = [f.result() for f in futures]
    assert all(status == 200 for status, _, _ in results), results
    assert stack.metric("pdserve:router_upstream_retries_total",
                        {"role": "prefill", "instance": doomed.address, "code": "UNAVAILABLE"}) >= 2
    wait_until(lambda: not stack.router.pool.instances("prefill")[0].healthy, what="the dead prefill unhealthy")
    assert all(status == 200 for status, _ in completions(stack, 3))


def test_prefill_process_sigkilled_mid_request(make_stack):
    """A real process dies (SIGKILL, no goodbye): its in-flight prefills succeed on the other one."""
    with fake_process("prefill", "--prefill-delay", "30") as (proc, victim):
        stack = make_stack(prefill=1, decode=1, extra_prefill=(victim,))
        routed = {"role": "prefill", "instance": victim}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stack.post, "/v1/completions", {"prompt": f"q {i}", "max_tokens": 3})
                       for i in range(4)]
            wait_until(lambda: stack.metric("pdserve:router_routing_decisions_total", routed) >= 2,
                       what="requests routed to the victim")
            proc.send_signal(signal.SIGKILL)
            results = [f.result() for f in futures]
        assert all(status == 200 for status, _, _ in results), results
        assert stack.metric("pdserve:router_upstream_retries_total", {**routed, "code": "UNAVAILABLE"}) >= 2


def open_stream(stack, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json", "X-Request-Id": "leaver"})
    return conn, conn.getresponse()


def test_client_disconnect_mid_stream_aborts_decode(make_stack):
    stack = make_stack(prefill=1, decode=1, decode_kwargs=[{"token_delay": 0.02}])
    conn, resp = open_stream(stack, "/v1/completions", {"prompt": "Hello", "max_tokens": 500, "ignore_eos": True})
    assert resp.status == 200
    events = 0
    while events < 3:
        events += resp.readline().startswith(b"data: ")
    conn.sock.close()
    conn.close()
    decode = stack.decodes[0].engine
    wait_until(lambda: "leaver" in client_ids(decode.cancelled), what="the decode stream cancelled")
    wait_until(lambda: stack.metric("pdserve:router_client_aborts_total") == 1, what="the abort counted")
    assert client_ids(decode.pulled) == ["leaver"] and not stack.router.dispatcher._background
    assert stack.metric("pdserve:router_requests_running") == 0


def test_client_disconnect_during_prefill_aborts_prefill(make_stack):
    stack = make_stack(prefill=1, decode=1)
    prefill = stack.prefills[0].engine
    prefill.gate = asyncio.Event()
    for stream in (True, False):
        conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi", "max_tokens": 5, "stream": stream}),
                     headers={"Content-Type": "application/json", "X-Request-Id": f"gone-{stream}"})
        wait_until(lambda: f"gone-{stream}" in client_ids(prefill.running), what="the prefill running")
        conn.close()
        wait_until(lambda: f"gone-{stream}" in client_ids(prefill.aborts)
                   and f"gone-{stream}" in client_ids(prefill.cancelled),
                   what="the prefill cancelled and aborted")
    assert not stack.decodes[0].engine.requests  # decode never heard of them
    assert stack.metric("pdserve:router_client_aborts_total") == 2
    assert stack.prefills[0].calls.count("/pdserve.v1.Engine/Abort") == 2  # the role-free service
    assert stack.router.pool.instances("prefill")[0].prefilling == {}  # nothing counted as computing there


def test_the_router_counts_the_prompts_it_has_computing_at_each_prefill_in_the_order_sent(make_stack, tokenizer):
    stack = make_stack(prefill=1, decode=1)
    prefill = stack.prefills[0].engine
    prefill.gate = asyncio.Event()
    router_side = stack.router.pool.instances("prefill")[0]
    prompts = {"first": "Hello world", "second": "Hello world, and a longer prompt than the first"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = []
        for rid, prompt in prompts.items():
            futures.append(pool.submit(stack.post, "/v1/completions", {"prompt": prompt, "max_tokens": 3},
                                       {"X-Request-Id": rid}))
            wait_until(lambda: rid in client_ids(prefill.running), what=f"{rid}'s prefill running")
        # Prompt tokens plus the one token a prefill generates (the load the engine reports).
        assert (client_ids(router_side.prefilling), list(router_side.prefilling.values())) == (
            list(prompts), [len(tokenizer.encode(p)) + 1 for p in prompts.values()])
        stack.lt.loop.call_soon_threadsafe(prefill.gate.set)
        assert all(f.result()[0] == 200 for f in futures)
    assert router_side.prefilling == {}


def test_stop_string_cancels_the_decode_stream(make_stack, tokenizer):
    stack = make_stack(prefill=1, decode=1, decode_kwargs=[{"token_delay": 0.01}])
    ids = tokenizer.encode("Hello")
    full = tokenizer.decode(toy_generate(ids, 8)[0])
    status, _, body = stack.post("/v1/completions", {"prompt": ids, "max_tokens": 400, "stop": full[4:7]},
                                 {"X-Request-Id": "stopper"})
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
    wait_until(lambda: "stopper" in client_ids(stack.decodes[0].engine.cancelled), what="the decode stream cancelled")


def test_slow_prefill_times_out_and_is_retried(make_stack):
    stack = make_stack(prefill=2, decode=1, prefill_timeout_s=0.3)
    slow = stack.prefills[0]
    slow.engine.gate = asyncio.Event()
    results = completions(stack, 4)
    assert all(status == 200 for status, _ in results), results
    assert stack.metric("pdserve:router_upstream_retries_total",
                        {"role": "prefill", "instance": slow.address, "code": "DEADLINE_EXCEEDED"}) >= 1
    wait_until(lambda: len(slow.engine.aborts) >= 1, what="the timed-out prefill aborted")
    assert all(inst.prefilling == {} for inst in stack.router.pool.instances("prefill"))


def test_request_timeout_is_504(make_stack):
    stack = make_stack(prefill=1, decode=1, request_timeout_s=0.5, decode_kwargs=[{"token_delay": 0.05}])
    status, _, body = stack.post("/v1/completions", {"prompt": "Hi", "max_tokens": 100}, {"X-Request-Id": "slow"})
    assert status == 504 and body["error"]["code"] == "timeout"  # mid-decode
    wait_until(lambda: "slow" in client_ids(stack.decodes[0].engine.cancelled), what="the decode cancelled")
    stack.prefills[0].engine.gate = asyncio.Event()
    status, _, body = stack.post("/v1/completions", {"prompt": "Hi"})
    assert status == 504 and body["error"]["code"] == "timeout"  # mid-prefill


def test_decode_failing_before_its_first_token_is_retried(make_stack):
    stack = make_stack(prefill=1, decode=2, decode_kwargs=[
        {"fail": grpc.StatusCode.UNAVAILABLE, "fail_times": -1}, {}])
    results = completions(stack, 4, max_tokens=5)
    assert all(status == 200 and body["usage"]["completion_tokens"] == 5 for status, body in results), results
    assert stack.metric("pdserve:router_upstream_retries_total",
                        {"role": "decode", "instance": stack.decodes[0].address, "code": "UNAVAILABLE"}) >= 1


def test_every_prefill_failing_is_503(make_stack):
    stack = make_stack(prefill=2, decode=1, prefill_kwargs=[
        {"fail": grpc.StatusCode.INTERNAL, "fail_times": -1}] * 2)
    status, _, body = stack.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert status == 503 and "prefill failed on 2 instance(s)" in body["error"]["message"], body
    status, _, body = stack.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True})
    assert status == 503  # streaming too: the status comes before any event


def test_engine_invalid_argument_is_400_not_retried(make_stack):
    stack = make_stack(prefill=2, decode=1, prefill_kwargs=[
        {"fail": grpc.StatusCode.INVALID_ARGUMENT, "fail_times": -1}] * 2)
    status, _, body = stack.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert status == 400 and "told to fail" in body["error"]["message"]
    assert sum(len(p.engine.requests) for p in stack.prefills) == 1


def test_a_reused_request_id_keeps_requests_apart(make_stack):
    """Two clients send the same X-Request-Id: the engines see two keys, each client gets its own
    stream and its id echoed, and one client leaving aborts its request only."""
    stack = make_stack(prefill=1, decode=1, decode_kwargs=[{"token_delay": 0.02}])
    body = {"prompt": "Hello", "max_tokens": 60, "ignore_eos": True}
    # The leaver's stream is long (20 s), so it is still going when the router sees the client
    # gone, however slow the machine (at 60 tokens it could end first on a loaded one).
    conns = [open_stream(stack, "/v1/completions", {**body, "max_tokens": 1000}),
             open_stream(stack, "/v1/completions", body)]
    assert all(resp.status == 200 and resp.getheader("X-Request-Id") == "leaver" for _, resp in conns)
    (leaving, first), (staying, second) = conns
    while not first.readline().startswith(b"data: "):
        pass
    leaving.sock.close()
    leaving.close()
    text = second.read().decode()
    assert text.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in text
    decode = stack.decodes[0].engine
    wait_until(lambda: len(decode.cancelled) == 1, what="the leaving client's stream cancelled")
    keys = set(decode.pulled)
    assert len(keys) == 2 and client_ids(keys) == ["leaver", "leaver"]
    assert decode.cancelled[0] in keys


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_instance_at_capacity_is_429_with_retry_after(make_stack, role):
    full = {"fail": grpc.StatusCode.RESOURCE_EXHAUSTED, "fail_times": -1}
    stack = make_stack(prefill=2, decode=2, **{f"{role}_kwargs": [full, full]})
    message = f"every {role} instance tried (2) is at capacity"
    status, headers, body = stack.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert status == 429 and headers["Retry-After"] == "1", body
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "overloaded"
    assert message in body["error"]["message"]
    # Streamed too: the prefill's first token waits for a decode to take the request, so a
    # refusal by every decode is still the response's status, never a stream cut after a token.
    status, headers, body = stack.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True})
    assert status == 429 and headers["Retry-After"] == "1" and message in body["error"]["message"], body


def test_a_pool_full_where_it_is_not_down_is_429(make_stack):
    """One decode at capacity and the other failing: the client should come back later (429),
    not read a 502 about one of the instances."""
    stack = make_stack(prefill=1, decode=2, decode_kwargs=[
        {"fail": grpc.StatusCode.RESOURCE_EXHAUSTED, "fail_times": -1},
        {"fail": grpc.StatusCode.UNAVAILABLE, "fail_times": -1}])
    for stream in (False, True):
        status, headers, body = stack.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": stream})
        assert status == 429 and headers["Retry-After"] == "1", body
        assert body["error"]["code"] == "overloaded"


def test_an_instance_at_capacity_sends_the_request_elsewhere(make_stack):
    stack = make_stack(prefill=2, decode=1, prefill_kwargs=[
        {"fail": grpc.StatusCode.RESOURCE_EXHAUSTED, "fail_times": -1}, {}])
    results = completions(stack, 4, max_tokens=3)
    assert all(status == 200 for status, _ in results), results
    assert stack.metric("pdserve:router_upstream_retries_total", {
        "role": "prefill", "instance": stack.prefills[0].address, "code": "RESOURCE_EXHAUSTED"}) >= 1
