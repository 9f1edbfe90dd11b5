"""Structured outputs and tool calls through a real disaggregated stack (router, two prefills, two
decodes over tcp) with the official `openai` client: a random-weight model's documents parse and
validate every time. Each document is begun by a prefill (its first token under the grammar)
and finished by a decode whose matcher resumes from that token."""
from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest

from stack import SERVED_MODEL
from structured_schemas import PERSON

pytestmark = pytest.mark.e2e

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON"}]
# Compact JSON (vLLM's option, merged into the constraint given elsewhere): a random-weight model
# allowed any whitespace between tokens spends its budget on it and never closes the document.
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


@pytest.fixture
def client(tcp_stack):
    c = openai.OpenAI(base_url=f"{tcp_stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def test_response_format_json_schema_validates_every_time(client):
    for seed in range(5):
        out = client.chat.completions.create(
            model=SERVED_MODEL, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                    "strict": True}}, extra_body=COMPACT)
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_structured_outputs_json_streamed_and_json_object(client):
    for seed in range(3):
        stream = client.completions.create(model=SERVED_MODEL, prompt="A person:", temperature=1.0, seed=seed,
                                           max_tokens=300, stream=True,
                                           extra_body={"structured_outputs": {"json": PERSON,
                                                                              "disable_any_whitespace": True}})
        text, finish = "", None
        for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "stop"
        jsonschema.validate(json.loads(text), PERSON)
    out = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, temperature=0.0, max_tokens=40,
                                         response_format={"type": "json_object"}, extra_body=COMPACT)
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":  # nothing bounds an object's strings
        assert isinstance(json.loads(text), dict)


def test_guided_choice_regex_and_grammar(client):
    choices = ["positive", "negative", "neutral"]
    for seed in range(4):
        out = client.completions.create(model=SERVED_MODEL, prompt="Sentiment:", temperature=1.0, seed=seed,
                                        max_tokens=20, extra_body={"guided_choice": choices})
        assert out.choices[0].text in choices and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model=SERVED_MODEL, prompt="Mail:", temperature=1.0, seed=1, max_tokens=40,
                                    extra_body={"guided_regex": r"[a-z]{3,8}@[a-z]{3,6}\.(com|net)"})
    assert re.fullmatch(r"[a-z]{3,8}@[a-z]{3,6}\.(com|net)", out.choices[0].text)
    out = client.completions.create(model=SERVED_MODEL, prompt="Sum:", temperature=1.0, seed=2, max_tokens=40,
                                    extra_body={"guided_grammar": 'root ::= num " + " num\nnum ::= [1-9] [0-9]?'})
    assert re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]?", out.choices[0].text)


def test_tool_choice_named_and_required_return_valid_tool_calls(client):
    for seed in range(3):
        out = client.chat.completions.create(
            model=SERVED_MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], temperature=1.0,
            seed=seed, max_tokens=120, tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body=COMPACT)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

        out = client.chat.completions.create(
            model=SERVED_MODEL, messages=[{"role": "user", "content": "What time is it?"}], temperature=1.0,
            seed=seed, max_tokens=200, tools=[WEATHER, TIME], tool_choice="required", extra_body=COMPACT)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        tools = {"get_weather": WEATHER, "get_time": TIME}
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name]["function"]["parameters"])


def test_tool_calls_stream_as_openai_deltas(client):
    stream = client.chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": "Weather?"}], temperature=1.0, seed=5,
        max_tokens=120, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True, extra_body=COMPACT)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_regex": "a(?=b)"}, "guided_regex"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"guided_grammar": 'root ::= ("a"'}, None),  # refused by the engines' compile
])
def test_bad_constraints_are_400s(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=5, extra_body=extra)
    if param is not None:
        assert info.value.body["param"] == param


def test_generate_over_grpc_with_structured_outputs(tcp_stack):
    from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc

    with grpc.insecure_channel(tcp_stack.grpc_target) as channel:
        stub = pb_grpc.GenerateStub(channel)
        sampling = pb.SamplingParams(max_tokens=20, temperature=1.0, seed=3, skip_special_tokens=True,
                                     structured_outputs=pb.StructuredOutputs(choice=pb.Choices(choices=["up", "down"])))
        text = "".join(r.text for r in stub.Generate(pb.GenerateRequest(text="Direction:", sampling=sampling)))
        assert text in ("up", "down")
        bad = pb.SamplingParams(max_tokens=5, structured_outputs=pb.StructuredOutputs(json='{"type": 7}'))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(text="x", sampling=bad)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_responses_api_constrains_and_calls_as_chat_does(client):
    # text.format is the chat completion's response_format: a document that validates, the same
    # greedy tokens as the chat completion of the same messages.
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    out = client.responses.create(model=SERVED_MODEL, input="Describe a person as JSON", temperature=0,
                                  max_output_tokens=300, text={"format": fmt}, extra_body=COMPACT)
    assert out.status == "completed", out.output_text
    jsonschema.validate(json.loads(out.output_text), PERSON)
    chat = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, temperature=0, max_tokens=300, extra_body=COMPACT,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert chat.choices[0].message.content == out.output_text
    assert out.usage.output_tokens == chat.usage.completion_tokens
    # A named function: one function_call item whose arguments validate against its parameters.
    tool = {"type": "function", **WEATHER["function"]}
    out = client.responses.create(model=SERVED_MODEL, input="Weather in Paris?", tools=[tool], temperature=0,
                                  tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=100,
                                  extra_body=COMPACT)
    (call,) = out.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])


def test_the_messages_api_calls_a_tool_as_chat_does(tcp_stack):
    # Anthropic's Messages API: tool_choice {"type": "tool"} is chat's named function; the
    # tool_use block's input validates against the tool's input_schema.
    import anthropic

    weather = WEATHER["function"]
    tool = {"name": weather["name"], "description": weather["description"], "input_schema": weather["parameters"]}
    with anthropic.Anthropic(base_url=tcp_stack.url, api_key="unused", max_retries=0, timeout=120) as client:
        out = client.messages.create(model=SERVED_MODEL, max_tokens=100, tools=[tool], extra_body=COMPACT,
                                     tool_choice={"type": "tool", "name": "get_weather"},
                                     messages=[{"role": "user", "content": "Weather in Paris?"}])
    (use,) = out.content
    assert use.type == "tool_use" and use.name == "get_weather" and out.stop_reason == "tool_use"
    jsonschema.validate(use.input, weather["parameters"])
