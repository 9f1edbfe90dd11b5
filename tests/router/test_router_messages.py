"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), driven by the
official `anthropic` client: content blocks through the chat template, thinking / text /
tool_use blocks whole and streamed, stop reasons, usage, errors in Anthropic's shape."""
from __future__ import annotations

import json

import anthropic
import pytest

from router_fakes import toy_generate
from test_router_migration import migration_stack  # noqa: F401 (a fixture)
from test_router_openai import stack  # noqa: F401 (a fixture)
from test_router_reasoning import THINKING, reference


def client_of(stack, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url.removesuffix("/v1"), api_key=kw.pop("api_key", "unused"), max_retries=0, timeout=30,
                               **kw)


def chat_ids(tokenizer, messages):
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)


def test_a_message_is_the_chat_completion_of_its_blocks(stack, tokenizer):
    with client_of(stack) as client:
        out = client.messages.create(model="tiny", max_tokens=6, system="Be brief.",                                     messages=[{"role": "user", "content": [{"type": "text", "text": "Name"},
                                                                            {"type": "text", "text": "a colour."}]}])
    prompt = chat_ids(tokenizer, [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Name\na colour."}])
    ids, _ = toy_generate(prompt, 6)
    (block,) = out.content
    assert block.type == "text" and block.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert out.stop_reason == "max_tokens" and out.stop_sequence is None and out.role == "assistant"
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == len(prompt) and out.usage.output_tokens == 6
    assert out.model == "tiny" and out.type == "message"


def test_streamed_events_build_the_same_message(stack):
    kwargs = dict(model="tiny", max_tokens=12, messages=[{"role": "user", "content": "A story?"}])
    with client_of(stack) as client:
        whole = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            events = list(stream)
            final = stream.get_final_message()
    raw = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                  "content_block_stop", "message_delta", "message_stop")]
    assert raw[:2] == ["message_start", "content_block_start"] and raw[-3:] == ["content_block_stop",
                                                                                 "message_delta", "message_stop"]
    assert raw.count("content_block_delta") > 3  # streamed as it came
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12


def test_stop_sequences_end_the_turn_and_are_named(stack, tokenizer):
    with client_of(stack) as client:
        text = client.messages.create(model="tiny", max_tokens=12,
                                      messages=[{"role": "user", "content": "Go"}]).content[0].text
        stop = text[3:6]
        out = client.messages.create(model="tiny", max_tokens=12, stop_sequences=[stop],
                                     messages=[{"role": "user", "content": "Go"}])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == text[:text.index(stop)]


TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def test_tool_use_blocks_and_tool_results_going_back(make_stack, tokenizer):
    text = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    script = tokenizer.encode(text, add_special_tokens=False)
    stack = make_stack(prefill=1, decode=1, prefill_kwargs=[{"script": script}], decode_kwargs=[{"script": script}])
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    with client_of(stack) as client:
        out = client.messages.create(model="tiny", max_tokens=100, tools=TOOLS, messages=ask)
        said, use = out.content
        assert said.text == "Let me check." and use.type == "tool_use" and use.name == "get_weather"
        assert use.input == {"city": "Paris"} and use.id.startswith("toolu_") and out.stop_reason == "tool_use"
        with client.messages.stream(model="tiny", max_tokens=100, tools=TOOLS, messages=ask) as stream:
            events = list(stream)
            final = stream.get_final_message()  # the SDK parses the input_json_delta pieces
        assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[1].input == {"city": "Paris"}
        # The tool_use block opened with its name and its input came as the model wrote it.
        pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"
                  and e.delta.type == "input_json_delta"]
        assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris"}
        assert final.stop_reason == "tool_use"
        # The assistant's turn (text + tool_use) and the user's tool_result go back as the chat
        # completion's assistant tool call and tool message.
        follow = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                      "content": [{"type": "text", "text": "Sunny"}]}]}]
        counted = client.messages.count_tokens(model="tiny", tools=TOOLS, messages=follow).input_tokens
        again = client.messages.create(model="tiny", max_tokens=100, tools=TOOLS, messages=follow)
    messages = [ask[0], {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "Sunny"}]
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in TOOLS]
    want = tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                          add_generation_prompt=True), add_special_tokens=False)
    assert counted == len(want) == again.usage.input_tokens + again.usage.cache_read_input_tokens


def test_tool_choice_tool_answers_with_that_tool(make_stack, tokenizer):
    script = tokenizer.encode('{"city": "Oslo"}', add_special_tokens=False)
    stack = make_stack(prefill=1, decode=1, prefill_kwargs=[{"script": script}], decode_kwargs=[{"script": script}])
    with client_of(stack) as client:
        out = client.messages.create(model="tiny", max_tokens=100, tools=TOOLS,
                                     tool_choice={"type": "tool", "name": "get_weather"},
                                     messages=[{"role": "user", "content": "Weather?"}])
    (use,) = out.content
    assert use.type == "tool_use" and use.input == {"city": "Oslo"} and out.stop_reason == "tool_use"
    sampling = stack.decodes[0].engine.requests[-1].sampling
    assert json.loads(sampling.structured_outputs.json) == TOOLS[0]["input_schema"]


def test_thinking_blocks_under_a_reasoning_parser(make_stack, tokenizer):
    script = tokenizer.encode(THINKING, add_special_tokens=False)
    stack = make_stack(prefill=1, decode=1, reasoning_parser="deepseek_r1", prefill_kwargs=[{"script": script}],
                       decode_kwargs=[{"script": script}])
    want_thinking, want_text = reference(THINKING, True)
    ask = dict(model="tiny", max_tokens=len(script) + 5, messages=[{"role": "user", "content": "2 + 2?"}])
    with client_of(stack) as client:
        out = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            events = list(stream)
            final = stream.get_final_message()
        # The thinking goes back in the assistant's turn (as the message's reasoning).
        turn = [b.model_dump() for b in out.content]
        assert client.messages.create(model="tiny", max_tokens=5, messages=[
            ask["messages"][0], {"role": "assistant", "content": turn}, {"role": "user", "content": "And 3 + 3?"}])
    thinking, text = out.content
    assert thinking.type == "thinking" and thinking.thinking == want_thinking and thinking.signature
    assert text.text == want_text and out.stop_reason == "end_turn"
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == want_thinking
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta") \
        == want_text


def test_errors_are_anthropics_and_the_api_key_goes_in_x_api_key(make_stack):
    stack = make_stack(prefill=1, decode=1, api_key="sekrit")
    with client_of(stack, api_key="wrong") as client:
        with pytest.raises(anthropic.AuthenticationError) as e:
            client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    with client_of(stack, api_key="sekrit") as client:
        assert client.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model="tiny", max_tokens=10**6, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"]["type"] == "invalid_request_error"
        assert "maximum context length" in e.value.body["error"]["message"]
        with pytest.raises(anthropic.NotFoundError):
            client.messages.create(model="other", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        for bad, words in ((dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
                            "'image'"),
                           (dict(messages=[{"role": "user", "content": "hi"}], tools=[{"type": "bash_20250124",
                                                                                       "name": "bash"}]),
                            "bash_20250124"),
                           (dict(messages=[]), "non-empty")):
            with pytest.raises(anthropic.BadRequestError) as e:
                client.messages.create(model="tiny", max_tokens=5, **bad)
            assert words in e.value.body["error"]["message"], e.value.body
    status, _, body = stack.post("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                                 headers={"x-api-key": "sekrit"})
    assert status == 400 and body == {"type": "error", "error": {"type": "invalid_request_error",
                                                                 "message": "max_tokens is required"}}


def test_a_stream_that_fails_midway_ends_with_an_error_event(migration_stack):
    stack = migration_stack(prefill=1, deaths=4, migration_limit=0)
    status, _, data = stack.post("/v1/messages", {"model": "tiny", "max_tokens": 12, "stream": True,
                                                  "messages": [{"role": "user", "content": "Hello"}]})
    events = [json.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: ")]
    types = [e["type"] for e in events]
    assert status == 200 and types[0] == "message_start" and "content_block_delta" in types
    assert types[-1] == "error" and "message_stop" not in types
    assert events[-1]["error"]["type"] == "api_error" and "migration" in events[-1]["error"]["message"]


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body", [
    {"messages": 5}, {"messages": [5]}, {"messages": [{"role": "system", "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]}, {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 5}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "thinking"}]}]},
    {"messages": HI, "system": 5}, {"messages": HI, "system": [{"type": "image"}]},
    {"messages": HI, "tools": "x"}, {"messages": HI, "tools": [{"name": "f"}]},
    {"messages": HI, "tools": [{"name": "f", "input_schema": {}}], "tool_choice": "auto"},
    {"messages": HI, "tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool"}},
    {"messages": HI, "thinking": {"type": "sometimes"}}, {"messages": HI, "thinking": "on"},
    {"messages": HI, "output_config": {"format": {"type": "yaml"}}}, {"messages": HI, "stop_sequences": [5]},
    {"messages": HI, "stop_sequences": "x"}, {"messages": HI, "temperature": "hot"}, {"messages": HI, "stream": 1},
    {"messages": HI, "mcp_servers": [{"url": "x"}]}, {"messages": HI, "max_tokens": "5"},
    {"messages": HI, "max_tokens": 0},
])
def test_malformed_messages_bodies_are_anthropic_400s(stack, body):
    status, _, err = stack.post("/v1/messages", {"model": "tiny", "max_tokens": 5, **body})
    assert status == 400, err
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    if "system" in body:  # the message names the field at fault
        assert err["error"]["message"].startswith("system"), err
    assert stack.post("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": HI})[0] == 200


def test_a_streamed_call_whose_arguments_are_no_object_is_text():
    """A call that comes whole at the end (Llama 3's with its arguments written as a JSON string)
    and whose arguments are not a JSON object is text, as in the unstreamed answer, and the stream
    goes on to its end."""
    from services.router.messages_api import MessageOutput
    from services.router.tool_calls import make_call

    out = MessageOutput(stream=True)
    call = make_call("f", '"hello"')
    assert out.tool_deltas([{"index": 0, "id": call["id"], "type": "function",
                             "function": {"name": "f", "arguments": '"hello"'}}]) == []
    events = out.tool_uses([call]) + out.finish()
    assert [e["type"] for e in events] == ["content_block_start", "content_block_delta", "content_block_stop"]
    assert out.blocks == [{"type": "text", "text": '"hello"'}] and out.calls == []
