"""Bad input gets an OpenAI-style error with the right status, and the gateway keeps serving."""
from __future__ import annotations

import pytest

from router_harness import wait_until


@pytest.fixture
def stack(make_stack):
    return make_stack(prefill=1, decode=1, max_model_len=64)


def assert_error(result, status: int, param: str | None = None, contains: str = ""):
    got_status, _, body = result
    assert got_status == status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert contains.lower() in err["message"].lower(), err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("body,param,contains", [
    (b"{not json", None, "malformed JSON"),
    (b"[1, 2]", None, "JSON object"),
    ({"model": "tiny"}, "prompt", "required"),
    ({"prompt": 5}, "prompt", "prompt must be"),
    ({"prompt": [1, "a"]}, "prompt", ""),
    ({"prompt": []}, "prompt", ""),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens", "integer"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens", "at least 1"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "at least 1"),
    ({"prompt": "hi", "max_tokens": 1000}, "max_tokens", "maximum context length"),
    ({"prompt": "hi " * 80}, "prompt", "maximum context length"),
    ({"prompt": [5000]}, "prompt", "outside the vocabulary"),
    ({"prompt": "hi", "temperature": -1}, "temperature", ">= 0"),
    ({"prompt": "hi", "temperature": True}, "temperature", "number"),
    ({"prompt": "hi", "top_p": 0}, "top_p", ""),
    ({"prompt": "hi", "logprobs": 50}, "logprobs", ""),
    ({"prompt": "hi", "stop": [1]}, "stop", ""),
    ({"prompt": "hi", "n": 17}, "n", "--max-n"),
    ({"prompt": "hi", "n": 3, "best_of": 2}, "best_of", "greater than or equal to n"),
    ({"prompt": "hi", "best_of": 3, "stream": True}, "best_of", "cannot be streamed"),
    ({"prompt": "hi", "presence_penalty": 5}, "presence_penalty", "[-2, 2]"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"prompt": "hi", "logit_bias": {"5000": 1}}, "logit_bias", "outside the vocabulary"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"prompt": "hi", "bad_words": [1]}, "bad_words", "strings"),
    ({"prompt": "hi", "stream": True, "stream_interval": 0}, "stream_interval", ">= 1"),
    ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
    ({"prompt": "hi", "allowed_token_ids": [1, "a"]}, "allowed_token_ids", "token ids"),
    ({"prompt": "hi", "allowed_token_ids": [5000]}, "allowed_token_ids", "outside the vocabulary"),
    ({"prompt": "hi", "stream_interval": 2.5}, "stream_interval", "integer"),
    ({"prompt": "hi", "stream_interval": 2 ** 40}, "stream_interval", "2147483647"),
    ({"prompt": "hi", "use_beam_search": True}, "use_beam_search", "not supported"),
    ({"prompt": "hi", "suffix": "x"}, "suffix", "not supported"),
])
def test_bad_completion_requests(stack, body, param, contains):
    assert_error(stack.post("/v1/completions", body), 400, param, contains)


@pytest.mark.parametrize("body,param,contains", [
    ({"messages": "hi"}, "messages", "array"),
    ({"messages": [{"content": "no role"}]}, "messages", "role"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages", ""),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "not supported"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools", "function"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, "response_format",
     "json_schema"),
    ({"messages": [{"role": "user", "content": "hi"}], "guided_choice": ["a"], "guided_regex": "a"}, "guided_choice",
     "only one"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs", "boolean"),
    ({"messages": [{"role": "user", "content": "hi"}], "best_of": 2}, "best_of", "not supported"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n", "[1, 16]"),
    ({"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
])
def test_bad_chat_requests(stack, body, param, contains):
    assert_error(stack.post("/v1/chat/completions", body), 400, param, contains)


def test_unknown_model_is_404(stack):
    err = assert_error(stack.post("/v1/completions", {"model": "nope", "prompt": "hi"}), 404, "model")
    assert err["code"] == "model_not_found"
    assert_error(stack.request("GET", "/v1/models/nope"), 404, "model")
    assert stack.request("GET", "/v1/models/tiny")[2]["max_model_len"] == 64


def test_unknown_route_and_method_get_error_bodies(stack):
    assert_error(stack.request("GET", "/v1/nothing"), 404)
    assert_error(stack.request("GET", "/v1/completions"), 405)


def test_unknown_fields_are_ignored_and_counted(stack, caplog):
    status, headers, body = stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "frobnicate": 1,
                                                           "zeta": None})
    assert status == 200, body
    assert headers["X-Ignored-Fields-Count"] == "2"  # the names are in the log, never in a header
    assert "'frobnicate', 'zeta'" in caplog.text
    status, headers, _ = stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert "X-Ignored-Fields-Count" not in headers
    # vLLM's spaces_between_special_tokens is known (it changes nothing with fast tokenizers,
    # every tokenizer here, as in vLLM's fast detokenizer), and checked.
    status, headers, _ = stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                        "spaces_between_special_tokens": False})
    assert status == 200 and "X-Ignored-Fields-Count" not in headers
    assert_error(stack.post("/v1/completions", {"prompt": "hi", "spaces_between_special_tokens": "no"}), 400,
                 "spaces_between_special_tokens")


def test_api_key(make_stack):
    stack = make_stack(api_key="sekret")
    body = {"prompt": "hi", "max_tokens": 2}
    err = assert_error(stack.post("/v1/completions", body), 401)
    assert err["code"] == "invalid_api_key"
    assert_error(stack.post("/v1/completions", body, {"Authorization": "Bearer wrong"}), 401)
    assert_error(stack.request("GET", "/v1/models"), 401)
    assert stack.post("/v1/completions", body, {"Authorization": "Bearer sekret"})[0] == 200
    assert stack.request("GET", "/health")[0] == 200  # probes need no key
    assert stack.request("GET", "/metrics")[0] == 200


def test_several_api_keys_rotate(make_stack):
    """vLLM's --api-key takes several: any of them is let in (one can be retired while the other
    serves), on HTTP and gRPC; a comma-separated string (the environment's form) says the same."""
    import grpc

    from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc

    body = {"prompt": "hi", "max_tokens": 2}
    for keys in (("old-key", "new-key"), "old-key, new-key"):
        stack = make_stack(api_key=keys)
        for key in ("old-key", "new-key"):
            assert stack.post("/v1/completions", body, {"Authorization": f"Bearer {key}"})[0] == 200
            assert stack.post("/v1/completions", body, {"x-api-key": key})[0] == 200
        assert_error(stack.post("/v1/completions", body, {"Authorization": "Bearer old-key, new-key"}), 401)
        assert_error(stack.post("/v1/completions", body, {"Authorization": "Bearer other"}), 401)
        with grpc.insecure_channel(stack.grpc_target) as ch:
            stub = pb_grpc.GenerateStub(ch)
            request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2))
            assert list(stub.Generate(request, timeout=10, metadata=[("authorization", "Bearer new-key")]))
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request, timeout=10, metadata=[("authorization", "Bearer nope")]))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_no_healthy_instance_is_503_with_a_reason(make_stack):
    stack = make_stack(prefill=1, decode=1)
    stack.lt.run(stack.prefills[0].set_serving(False))
    wait_until(lambda: not stack.router.pool.healthy("prefill"), what="prefill marked unhealthy")
    err = assert_error(stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}), 503,
                       contains="no healthy prefill instance")
    assert "NOT_SERVING" in err["message"] and stack.prefills[0].address in err["message"]
    assert stack.request("GET", "/health")[0] == 503
    stack.lt.run(stack.decodes[0].stop(0))
    wait_until(lambda: not stack.router.pool.healthy("decode"), what="decode marked unhealthy")
    assert_error(stack.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}), 503,
                 contains="no healthy")
    stack.lt.run(stack.prefills[0].set_serving(True))
    wait_until(lambda: stack.router.pool.healthy("prefill"), what="prefill healthy again")
    assert_error(stack.post("/v1/completions", {"prompt": "hi"}), 503, contains="no healthy decode instance")


def test_metrics_count_requests_by_status_code(stack):
    stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    stack.post("/v1/completions", {"prompt": "hi", "n": 99})
    stack.post("/v1/completions", b"{")
    status, _, text = stack.request("GET", "/metrics")
    assert status == 200
    text = text.decode()
    assert 'pdserve:router_requests_total{endpoint="/v1/completions",status_code="200"} 1.0' in text
    assert 'pdserve:router_requests_total{endpoint="/v1/completions",status_code="400"} 2.0' in text
    for name in ("pdserve:router_time_to_first_token_seconds_bucket", "pdserve:router_e2e_request_latency_seconds",
                 "pdserve:router_inter_token_latency_seconds", "pdserve:router_routing_decisions_total",
                 "pdserve:router_instance_healthy"):
        assert name in text, name
