"""The gRPC Generate front: streaming, bad input as INVALID_ARGUMENT, auth, deadlines, cancellation."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc

from router_harness import wait_until
from router_fakes import client_ids, toy_generate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "grpc_client.py")


@pytest.fixture
def stack(make_stack):
    # 10 ms a token: a stream of 60 outlives a cancel sent after its first tokens, even on a loaded machine.
    return make_stack(prefill=1, decode=1, max_model_len=64, decode_kwargs=[{"token_delay": 0.01}])


@pytest.fixture
def stub(stack):
    with grpc.insecure_channel(stack.grpc_target) as channel:
        yield pb_grpc.GenerateStub(channel)


def generate(stub, timeout=30.0, metadata=None, **fields) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(**fields), timeout=timeout, metadata=metadata))


def test_generate_streams_the_same_answer_as_http(stack, stub, tokenizer):
    ids = tokenizer.encode("Hello world")
    chunks = generate(stub, text="Hello world", sampling=pb.SamplingParams(max_tokens=6))
    toks, _ = toy_generate(ids, 6)
    assert [t for c in chunks for t in c.token_ids] == toks
    assert "".join(c.text for c in chunks) == stack.post("/v1/completions", {
        "prompt": "Hello world", "max_tokens": 6, "skip_special_tokens": False})[2]["choices"][0]["text"]
    last = chunks[-1]
    assert last.finish_reason == "length" and not any(c.finish_reason for c in chunks[:-1])
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), 6)
    assert len({c.request_id for c in chunks}) == 1 and chunks[0].request_id.startswith("gen-")
    by_ids = generate(stub, token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=6),
                      request_id="mine")
    assert [t for c in by_ids for t in c.token_ids] == toks and by_ids[0].request_id == "mine"


def test_generate_logprobs_and_stop_strings(stub, tokenizer):
    ids = tokenizer.encode("Hello world")
    full = tokenizer.decode(toy_generate(ids, 10)[0])
    chunks = generate(stub, token_ids=pb.TokenIds(ids=ids),
                      sampling=pb.SamplingParams(max_tokens=10, logprobs=2, stop=[full[6:9]]))
    assert "".join(c.text for c in chunks) == full[:6]
    assert chunks[-1].finish_reason == "stop"
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)


def test_generate_reads_proto_zeros_as_unset(stub):
    chunks = generate(stub, text="hi", sampling=pb.SamplingParams(top_p=0, temperature=0))
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].finish_reason == "length"


@pytest.mark.parametrize("fields,contains", [
    (dict(model="other", text="hi"), "does not exist"),
    (dict(sampling=pb.SamplingParams(max_tokens=4)), "prompt is required"),
    (dict(text="hi " * 80), "maximum context length"),
    (dict(text="hi", sampling=pb.SamplingParams(max_tokens=100)), "maximum context length"),
    (dict(text="hi", sampling=pb.SamplingParams(max_tokens=-3)), "max_tokens"),
    (dict(text="hi", sampling=pb.SamplingParams(temperature=-1)), "temperature"),
    (dict(text="hi", sampling=pb.SamplingParams(top_p=-0.5)), "top_p"),
    (dict(text="hi", sampling=pb.SamplingParams(prompt_logprobs=1)), "prompt_logprobs"),
    (dict(token_ids=pb.TokenIds(ids=[99999])), "vocabulary"),
    (dict(token_ids=pb.TokenIds(ids=[])), "empty"),
    (dict(text="hi", request_id="bad id!"), "request_id"),
])
def test_bad_input_is_invalid_argument(stub, fields, contains):
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, **fields)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert contains in e.value.details()


def test_api_key_and_no_healthy_instance(make_stack):
    stack = make_stack(api_key="k1")
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = pb_grpc.GenerateStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            generate(stub, text="hi")
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert generate(stub, text="hi", metadata=[("authorization", "Bearer k1")])[-1].finish_reason
        stack.lt.run(stack.decodes[0].set_serving(False))
        wait_until(lambda: not stack.router.pool.healthy("decode"), what="decode unhealthy")
        with pytest.raises(grpc.RpcError) as e:
            generate(stub, text="hi", metadata=[("authorization", "Bearer k1")])
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no healthy decode" in e.value.details()


def test_cancel_aborts_upstream(stack, stub):
    stream = stub.Generate(pb.GenerateRequest(text="Hi", request_id="cancelme",
                                              sampling=pb.SamplingParams(max_tokens=60, ignore_eos=True)))
    next(stream)
    next(stream)
    stream.cancel()
    wait_until(lambda: "cancelme" in client_ids(stack.decodes[0].engine.cancelled), what="the decode stream cancelled")
    wait_until(lambda: stack.metric("pdserve:router_client_aborts_total") == 1, what="the abort counted")


def test_a_cancel_that_finds_the_stream_sending_is_counted_as_the_clients(stack):
    """grpc.aio closes a stream's generator instead of cancelling it when the cancel arrives while
    a response is held up in sending (a slow reader, flow control): that close is the client's
    abort too, aborted upstream and counted as one, its status 499."""
    from services.router.grpc_front import GenerateService

    class Context:
        def invocation_metadata(self):
            return ()

    async def read_two_then_close():
        gen = GenerateService(stack.router).Generate(
            pb.GenerateRequest(text="Hi", request_id="slowreader",
                               sampling=pb.SamplingParams(max_tokens=60, ignore_eos=True)), Context())
        await anext(gen)
        await anext(gen)
        await gen.aclose()  # what grpc.aio does to a generator whose send the cancel interrupted

    stack.lt.run(read_two_then_close())
    wait_until(lambda: "slowreader" in client_ids(stack.decodes[0].engine.cancelled), what="the decode stream cancelled")
    assert stack.metric("pdserve:router_client_aborts_total") == 1
    assert stack.metric("pdserve:router_requests_total", {"endpoint": "/pdserve.v1.Generate/Generate", "status_code": "499"}) == 1


def test_deadline_aborts_the_prefill(stack, stub):
    prefill = stack.prefills[0].engine
    prefill.gate = asyncio.Event()
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, timeout=0.3, text="Hi", request_id="late")
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: "late" in client_ids(prefill.cancelled) and "late" in client_ids(prefill.aborts), what="prefill cancelled")


def test_reflection_lists_generate(stack):
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=10)
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"pdserve.v1.Generate", "grpc.health.v1.Health"} <= names


def _example():
    spec = importlib.util.spec_from_file_location("grpc_client_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_client_streams_and_cancels(stack, tokenizer):
    example = _example()
    text, last = example.generate(stack.grpc_target, "Hello world", max_tokens=5)
    assert text == tokenizer.decode(toy_generate(tokenizer.encode("Hello world"), 5)[0], skip_special_tokens=True)
    assert last.finish_reason == "length" and last.usage.completion_tokens == 5
    text, last = example.generate(stack.grpc_target, "Hello world", max_tokens=60, cancel_after=3)
    assert not last.finish_reason
    wait_until(lambda: len(stack.decodes[0].engine.cancelled) == 1, what="the cancelled stream aborted")


def test_example_client_command_line(stack):
    out = subprocess.run([sys.executable, EXAMPLE, "--target", stack.grpc_target, "--prompt", "Hello",
                          "--max-tokens", "4"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "finish_reason=length" in out.stderr and "completion_tokens=4" in out.stderr
    out = subprocess.run([sys.executable, EXAMPLE, "--target", stack.grpc_target, "--prompt", "x" * 400],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "INVALID_ARGUMENT" in out.stderr
