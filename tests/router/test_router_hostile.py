"""Hostile input at the gateway: caps (in flight, prompts, body, stop lists), prompt length before
tokenizing, tokenizing off the event loop, untrusted chat templates, out-of-range numbers, no
client text in headers. Every refusal is an OpenAI error body, and the router keeps serving."""
from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import time

import grpc
import pytest

from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc
from services.router.cli import add_router_parser, config_from_args
from services.router.sampling import MAX_STOP_SEQUENCE_CHARS

from router_fakes import toy_generate
from router_harness import wait_until
from test_router_errors import assert_error

OK = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def gated(stack):
    """Prefills wait until the returned function is called."""
    engine = stack.prefills[0].engine
    engine.gate = asyncio.Event()
    return lambda: stack.lt.loop.call_soon_threadsafe(engine.gate.set)


RESPONSE = {"input": "hi", "max_output_tokens": 2}
MESSAGE = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_router_in_flight_cap_is_429_with_retry_after_on_http_and_grpc(make_stack):
    """Every generating endpoint holds a slot while it runs and is refused past the cap, each in
    its API's error shape: OpenAI's for completions, chat and responses, Anthropic's for messages."""
    stack = make_stack(max_concurrent_requests=2)
    release = gated(stack)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = [pool.submit(stack.post, "/v1/responses", RESPONSE), pool.submit(stack.post, "/v1/messages", MESSAGE)]
        wait_until(lambda: len(stack.prefills[0].engine.running) == 2, what="two requests in flight")
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", OK), ("/v1/responses", RESPONSE)):
            status, headers, body = stack.post(path, body)
            err = assert_error((status, headers, body), 429, contains="router is at capacity")
            assert err["code"] == "router_at_capacity" and err["type"] == "rate_limit_error"
            assert headers["Retry-After"] == "1"
        status, headers, body = stack.post("/v1/messages", MESSAGE)
        assert status == 429 and headers["Retry-After"] == "1", body
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
        assert "router is at capacity" in body["error"]["message"]
        with grpc.insecure_channel(stack.grpc_target) as ch, pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.GenerateStub(ch).Generate(pb.GenerateRequest(text="hi"), timeout=10))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        release()
        done = [f.result() for f in held]
        assert [status for status, _, _ in done] == [200, 200], done
        assert done[0][2]["status"] == "incomplete" and done[1][2]["stop_reason"] == "max_tokens"
    assert stack.metric("pdserve:router_requests_shed_total", {"code": "router_at_capacity"}) == 5
    assert stack.router.admission.in_flight == 0
    assert stack.post("/v1/completions", OK)[0] == 200


def test_prompt_array_is_capped_and_runs_with_bounded_concurrency(make_stack, tokenizer):
    stack = make_stack(max_prompts_per_request=6, max_concurrent_prompts=2)
    err = assert_error(stack.post("/v1/completions", {"prompt": ["a"] * 7, "max_tokens": 2}), 400, "prompt",
                       "at most 6")
    assert "7 items" in err["message"]
    assert_error(stack.post("/v1/completions", {"prompt": [[5, 6]] * 7, "max_tokens": 2}), 400, "prompt")
    engine = stack.prefills[0].engine
    release = gated(stack)
    prompts = [f"prompt number {i}" for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(stack.post, "/v1/completions", {"prompt": prompts, "max_tokens": 3})
        wait_until(lambda: len(engine.running) == 2, what="two prompts upstream")
        time.sleep(0.3)  # a bound holds over time: nothing else may start meanwhile
        assert len(engine.requests) == 2 and len(engine.running) == 2
        release()
        status, _, body = reply.result()
    assert status == 200, body
    texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    assert texts == [tokenizer.decode(toy_generate(tokenizer.encode(p), 3)[0], skip_special_tokens=True)
                     for p in prompts]


def test_body_cap_is_413_with_an_openai_body(make_stack):
    stack = make_stack(max_payload_size=2000)
    err = assert_error(stack.post("/v1/completions", {"prompt": "x" * 3000}), 413, contains="over 2000 bytes")
    assert err["type"] == "invalid_request_error"
    assert stack.post("/v1/completions", OK)[0] == 200
    with grpc.insecure_channel(stack.grpc_target) as ch, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.GenerateStub(ch).Generate(pb.GenerateRequest(text="x" * 3000), timeout=10))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # gRPC's own answer to an oversized message
    parser = add_router_parser(__import__("argparse").ArgumentParser().add_subparsers())
    config = config_from_args(parser.parse_args(["--decode", "127.0.0.1:1"]))
    assert config.max_payload_size == 8 << 20 and config.max_concurrent_requests == 1024


def test_prompt_length_is_checked_before_tokenizing(make_stack):
    stack = make_stack(max_model_len=64)
    bound = stack.router.model.char_bound.chars_per_token
    assert bound is not None  # byte-level BPE: every character is kept
    text = "z" * int(64 * bound)
    for path, body, param in (("/v1/completions", {"prompt": text}, "prompt"),
                              ("/v1/completions", {"prompt": ["hi", text]}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]},
                               "messages")):
        err = assert_error(stack.post(path, body), 400, param, "characters")
        assert err["code"] == "context_length_exceeded"
    with grpc.insecure_channel(stack.grpc_target) as ch, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.GenerateStub(ch).Generate(pb.GenerateRequest(text=text), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "characters" in e.value.details()
    # Token ids: their count is the length, refused before any other check.
    err = assert_error(stack.post("/v1/completions", {"prompt": [10 ** 9] * 100}), 400, "prompt",
                       "maximum context length")
    assert err["code"] == "context_length_exceeded"
    assert stack.post("/v1/completions", OK)[0] == 200


def test_a_huge_prompt_tokenizes_off_the_event_loop(make_stack):
    # A context long enough that a multi-megabyte text passes the character bound and is tokenized.
    stack = make_stack(max_model_len=10 ** 6, max_payload_size=32 << 20)
    huge = {"prompt": "hello world " * 500_000, "max_tokens": 1}  # 6 MB, 1.5M tokens: over the context
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(stack.post, "/v1/completions", huge)
        wait_until(lambda: stack.router.admission.in_flight == 1, what="the huge request admitted")
        time.sleep(0.2)  # its body is read and it is being tokenized
        start = time.monotonic()
        status, _, _ = stack.post("/v1/completions", OK)
        small_s = time.monotonic() - start
        assert status == 200
        assert not slow.done(), "the small request waited for the huge one's tokenization"
        assert_error(slow.result(), 400, "prompt", "maximum context length")
    assert small_s < 2.0


def test_untrusted_chat_templates_are_refused(make_stack):
    stack = make_stack()
    template = "{% for m in messages %}{{ m.content }}{% endfor %}" * 3
    for extra, param in (({"chat_template": template}, "chat_template"),
                         ({"chat_template_kwargs": {"chat_template": template}}, "chat_template_kwargs")):
        err = assert_error(stack.post("/v1/chat/completions", {**CHAT, **extra}), 400, param,
                           "--trust-request-chat-template")
        assert err["code"] == "untrusted_chat_template"
    # apply_chat_template's own parameters are not template variables: dropped, never a 500.
    status, _, body = stack.post("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {
        "tokenize": True, "return_dict": True, "enable_thinking": False}})
    assert status == 200, body


def test_trusted_chat_template_is_rendered(make_stack, tokenizer):
    stack = make_stack(trust_request_chat_template=True)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    for extra in ({"chat_template": template}, {"chat_template_kwargs": {"chat_template": template}}):
        status, _, body = stack.post("/v1/chat/completions", {**CHAT, **extra})
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == len(tokenizer.encode("<user>hi", add_special_tokens=False))
    assert_error(stack.post("/v1/chat/completions", {**CHAT, "chat_template": "{% for %}"}), 400, "messages",
                 "chat template")


def test_stop_lists_are_capped(make_stack):
    stack = make_stack(max_stop_sequences=4)
    assert_error(stack.post("/v1/completions", {**OK, "stop": ["a", "b", "c", "d", "e"]}), 400, "stop", "at most 4")
    assert_error(stack.post("/v1/completions", {**OK, "stop": "s" * (MAX_STOP_SEQUENCE_CHARS + 1)}), 400, "stop",
                 f"at most {MAX_STOP_SEQUENCE_CHARS} characters")
    assert_error(stack.post("/v1/completions", {**OK, "stop_token_ids": list(range(6, 300))}), 400,
                 "stop_token_ids", "at most 256")
    assert stack.post("/v1/completions", {**OK, "stop": ["a", "b", "c", "d"]})[0] == 200
    with grpc.insecure_channel(stack.grpc_target) as ch, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.GenerateStub(ch).Generate(pb.GenerateRequest(
            text="hi", sampling=pb.SamplingParams(stop=list("abcde"))), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("extra,param", [
    ({"top_k": 2 ** 31}, "top_k"),
    ({"top_k": 10 ** 6}, "top_k"),  # beyond the vocabulary, as vLLM refuses it
    ({"top_k": -(2 ** 40)}, "top_k"),
    ({"seed": 2 ** 63}, "seed"),
    ({"seed": -(2 ** 63) - 1}, "seed"),
    ({"seed": 2 ** 200}, "seed"),
    ({"max_tokens": 2 ** 70}, "max_tokens"),
    ({"max_tokens": -(2 ** 70)}, "max_tokens"),
    ({"n": 2 ** 64}, "n"),
    ({"logprobs": 2 ** 40}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 2 ** 40}, "min_tokens"),
    ({"temperature": 1e308}, "temperature"),
    ({"temperature": 10 ** 400}, "temperature"),
    ({"top_p": -(10 ** 400)}, "top_p"),
    ({"min_p": 1e300}, "min_p"),
    ({"stop_token_ids": [2 ** 40]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_out_of_range_numbers_are_400_never_500(make_stack, extra, param):
    stack = make_stack()
    assert_error(stack.post("/v1/completions", {**OK, **extra}), 400, param)
    assert_error(stack.post("/v1/chat/completions", {**CHAT, **extra}), 400, param)
    assert stack.post("/v1/completions", OK)[0] == 200


def test_non_finite_numbers_are_400(make_stack):
    stack = make_stack()
    for raw in (b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_p": Infinity}',
                b'{"prompt": "hi", "temperature": 1e999}'):
        assert_error(stack.post("/v1/completions", raw), 400, contains="JSON")
    assert_error(stack.post("/v1/chat/completions", {**CHAT, "top_logprobs": 2 ** 40, "logprobs": True}), 400,
                 "top_logprobs")


@pytest.mark.parametrize("sampling,message", [
    (pb.SamplingParams(temperature=float("nan")), "temperature"),
    (pb.SamplingParams(temperature=float("inf")), "temperature"),
    (pb.SamplingParams(min_p=float("nan")), "min_p"),
    (pb.SamplingParams(top_k=2 ** 31 - 1), "top_k"),
    (pb.SamplingParams(stop_token_ids=[2 ** 31 - 1]), "stop_token_ids"),
    (pb.SamplingParams(max_tokens=2 ** 31 - 1), "maximum context length"),
    (pb.SamplingParams(min_tokens=-5, max_tokens=4), "min_tokens"),
    (pb.SamplingParams(logprobs=2 ** 31 - 1), "logprobs"),
])
def test_grpc_generate_out_of_range_is_invalid_argument(make_stack, sampling, message):
    stack = make_stack()
    with grpc.insecure_channel(stack.grpc_target) as ch:
        stub = pb_grpc.GenerateStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text="hi", sampling=sampling), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in e.value.details()
        ok = list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2)), timeout=10))
        assert ok[-1].finish_reason == "length"


def test_no_client_text_reaches_a_response_header(make_stack):
    stack = make_stack()
    for name in ("a\nb", "x\r\nX-Evil: 1", "\u00e9t\u00e9", "k" * 10000):
        status, headers, body = stack.post("/v1/completions", json.dumps({**OK, name: 1}))
        assert status == 200, body
        assert headers["X-Ignored-Fields-Count"] == "1" and "X-Evil" not in headers
    # The request id a client sends is echoed only when it is a plain token.
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=10)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(OK),
                     headers={"Content-Type": "application/json", "X-Request-Id": "bad id\u00e9"})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200 and resp.getheader("X-Request-Id").startswith("cmpl-")
    finally:
        conn.close()


def _tokenizer(normalizer=None, pre_tokenizer=None):
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "abc": 1, "abcdefgh": 2}, unk_token="[UNK]"))
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    return tok


def test_the_character_bound_holds_only_where_it_can_be_justified(tokenizer):
    from tokenizers import Regex, normalizers, pre_tokenizers

    from services.router.prompt_limits import PromptCharBound

    def bound(**kwargs):
        return PromptCharBound(_tokenizer(**kwargs)).chars_per_token

    assert bound() == 8  # the longest vocabulary entry
    assert bound(normalizer=normalizers.NFC()) == 32  # NFC composes up to 4 code points into one
    assert bound(normalizer=normalizers.Sequence([normalizers.Replace("  ", " "), normalizers.Lowercase()])) == 16
    assert bound(pre_tokenizer=pre_tokenizers.ByteLevel()) == 8
    # Anything that can drop characters outright: no bound, the check is off (never a wrong 400).
    for kwargs in ({"normalizer": normalizers.Strip()}, {"normalizer": normalizers.Replace(Regex(r"\s+"), " ")},
                   {"normalizer": normalizers.Replace("x", "")}, {"normalizer": normalizers.BertNormalizer()},
                   {"pre_tokenizer": pre_tokenizers.Whitespace()},
                   {"pre_tokenizer": pre_tokenizers.Split(" ", "removed")}):
        assert bound(**kwargs) is None, kwargs
        assert PromptCharBound(_tokenizer(**kwargs)).min_tokens("x" * 10 ** 6) == 0
    # On the served tokenizer, the bound is below the real count even for texts built to tokenize
    # into few tokens (its longest tokens repeated, runs of spaces, combining marks).
    backend = tokenizer.backend_tokenizer
    real = PromptCharBound(backend)
    longest = max(backend.get_vocab(), key=len)
    for text in (backend.decode([backend.token_to_id(longest)]) * 500, " " * 5000, "e\u0301" * 2000,
                 "hello world " * 300):
        assert real.min_tokens(text) <= len(backend.encode(text, add_special_tokens=False).ids)


def test_every_engine_at_capacity_is_counted_as_shed(make_stack):
    stack = make_stack(prefill_kwargs=[{"fail": grpc.StatusCode.RESOURCE_EXHAUSTED, "fail_times": -1}])
    err = assert_error(stack.post("/v1/completions", OK), 429, contains="at capacity")
    assert err["code"] == "overloaded"
    with grpc.insecure_channel(stack.grpc_target) as ch, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.GenerateStub(ch).Generate(pb.GenerateRequest(text="hi"), timeout=10))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stack.metric("pdserve:router_requests_shed_total", {"code": "overloaded"}) == 2
    assert stack.metric("pdserve:router_requests_shed_total", {"code": "router_at_capacity"}) == 0
