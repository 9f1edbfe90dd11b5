"""POST /v1/responses (OpenAI's Responses API), driven by the official `openai` client: input
items and instructions through the chat template, output items (reasoning, message, function
calls) whole and as typed stream events, usage, and the errors a client can make."""
from __future__ import annotations

import json

import openai
import pytest

from router_fakes import toy_generate
from test_router_migration import migration_stack  # noqa: F401 (a fixture)
from test_router_openai import client, stack  # noqa: F401 (fixtures)
from test_router_reasoning import THINKING, reference

from services.router.reasoning import END, START, count_reasoning_tokens


def client_of(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url, api_key="unused", max_retries=0, timeout=30)


def chat_ids(tokenizer, messages):
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)


def test_a_response_is_the_chat_completion_of_its_input(client, stack, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    out = client.responses.create(model="tiny", instructions="Be brief.", input="Name a colour.",
                                  max_output_tokens=6, temperature=0, metadata={"team": "a"})
    prompt = chat_ids(tokenizer, messages)
    ids, _ = toy_generate(prompt, 6)
    assert out.output_text == tokenizer.decode(ids, skip_special_tokens=True)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    (message,) = out.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert out.usage.input_tokens == len(prompt) and out.usage.output_tokens == 6
    assert out.usage.total_tokens == len(prompt) + 6 and out.usage.output_tokens_details.reasoning_tokens == 0
    assert out.model == "tiny" and out.object == "response" and out.metadata == {"team": "a"}
    assert out.instructions == "Be brief." and out.max_output_tokens == 6
    # The same conversation as items (typed or not, content as parts) is the same prompt.
    items = [{"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": "Name a colour."}]
    again = client.responses.create(model="tiny", input=items, max_output_tokens=6, temperature=0)
    assert again.output_text == out.output_text and again.usage.input_tokens == len(prompt)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == out.output_text


def test_streamed_events_build_the_same_response(client):
    kwargs = dict(model="tiny", input="Tell me a story.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text and len(deltas) > 3  # streamed as it came
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == "incomplete"
    assert final.usage.output_tokens == 12 and final.id == events[0].response.id


def test_logprobs_when_included(client, tokenizer):
    out = client.responses.create(model="tiny", input="Count.", max_output_tokens=5, temperature=0,
                                  include=["message.output_text.logprobs"], top_logprobs=2)
    lps = out.output[0].content[0].logprobs
    assert len(lps) == 5 and all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in lps)
    assert "".join(lp.token for lp in lps) == out.output_text
    streamed = [e for e in client.responses.create(model="tiny", input="Count.", max_output_tokens=5, temperature=0,
                                                   include=["message.output_text.logprobs"], top_logprobs=2,
                                                   stream=True) if e.type == "response.output_text.delta"]
    assert [lp.token for e in streamed for lp in e.logprobs] == [lp.token for lp in lps]


TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture
def calling_stack(make_stack, tokenizer):
    text = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    script = tokenizer.encode(text, add_special_tokens=False)
    return make_stack(prefill=1, decode=1, prefill_kwargs=[{"script": script}], decode_kwargs=[{"script": script}])


def test_function_calls_come_back_as_items_and_go_back_as_input(calling_stack, tokenizer):
    with client_of(calling_stack) as client:
        out = client.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, max_output_tokens=100)
        message, call = out.output
        assert message.content[0].text == "Let me check." and call.type == "function_call"
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        assert out.status == "completed" and out.tools[0].name == "get_weather" and out.tool_choice == "auto"
        with client.responses.stream(model="tiny", input="Weather in Paris?", tools=TOOLS,
                                     max_output_tokens=100) as stream:
            events = list(stream)
            final = stream.get_final_response()
        assert [i.type for i in final.output] == ["message", "function_call"] and final.status == "completed"
        assert [e.type for e in events][-1] == "response.completed"  # the SDK's helper checked every event
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert json.loads("".join(pieces)) == {"city": "Paris"} and final.output[1].name == "get_weather"
        assert len(pieces) > 1  # the arguments came as the model wrote them
        assert final.output[1].arguments == "".join(pieces) and final.output[1].status == "completed"
        # The call and its output go back as items: the assistant message carries the call, the
        # output is a tool message, as a chat completion would send them to the template.
        follow = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
                  {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
        again = client.responses.create(model="tiny", input=follow, tools=TOOLS, max_output_tokens=100)
        tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
        messages = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call.call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}]
        chat = client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=100)
        assert again.usage.input_tokens == chat.usage.prompt_tokens


def test_a_named_tool_choice_answers_with_that_call(make_stack, tokenizer):
    script = tokenizer.encode('{"city": "Oslo"}', add_special_tokens=False)
    stack = make_stack(prefill=1, decode=1, prefill_kwargs=[{"script": script}], decode_kwargs=[{"script": script}])
    choice = {"type": "function", "name": "get_weather"}
    with client_of(stack) as client:
        out = client.responses.create(model="tiny", input="Weather?", tools=TOOLS, max_output_tokens=100,
                                      tool_choice=choice)
    (call,) = out.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert out.tool_choice.name == "get_weather"
    # The engines got the function's parameters as the output's JSON schema.
    sampling = stack.decodes[0].engine.requests[-1].sampling
    assert json.loads(sampling.structured_outputs.json) == TOOLS[0]["parameters"]


@pytest.fixture
def thinking_stack(make_stack, tokenizer):
    script = tokenizer.encode(THINKING, add_special_tokens=False)
    return make_stack(prefill=1, decode=1, reasoning_parser="deepseek_r1", prefill_kwargs=[{"script": script}],
                      decode_kwargs=[{"script": script}]), script


def test_reasoning_is_an_item_of_its_own_and_counted(thinking_stack, tokenizer):
    stack, script = thinking_stack
    want_reasoning, want_content = reference(THINKING, True)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    markers = tuple(tuple(tokenizer.encode(m, add_special_tokens=False)) for m in (START, END))
    want_tokens = count_reasoning_tokens(decode, script, True, markers)  # the markers' ids: left out whole
    assert want_tokens == len(tokenizer.encode(want_reasoning, add_special_tokens=False))
    with client_of(stack) as client:
        out = client.responses.create(model="tiny", input="What is 2 + 2?", max_output_tokens=len(script) + 5)
        reasoning, message = out.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == want_reasoning
        assert message.content[0].text == want_content and out.output_text == want_content
        assert out.usage.output_tokens == len(script)
        assert out.usage.output_tokens_details.reasoning_tokens == want_tokens > 0
        with client.responses.stream(model="tiny", input="What is 2 + 2?",
                                     max_output_tokens=len(script) + 5) as stream:
            events = list(stream)
            final = stream.get_final_response()
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == want_reasoning
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want_content
        assert [i.type for i in final.output] == ["reasoning", "message"]
        # Chat completions count them too (vLLM's completion_tokens_details).
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2 + 2?"}],
                                              max_tokens=len(script) + 5)
        assert chat.usage.completion_tokens_details.reasoning_tokens == want_tokens


def test_reasoning_tokens_leave_the_markers_out():
    # One token per character: the markers are several tokens, all but their last counted.
    text = f"{START}abc{END}xyz"
    ids = list(range(len(text)))
    decode = lambda k: text[:len(k)]  # noqa: E731
    assert count_reasoning_tokens(decode, ids, False) == 3 + len(END) - 1
    assert count_reasoning_tokens(decode, ids, True) == 3 + len(END) - 1  # a redundant opening marker dropped
    # Where the router knows the markers' ids and the output holds them as such (a thinking
    # budget forces them so), the inside alone.
    by_char = (tuple(range(len(START))), tuple(range(len(START) + 3, len(START) + 3 + len(END))))
    assert count_reasoning_tokens(decode, ids, False, by_char) == 3
    assert count_reasoning_tokens(decode, ids, True, by_char) == 3
    assert count_reasoning_tokens(decode, ids[:len(START) + 5], True, by_char) == 5  # not closed: all after <think>
    # Whole-token markers (as DeepSeek-R1's and Qwen3's vocabularies have them): exactly the inside.
    pieces = ["Sure", START, "a", "b", END, "c"]
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    assert count_reasoning_tokens(decode, list(range(6)), False) == 2
    assert count_reasoning_tokens(decode, list(range(2, 6)), True) == 2  # started inside: "a", "b"
    assert count_reasoning_tokens(decode, list(range(2, 4)), True) == 2  # never closed: all of it
    assert count_reasoning_tokens(decode, [0], False) == 0
    # The same by token ids, in one pass (the markers are tokens 1 and 4), where the router knows
    # them: the counts agree, with no text decoded when the ids close the block.
    markers = ((1,), (4,))
    for ids, starts in ((list(range(6)), False), (list(range(2, 6)), True), (list(range(2, 4)), True), ([0], False)):
        assert count_reasoning_tokens(decode, ids, starts, markers) == count_reasoning_tokens(decode, ids, starts)
    assert count_reasoning_tokens(lambda ids: pytest.fail("decoded"), list(range(6)), False, markers) == 2
    # A marker written in other tokens (not its id): the text says so, and the text's count stands.
    pieces[4:] = ["</thi", "nk>", "c"]
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    assert count_reasoning_tokens(decode, list(range(2, 7)), True, ((1,), (99,))) == 3  # "a", "b", "</thi"


@pytest.mark.parametrize("body, status, param, words", [
    ({"input": "hi", "previous_response_id": "resp_x"}, 404, "previous_response_id", "does not store"),
    ({"input": "hi", "background": True}, 400, "background", "background"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input", "input_image"),
    ({"input": [{"type": "web_search_call"}]}, 400, "input", "web_search_call"),
    ({"input": []}, 400, "input", "non-empty"),
    ({}, 400, "input", "required"),
    ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, 400, "tools", "function tools"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, 400, "text.format", "text.format"),
    ({"input": "hi", "include": ["file_search_call.results"]}, 400, "include", "unknown"),
    ({"input": "hi", "max_output_tokens": 10**6}, 400, "max_output_tokens", "context length"),
    ({"input": "hi", "model": "other"}, 404, "model", "other"),
])
def test_client_errors_are_openai_errors_and_the_gateway_serves_on(stack, body, status, param, words):
    got, _, err = stack.post("/v1/responses", {"model": "tiny", **body})
    assert got == status, err
    assert err["error"]["param"] == param and words in err["error"]["message"], err
    assert stack.post("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2})[0] == 200
    assert stack.request("GET", "/v1/responses/resp_x")[0] == 404


def test_truncation_auto_drops_the_oldest_items(make_stack, tokenizer):
    stack = make_stack(prefill=1, decode=1)
    limit = stack.router.model.max_model_len
    long_turn = "word " * (limit // 2)
    items = [{"role": "user", "content": long_turn}, {"role": "assistant", "content": long_turn},
             {"role": "user", "content": "And now?"}]
    refused = stack.post("/v1/responses", {"input": items, "max_output_tokens": 4})
    assert refused[0] == 400 and refused[2]["error"]["code"] == "context_length_exceeded"
    status, _, out = stack.post("/v1/responses", {"input": items, "max_output_tokens": 4, "truncation": "auto",
                                                  "instructions": "Be brief."})
    assert status == 200, out
    # Only as many as needed: the first turn goes, the assistant's and the question stay.
    kept = chat_ids(tokenizer, [{"role": "system", "content": "Be brief."}, *items[1:]])
    assert out["usage"]["input_tokens"] == len(kept) and out["truncation"] == "auto"


def test_a_stream_that_fails_midway_ends_with_an_error_and_the_response_failed(migration_stack):
    stack = migration_stack(prefill=1, deaths=4, migration_limit=0)
    events = stack.sse("/v1/responses", {"input": "Hello", "max_output_tokens": 12, "temperature": 0, "stream": True})
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in types
    assert types[-2:] == ["error", "response.failed"], types
    assert events[-2]["code"] == "migration_limit_reached"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "migration_limit_reached"
    assert failed["output"][0]["content"][0]["text"]  # what came before the failure is kept
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_store_keeps_responses_to_continue_read_and_delete(make_stack, tokenizer):
    stack = make_stack(prefill=1, decode=1, responses_store_size=2)
    with client_of(stack) as client:
        first = client.responses.create(model="tiny", instructions="Be brief.", input="My name is Ada.",
                                        max_output_tokens=5)
        assert first.store and client.responses.retrieve(first.id).output_text == first.output_text
        # Continued: the stored conversation (its input and output; not its instructions) comes
        # before the new input.
        second = client.responses.create(model="tiny", previous_response_id=first.id, input="What is my name?",
                                         max_output_tokens=5)
        want = chat_ids(tokenizer, [{"role": "user", "content": "My name is Ada."},
                                    {"role": "assistant", "content": first.output_text},
                                    {"role": "user", "content": "What is my name?"}])
        assert second.usage.input_tokens == len(want) and second.previous_response_id == first.id
        # store false: answered, not kept.
        loose = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
        assert not loose.store
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(loose.id)
        # Only the last two are kept: a third pushes the first out.
        client.responses.create(model="tiny", input="Third", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="tiny", previous_response_id=first.id, input="?", max_output_tokens=2)
        # Delete; cancel is for background responses only (a 400 here).
        with pytest.raises(openai.BadRequestError):
            client.responses.cancel(second.id)
        client.responses.delete(second.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(second.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(second.id)


def test_a_stored_function_call_continues_with_its_output(make_stack, tokenizer):
    text = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    script = tokenizer.encode(text, add_special_tokens=False)
    stack = make_stack(prefill=1, decode=1, responses_store_size=8, prefill_kwargs=[{"script": script}],
                       decode_kwargs=[{"script": script}])
    with client_of(stack) as client:
        with client.responses.stream(model="tiny", input="Weather in Paris?", tools=TOOLS,
                                     max_output_tokens=100) as stream:
            asked = stream.get_final_response()  # a streamed response is stored too
        call = asked.output[1]
        again = client.responses.create(model="tiny", previous_response_id=asked.id, tools=TOOLS,
                                        max_output_tokens=100, input=[{"type": "function_call_output",
                                                                       "call_id": call.call_id, "output": "Sunny"}])
    tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"}]
    want = tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                          add_generation_prompt=True), add_special_tokens=False)
    assert again.usage.input_tokens == len(want)


@pytest.mark.parametrize("body", [
    {"input": 5}, {"input": [5]}, {"input": [{"role": "user", "content": 5}]},
    {"input": [{"role": "robot", "content": "x"}]}, {"input": [{"type": "function_call", "name": "f"}]},
    {"input": [{"type": "function_call_output", "output": "x"}]},
    {"input": [{"type": "reasoning", "content": [{"text": 5}]}]},
    {"input": [{"type": "reasoning", "encrypted_content": "abc"}]},
    {"input": "hi", "tools": "x"}, {"input": "hi", "tools": [{"type": "function"}]},
    {"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": 5},
    {"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function"}},
    {"input": "hi", "text": "json"}, {"input": "hi", "text": {"format": "json"}},
    {"input": "hi", "reasoning": {"effort": 5}}, {"input": "hi", "reasoning": {"effort": "huge"}},
    {"input": "hi", "metadata": {"a": 1}}, {"input": "hi", "max_output_tokens": "5"},
    {"input": "hi", "max_output_tokens": 0}, {"input": "hi", "top_logprobs": 99}, {"input": "hi", "include": "x"},
    {"input": "hi", "truncation": "sometimes"}, {"input": "hi", "temperature": "hot"}, {"input": "hi", "stream": "yes"},
    {"input": "hi", "prompt": {"id": "pmpt_1"}}, {"input": "x" * 100_000},
])
def test_malformed_responses_bodies_are_400s(stack, body):
    status, _, err = stack.post("/v1/responses", {"model": "tiny", **body})
    assert status == 400, err
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"], err
    assert stack.post("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2})[0] == 200


def test_a_streamed_call_whose_arguments_are_not_json_is_an_incomplete_item(make_stack, tokenizer):
    text = ('Checking.<tool_call>{"name": "get_weather", "arguments": {"city": tru}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    script = tokenizer.encode(text, add_special_tokens=False)
    stack = make_stack(prefill=1, decode=1, prefill_kwargs=[{"script": script}], decode_kwargs=[{"script": script}])
    events = stack.sse("/v1/responses", {"input": "Weather?", "tools": TOOLS, "max_output_tokens": 200, "stream": True})
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i.get("status")) for i in done] == [("message", "completed"), ("function_call", "incomplete"),
                                                            ("function_call", "completed")]
    final = events[-1]["response"]
    assert [i["status"] for i in final["output"]] == ["completed", "incomplete", "completed"]
    assert final["output"][0]["content"][0]["text"] == "Checking."  # the call's text is not content too
    assert json.loads(final["output"][2]["arguments"]) == {"city": "Oslo"}


def test_a_streamed_call_stands_when_text_follows_it(make_stack, tokenizer):
    """llama3_json: a call, then prose. Unstreamed the output does not parse as calls, so it is all
    content (vLLM's rule); streamed, the call has gone out by the time the prose comes, and it
    stands: a completed function_call item (a chat stream's tool call, finish_reason tool_calls),
    the prose after it a message."""
    text = '{"name": "get_weather", "parameters": {"city": "Oslo"}} Hope that helps.'
    script = tokenizer.encode(text, add_special_tokens=False)
    stack = make_stack(prefill=1, decode=1, tool_call_parser="llama3_json", prefill_kwargs=[{"script": script}],
                       decode_kwargs=[{"script": script}])
    events = stack.sse("/v1/responses", {"input": "Weather?", "tools": TOOLS, "max_output_tokens": 200, "stream": True})
    final = events[-1]["response"]
    assert [(i["type"], i["status"]) for i in final["output"]] == [("function_call", "completed"),
                                                                   ("message", "completed")]
    assert json.loads(final["output"][0]["arguments"]) == {"city": "Oslo"}
    assert final["output"][1]["content"][0]["text"] == " Hope that helps."
    chat = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 200,
            "tools": [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]}
    message = stack.post("/v1/chat/completions", chat)[2]["choices"][0]
    assert message["message"]["content"] == text and not message["message"].get("tool_calls")
    assert message["finish_reason"] == "stop"
    chunks = stack.sse("/v1/chat/completions", {**chat, "stream": True})[:-1]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls if "id" in c] == ["get_weather"]
    assert json.loads("".join(c["function"].get("arguments") or "" for c in calls)) == {"city": "Oslo"}
    assert "".join(d.get("content") or "" for d in deltas) == " Hope that helps."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
