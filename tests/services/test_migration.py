"""End to end: a decode process killed with SIGKILL (or its engine core killed) while it streams a
greedy completion; the router migrates the request to another decode (prompt + the tokens sent,
prefilled again) and the client's answer, streamed or not, is the undisturbed one, token for token,
penalties on the output and seeded sampling included."""
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
    """Its own stack: each test kills one of its six decodes."""
    with Stack(e2e_model, StackSpec(prefills=1, decodes=6)) as s:
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


def engine_core_of(decode) -> int:
    (pid,) = [p for p in children_of(decode.proc.pid)  # not multiprocessing's resource tracker
              if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
    return pid


class Decodes:
    """Freezes every live decode's engine core (SIGSTOP) the moment the request is known to be
    under way, so that a tiny model (~1 ms a token) cannot finish it before the kill lands; then
    finds the decode the router sent it to, kills it (or its engine core) and thaws the rest."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.decodes = stack.live(stack.decodes)
        self.cores = {d: engine_core_of(d) for d in self.decodes}
        self.routed = self.routing_decisions()

    def routing_decisions(self) -> dict:
        return {d: self.stack.router.metric("pdserve:router_routing_decisions_total",
                                            {"role": "decode", "instance": d.address})
                for d in self.decodes}

    def freeze(self) -> None:
        for pid in self.cores.values():
            os.kill(pid, signal.SIGSTOP)

    def kill_the_serving_one(self, core: bool = False) -> None:
        now = self.routing_decisions()
        (decode,) = [d for d in self.decodes if now[d] > self.routed[d]]
        for d, pid in self.cores.items():
            if d is not decode:
                os.kill(pid, signal.SIGCONT)
        self.stack.killed.append(decode)  # a killed core fails its requests with UNAVAILABLE, exits non-zero
        if core:
            os.kill(self.cores[decode], signal.SIGKILL)
            return
        decode.kill()
        os.kill(self.cores[decode], signal.SIGCONT)  # an orphan that notices its host is gone


@pytest.mark.parametrize("core", [False, True], ids=["decode_process", "engine_core"])
def test_a_streamed_completion_survives_its_decode_killed(stack, body, undisturbed, core):
    before = stack.router.metric(*MIGRATED)
    decodes = Decodes(stack)
    conn = http.client.HTTPConnection("127.0.0.1", stack.router.port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events, frozen = [], False
        while (line := resp.readline()) and line.strip() != b"data: [DONE]":
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
                if sum(bool(e["choices"][0]["text"]) for e in events) == 2 and not frozen:
                    frozen = True  # tokens have reached the client: the decode streams
                    decodes.freeze()
                    decodes.kill_the_serving_one(core)
    finally:
        conn.close()
    assert not [e for e in events if "error" in e], events[-1]
    assert "".join(e["choices"][0]["text"] for e in events) == undisturbed["choices"][0]["text"]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]] == ["length"]
    assert stack.router.metric(*MIGRATED) == before + 1
    stack.wait_idle(timeout=30)  # nothing pinned on the prefill, nothing running on the survivors


def test_a_completion_survives_its_decode_killed(stack, body, undisturbed):
    completed_after_a_kill(stack, body, undisturbed)


def test_output_penalties_count_the_tokens_sent_before_the_kill(stack, body):
    """Frequency and presence penalties read the output so far: the decode that
    takes over gets the earlier output as the prompt's tail and must count it as output."""
    penalised = {**body, "frequency_penalty": 1.0, "presence_penalty": 0.5}
    status, undisturbed = stack.post("/v1/completions", penalised)
    assert status == 200, undisturbed
    completed_after_a_kill(stack, penalised, undisturbed)


def test_a_seeded_random_completion_goes_on_with_its_random_stream(stack, body):
    """The decode that takes over skips the seed's draws the earlier tokens used: a seeded,
    sampled answer is the undisturbed one too."""
    seeded = {**body, "temperature": 0.9, "top_k": 40, "seed": 11}
    status, undisturbed = stack.post("/v1/completions", seeded)
    assert status == 200, undisturbed
    completed_after_a_kill(stack, seeded, undisturbed)


def completed_after_a_kill(stack, body: dict, undisturbed: dict) -> None:
    before = stack.router.metric(*MIGRATED)
    tokens = stack.router.metric("pdserve:router_generation_tokens_total")
    decodes = Decodes(stack)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(stack.post, "/v1/completions", body, 120)
        # The first token comes with the prefill's answer; a second one means the decode streams.
        assert poll_until(lambda: stack.router.metric("pdserve:router_generation_tokens_total") >= tokens + 2, 30,
                          interval=0.005)
        decodes.freeze()
        decodes.kill_the_serving_one()
        status, out = future.result(120)
    assert status == 200, out
    assert undated(out) == undated(undisturbed)  # text, finish reason and usage
    assert stack.router.metric(*MIGRATED) == before + 1
    stack.wait_idle(timeout=30)


def undated(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}
