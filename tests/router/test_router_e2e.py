"""End to end: real `pdserve prefill`/`decode` processes (KV over tcp) behind the router.

Greedy completions through the HTTP gateway and gRPC Generate must equal the offline engine's,
token for token; a prefill process killed mid-request is retried on the other; a client that
leaves frees the request on both sides.
"""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import openai
import pytest

from engine import LLM, SamplingParams
from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc
from services.router.instances import Instance

from router_harness import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["The quick brown fox", "Once upon a time in a small village by the sea",
           "red blue yellow green " * 12, "A"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
MAX_TOKENS = 12


class EngineProcess:
    """One engine service in its own process group (its engine core dies with it), watched through
    the router's own Instance (health checks, GetLoad) on the test loop."""

    def __init__(self, role: str, model: str, lt) -> None:
        self.role, self.lt = role, lt
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", role, "--model", model, "--host", "127.0.0.1",
             "--port", str(self.port), "--metrics-port", "0", "--kv-transport", "tcp", "--num-blocks", "512",
             "--engine-id", f"{role}-{self.port}"],
            cwd=ROOT, env={**os.environ, "PDSERVE_KV_SECRET": "e2e-secret"}, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.instance = lt.run(self._instance())

    async def _instance(self) -> Instance:
        return Instance(self.address, role=self.role)

    def serving(self) -> bool:
        return self.lt.run(self.instance.check_health(timeout=1.0))[0]

    def load(self) -> pb.LoadReport:
        return self.lt.run(self.instance.get_load(timeout=5.0))

    def signal(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)
        self.proc.wait(10)
        self.lt.run(self.instance.channel.close())


@pytest.fixture(scope="module")
def engines(tiny_model_path, loop_thread):
    procs = [EngineProcess(role, tiny_model_path, loop_thread) for role in ("prefill", "prefill", "decode")]
    try:
        deadline = time.monotonic() + 300
        for p in procs:
            while not p.serving():
                assert p.proc.poll() is None, f"{p.role} exited with {p.proc.returncode}"
                assert time.monotonic() < deadline, f"{p.role} not SERVING in time"
                time.sleep(0.2)
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_path, tokenizer):
    """The offline engine's greedy answers: {prompt token ids (tuple): CompletionOutput}."""
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [chat_ids]
    outs = LLM(tiny_model_path).generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return {tuple(ids): out.outputs[0] for ids, out in zip(prompts, outs)}, chat_ids


@pytest.fixture
def stack(make_stack, engines):
    """The router (in this process, for its metrics) in front of the real engines."""
    prefill = tuple(p.address for p in engines if p.role == "prefill" and p.proc.poll() is None)
    decode = tuple(p.address for p in engines if p.role == "decode")
    stack = make_stack(prefill=0, decode=0, extra_prefill=prefill, extra_decode=decode)
    stack.engines = engines
    return stack


def test_greedy_completions_are_token_exact(stack, reference, tokenizer):
    expected, _ = reference
    client = openai.OpenAI(base_url=stack.url, api_key="x", max_retries=0, timeout=60)
    for prompt in PROMPTS:
        ref = expected[tuple(tokenizer.encode(prompt))]
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == ref.text
        assert out.usage.completion_tokens == len(ref.token_ids)
        assert out.choices[0].finish_reason == ref.finish_reason
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks) == ref.text
    # Several prompts in one request run concurrently and come back in order.
    out = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in out.choices] == [expected[tuple(tokenizer.encode(p))].text for p in PROMPTS]


def test_grpc_generate_is_token_exact(stack, reference, tokenizer):
    expected, _ = reference
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = pb_grpc.GenerateStub(channel)
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            chunks = list(stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=ids),
                sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, skip_special_tokens=True)), timeout=60))
            assert [t for c in chunks for t in c.token_ids] == expected[tuple(ids)].token_ids


def test_chat_is_token_exact(stack, reference):
    expected, chat_ids = reference
    client = openai.OpenAI(base_url=stack.url, api_key="x", max_retries=0, timeout=60)
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].message.content == expected[tuple(chat_ids)].text
    assert out.usage.prompt_tokens == len(chat_ids)


def test_echo_prompt_logprobs_match_the_engine(stack, tiny_model_path, tokenizer):
    prompt = PROMPTS[1]
    ids = tokenizer.encode(prompt)
    status, _, body = stack.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1,
                                                     "temperature": 0})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids) + 1
    ref = LLM(tiny_model_path).generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    want = [entry[t] for t, entry in zip(ids[1:], ref.prompt_logprobs)]
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)


def test_client_disconnect_frees_both_sides(stack):
    prefill = [p for p in stack.engines if p.role == "prefill"]
    decode = next(p for p in stack.engines if p.role == "decode")
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=60)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
        {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 3:
        events += resp.readline().startswith(b"data: ")
    # The engines' counters are snapshots the engine core publishes: poll them.
    wait_until(lambda: decode.load().num_running == 1, timeout=30, what="the stream running on decode")
    conn.sock.close()
    conn.close()
    wait_until(lambda: decode.load().num_running == 0, timeout=30, what="the decode engine aborted the request")
    wait_until(lambda: all(p.load().num_pinned_blocks == 0 for p in prefill if p.proc.poll() is None),
               timeout=30, what="no KV left pinned on the prefill side")


def test_killed_prefill_process_requests_retried(stack, reference, tokenizer):
    """Runs last in this module: it kills one prefill process."""
    expected, _ = reference
    victim = next(p for p in stack.engines if p.role == "prefill")
    victim.signal(signal.SIGSTOP)  # frozen: what is sent to it now stays in flight
    prompt = PROMPTS[0]
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stack.post, "/v1/completions", body) for _ in range(4)]
        wait_until(lambda: stack.metric("pdserve:router_routing_decisions_total",
                                        {"role": "prefill", "instance": victim.address}) >= 2,
                   what="requests sent to the frozen prefill")
        victim.signal(signal.SIGKILL)
        results = [f.result(60) for f in futures]
    want = expected[tuple(tokenizer.encode(prompt))].text
    assert all(status == 200 and b["choices"][0]["text"] == want for status, _, b in results), results
    assert stack.metric("pdserve:router_upstream_retries_total",
                        {"role": "prefill", "instance": victim.address, "code": "UNAVAILABLE"}) >= 2
