"""End to end: a decode process killed with SIGKILL (or its engine core killed) while it streams a
greedy completion; the router migrates the request to another decode (prompt + the tokens sent,
prefilled again) and the client's answer, streamed or not, is the undisturbed one, token for token."""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal

import pytest

from service_procs import children_of, poll_until
from stack import SERVED_MODEL, Stack, StackSpec

pytestmark = pytest.mark.e2e

PROMPT = "The quick brown fox"
MIGRATED = ("pdserve:router_migrations_total", {"outcome": "completed"})


@pytest.fixture(scope="module")
def stack(e2e_model):
    """Its own stack: each test kills one of its four decodes."""
    with Stack(e2e_model, StackSpec(prefills=1, decodes=4)) as s:
        yield s


@pytest.fixture(scope="module")
def body(stack) -> dict:
    # As long as the context allows, so that the decode is killed well before the end.
    num_prompt = stack.post("/v1/completions", {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 1,
                                                "temperature": 0})[1]["usage"]["prompt_tokens"]
    return {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 511 - num_prompt, "temperature": 0,
            "ignore_eos": True}


@pytest.fixture(scope="module")
def undisturbed(stack, body) -> dict:
    status, out = stack.post("/v1/completions", body)
    assert status == 200, out
    return out


def kill_the_serving_decode(stack: Stack, core: bool = False) -> None:
    """SIGKILL to the decode that runs the request (or to its engine core process)."""
    def serving():
        running = [d for d in stack.live(stack.decodes) if d.load().num_running]
        return running[0] if running else None

    assert poll_until(lambda: serving() is not None, 30), "no decode runs the request"
    decode = serving()
    if not core:
        stack.kill(decode)
        return
    (pid,) = [p for p in children_of(decode.proc.pid)  # not multiprocessing's resource tracker
              if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
    stack.killed.append(decode)  # it fails its requests with UNAVAILABLE and exits non-zero
    os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("core", [False, True], ids=["decode_process", "engine_core"])
def test_a_streamed_completion_survives_its_decode_killed(stack, body, undisturbed, core):
    before = stack.router.metric(*MIGRATED)
    conn = http.client.HTTPConnection("127.0.0.1", stack.router.port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events = []
        while (line := resp.readline()) and line.strip() != b"data: [DONE]":
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 8:
                    kill_the_serving_decode(stack, core)
    finally:
        conn.close()
    assert not [e for e in events if "error" in e], events[-1]
    assert "".join(e["choices"][0]["text"] for e in events) == undisturbed["choices"][0]["text"]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]] == ["length"]
    assert stack.router.metric(*MIGRATED) == before + 1
    stack.wait_idle(timeout=30)  # nothing pinned on the prefill, nothing running on the survivors


def test_a_completion_survives_its_decode_killed(stack, body, undisturbed):
    before = stack.router.metric(*MIGRATED)
    tokens = stack.router.metric("pdserve:router_generation_tokens_total")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(stack.post, "/v1/completions", body, 120)
        assert poll_until(lambda: stack.router.metric("pdserve:router_generation_tokens_total") >= tokens + 8, 30)
        kill_the_serving_decode(stack)
        status, out = future.result(120)
    assert status == 200, out
    assert undated(out) == undated(undisturbed)  # text, finish reason and usage
    assert stack.router.metric(*MIGRATED) == before + 1
    stack.wait_idle(timeout=30)


def undated(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}
