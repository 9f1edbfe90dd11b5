"""vLLM's --max-logprobs: the top-n logprobs a request may ask for, on every front, and -1 (the
whole vocabulary) when the operator lets it in."""
from __future__ import annotations

import grpc
import pytest

from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc

from router_fakes import VOCAB
from router_harness import router_config

CHAT = [{"role": "user", "content": "hi"}]


def asks(top: int) -> list[tuple[str, dict, str]]:
    """(path, body, param): each HTTP field that asks for `top` logprobs a token."""
    return [("/v1/completions", {"prompt": "Hello world", "max_tokens": 2, "logprobs": top}, "logprobs"),
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": top},
             "top_logprobs"),
            ("/v1/completions", {"prompt": "Hello world", "max_tokens": 2, "prompt_logprobs": top}, "prompt_logprobs"),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "top_logprobs": top}, "top_logprobs")]


def grpc_generate(stack, logprobs: int) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(stack.grpc_target) as channel:
        return list(pb_grpc.GenerateStub(channel).Generate(
            pb.GenerateRequest(text="Hello world", sampling=pb.SamplingParams(max_tokens=2, logprobs=logprobs)),
            timeout=30))


def test_twenty_by_default_with_vllms_message_on_every_front(make_stack):
    stack = make_stack()
    for top, asked in ((21, 21), (-1, VOCAB)):
        for path, body, param in asks(top):
            status, _, err = stack.post(path, body)
            assert status == 400, (path, body)
            assert err["error"]["param"] == param
            assert f"logprobs of {asked}, which is greater than max allowed: 20" in err["error"]["message"]
        with pytest.raises(grpc.RpcError) as e:
            grpc_generate(stack, top)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max allowed: 20" in e.value.details()
    for path, body, _ in asks(20):  # the cap itself is served
        status, _, answer = stack.post(path, body)
        assert status == 200, answer
    status, _, err = stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": -2})
    assert status == 400 and "must be a positive value or -1" in err["error"]["message"]


def test_the_flag_lowers_the_cap(make_stack):
    stack = make_stack(max_logprobs=3)
    for path, body, param in asks(4):
        status, _, err = stack.post(path, body)
        assert status == 400 and err["error"]["param"] == param and "max allowed: 3" in err["error"]["message"]
    status, _, body = stack.post(*asks(3)[1][:2])
    assert status == 200
    assert all(len(entry["top_logprobs"]) == 3 for entry in body["choices"][0]["logprobs"]["content"])


def test_minus_one_is_the_whole_vocabulary_when_let_in(make_stack):
    stack = make_stack(max_logprobs=-1)
    status, _, body = stack.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "logprobs": True,
                                                          "top_logprobs": -1})
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(len(entry["top_logprobs"]) == VOCAB for entry in content)
    assert stack.decodes[0].engine.requests[-1].sampling.logprobs == VOCAB
    status, _, body = stack.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 1, "prompt_logprobs": -1})
    assert status == 200, body
    assert all(len(entry) == VOCAB for entry in body["choices"][0]["prompt_logprobs"][1:])
    chunks = grpc_generate(stack, -1)
    assert sum(len(c.logprobs) for c in chunks) == 2
    assert stack.decodes[0].engine.requests[-1].sampling.logprobs == VOCAB  # what the engines were asked
    # More than the vocabulary is more than any distribution has.
    status, _, err = stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": VOCAB + 1})
    assert status == 400 and err["error"]["param"] == "logprobs"


def test_prompt_logprobs_too_large_for_one_message_are_refused(make_stack, monkeypatch):
    """Prompt logprobs come back whole with the first token, in one engine message: the router
    refuses up front what cannot fit (generated tokens' wide top-n the engines spread over
    several messages: tests/engine/test_stream_interval.py)."""
    from engine import outputs

    monkeypatch.setattr(outputs, "MAX_LOGPROB_ENTRIES_PER_MESSAGE", 100)
    stack = make_stack(max_logprobs=-1)
    prompt = list(range(10, 40))  # 29 scored tokens x (3 + 1) > 100
    status, _, err = stack.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 3})
    assert status == 400 and err["error"]["param"] == "prompt_logprobs"
    assert "more than one answer carries (100)" in err["error"]["message"]
    status, _, _ = stack.post("/v1/completions", {"prompt": prompt[:20], "max_tokens": 1, "prompt_logprobs": 3})
    assert status == 200


def test_the_flag_is_checked_at_start(tiny_model_path):
    assert router_config(tiny_model_path, "--max-logprobs", "-1").max_logprobs == -1
    assert router_config(tiny_model_path).max_logprobs == 20
    with pytest.raises(ValueError, match="--max-logprobs"):
        router_config(tiny_model_path, "--max-logprobs", "-2")
