"""End to end: real `pdserve router`, `prefill` and `decode` processes (KV over tcp).

Greedy completions through the HTTP gateway and gRPC Generate must equal the offline engine's,
token for token, each with one KV transfer; a prefill process killed mid-request is retried on the
other; a client that leaves frees the request on both sides.
"""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import signal

import grpc
import openai
import pytest

from engine import LLM, SamplingParams
from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc

from service_procs import poll_until
from stack import SERVED_MODEL, Stack, StackSpec

pytestmark = pytest.mark.e2e

PROMPTS = ["The quick brown fox", "Once upon a time in a small village by the sea",
           "red blue yellow green " * 12, "A"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def e2e_tokenizer(e2e_model):
    from engine.processor import load_tokenizer
    return load_tokenizer(e2e_model)


@pytest.fixture(scope="module")
def reference(e2e_model, e2e_tokenizer):
    """The offline engine's greedy answers: {prompt token ids (tuple): CompletionOutput}."""
    tokenizer = e2e_tokenizer
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [chat_ids]
    outs = LLM(e2e_model).generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return {tuple(ids): out.outputs[0] for ids, out in zip(prompts, outs)}, chat_ids


def disaggregated(outputs) -> int:
    """How many of these requests went on to a decode: all but those their first token ended."""
    return sum(len(o.token_ids) > 1 for o in outputs)


def test_greedy_completions_are_token_exact(tcp_stack, reference, e2e_tokenizer):
    expected, _ = reference
    refs = [expected[tuple(e2e_tokenizer.encode(p))] for p in PROMPTS]
    client = openai.OpenAI(base_url=f"{tcp_stack.url}/v1", api_key="x", max_retries=0, timeout=60)
    with tcp_stack.one_transfer_per_request(3 * disaggregated(refs)):
        for prompt, ref in zip(PROMPTS, refs):
            out = client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert out.choices[0].text == ref.text
            assert out.usage.completion_tokens == len(ref.token_ids)
            assert out.choices[0].finish_reason == ref.finish_reason
            chunks = list(client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                    temperature=0, stream=True))
            assert "".join(c.choices[0].text for c in chunks) == ref.text
        # Several prompts in one request run concurrently and come back in order.
        out = client.completions.create(model=SERVED_MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
        assert [c.text for c in out.choices] == [ref.text for ref in refs]


def test_grpc_generate_is_token_exact(tcp_stack, reference, e2e_tokenizer):
    expected, _ = reference
    refs = [expected[tuple(e2e_tokenizer.encode(p))] for p in PROMPTS]
    with tcp_stack.one_transfer_per_request(disaggregated(refs)), grpc.insecure_channel(tcp_stack.grpc_target) as ch:
        stub = pb_grpc.GenerateStub(ch)
        for prompt, ref in zip(PROMPTS, refs):
            chunks = list(stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=e2e_tokenizer.encode(prompt)),
                sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, skip_special_tokens=True)), timeout=60))
            assert [t for c in chunks for t in c.token_ids] == ref.token_ids


def test_chat_is_token_exact(tcp_stack, reference):
    expected, chat_ids = reference
    ref = expected[tuple(chat_ids)]
    client = openai.OpenAI(base_url=f"{tcp_stack.url}/v1", api_key="x", max_retries=0, timeout=60)
    with tcp_stack.one_transfer_per_request(disaggregated([ref])):
        out = client.chat.completions.create(model=SERVED_MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(chat_ids)


def test_echo_prompt_logprobs_match_the_engine(tcp_stack, e2e_model, e2e_tokenizer):
    prompt = PROMPTS[1]
    ids = e2e_tokenizer.encode(prompt)
    # One token: the prefill's first token ends the request, so nothing is published or pulled.
    with tcp_stack.one_transfer_per_request(0):
        status, body = tcp_stack.post("/v1/completions", {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1,
                                                          "echo": True, "logprobs": 1, "temperature": 0})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids) + 1
    ref = LLM(e2e_model).generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    want = [entry[t] for t, entry in zip(ids[1:], ref.prompt_logprobs)]
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)


def test_vllms_prompt_logprobs_match_the_engine(tcp_stack, e2e_model, e2e_tokenizer):
    """vLLM's prompt_logprobs through prefill and decode: each prompt token's logprob and rank,
    and the top-2, as the offline engine computes them."""
    ids = e2e_tokenizer.encode(PROMPTS[2])
    status, body = tcp_stack.post("/v1/completions", {"model": SERVED_MODEL, "prompt": ids, "max_tokens": 3,
                                                      "prompt_logprobs": 2, "temperature": 0})
    assert status == 200, body
    got = body["choices"][0]["prompt_logprobs"]
    ref = LLM(e2e_model).generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    assert got[0] is None and len(got) == len(ids)
    for token, entry, want, rank in zip(ids[1:], got[1:], ref.prompt_logprobs, ref.prompt_logprob_ranks):
        assert entry[str(token)]["rank"] == rank and entry[str(token)]["logprob"] == pytest.approx(want[token], abs=1e-4)
        assert entry[str(token)]["decoded_token"] == e2e_tokenizer.decode([token])
        assert set(entry) == {str(t) for t in want}  # the token's own entry and the top-2
    assert len({e[str(t)]["rank"] for t, e in zip(ids[1:], got[1:])}) > 2


def test_client_disconnect_frees_both_sides(tcp_stack):
    conn = http.client.HTTPConnection("127.0.0.1", tcp_stack.router.port, timeout=60)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
        {"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": 500, "ignore_eos": True, "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 3:
        events += resp.readline().startswith(b"data: ")
    # The engines' counters are snapshots the engine core publishes: poll them.
    assert poll_until(lambda: sum(d.load().num_running for d in tcp_stack.decodes) == 1, 30), \
        "the stream never ran on a decode"
    conn.sock.close()
    conn.close()
    # The decode aborts the request, no KV stays pinned on the prefill side.
    tcp_stack.wait_idle(timeout=30)


def test_killed_prefill_process_requests_retried(e2e_model, reference, e2e_tokenizer):
    """Its own stack: it kills one of its two prefill processes."""
    expected, _ = reference
    with Stack(e2e_model, StackSpec(prefills=2, decodes=1)) as stack:
        victim = stack.prefills[0]
        prompt = PROMPTS[0]
        body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        # The survivor publishes each request's KV once and the decode pulls it once (the victim,
        # frozen from the start, published nothing).
        with stack.one_transfer_per_request(4):
            victim.proc.send_signal(signal.SIGSTOP)  # frozen: what is sent to it now stays in flight
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(stack.post, "/v1/completions", body) for _ in range(4)]
                assert poll_until(lambda: stack.router.metric("pdserve:router_routing_decisions_total", {
                    "role": "prefill", "instance": victim.address}) >= 2, 10), "no request sent to the frozen prefill"
                stack.kill(victim)
                results = [f.result(60) for f in futures]
        want = expected[tuple(e2e_tokenizer.encode(prompt))].text
        assert all(status == 200 and b["choices"][0]["text"] == want for status, b in results), results
        assert stack.router.metric("pdserve:router_upstream_retries_total",
                                   {"role": "prefill", "instance": victim.address, "code": "UNAVAILABLE"}) >= 2
