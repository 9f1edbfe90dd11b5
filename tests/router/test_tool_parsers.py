"""The tool call formats of Qwen3-Coder, GLM-4.5, DeepSeek-V3 / V3.1 and Kimi K2 (vLLM's
`--tool-call-parser` names): outputs -> calls and content, whole and streamed, through the router;
and an assistant's tool calls reaching the chat template as templates read them."""
from __future__ import annotations

import json

import pytest

from services.router.tool_calls import ToolCallStream, ToolPlan, parse_auto, typed_value

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "ratio": {"type": "number"}, "opts": {"type": "object"}, "tags": {"type": "array"},
    "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "level": {"enum": [1, 2, 3]}}}}}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = (WEATHER, NOW)

QWEN = ("Let me check.<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=now>\n</function>\n</tool_call>")
GLM = ("Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n"
       "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>false</arg_value>\n"
       "</tool_call><tool_call>now</tool_call>")
DEEPSEEK_V3 = ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
               '{"city": "New York", "days": 3, "metric": false}\n```<｜tool▁call▁end｜>'
               "<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
DEEPSEEK_V31 = ('Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "New York", '
                '"days": 3, "metric": false}<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜>'
                "<｜tool▁calls▁end｜>")
KIMI = ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "New York", "days": 3, "metric": false}<|tool_call_end|>'
        "<|tool_call_begin|>functions.now:1"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")
FORMATS = {"qwen3_coder": QWEN, "glm45": GLM, "deepseek_v3": DEEPSEEK_V3, "deepseek_v31": DEEPSEEK_V31,
           "kimi_k2": KIMI}
WANT = [("get_weather", {"city": "New York", "days": 3, "metric": False}), ("now", {})]
X = [("get_weather", {"city": "X"})]
MARKERS = {"qwen3_coder": "<", "glm45": "<", "deepseek_v3": "<｜", "deepseek_v31": "<｜", "kimi_k2": "<|"}


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser", FORMATS)
def test_each_format_is_calls_after_its_content(parser):
    content, calls = parse_auto(parser, FORMATS[parser], TOOLS)
    assert content == "Let me check." and calls_of(calls) == WANT
    if parser == "kimi_k2":  # Kimi's header is the call's id (its template writes it back)
        assert [c["id"] for c in calls] == ["functions.get_weather:0", "functions.now:1"]
    # Cut off inside its first call (max_tokens), in a value: JSON arguments cut short are no
    # call, so the output is all content; an XML call keeps the parameters it finished (none).
    cut = FORMATS[parser][:FORMATS[parser].index("New York") + 4]
    content, calls = parse_auto(parser, cut, TOOLS)
    if parser in ("qwen3_coder", "glm45"):
        assert content == "Let me check." and calls_of(calls) == [("get_weather", {})]
        finished = FORMATS[parser][:FORMATS[parser].index("days")]  # city written, days not yet
        assert calls_of(parse_auto(parser, finished, TOOLS)[1]) == [("get_weather", {"city": "New York"})]
    else:
        assert (content, calls) == (cut, [])
    assert parse_auto(parser, "Just words.", TOOLS) == ("Just words.", [])


@pytest.mark.parametrize("parser, text", [
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"x\": \n```"),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>[1, 2]<｜tool▁call▁end｜>"),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜><｜tool▁sep｜>{}<｜tool▁call▁end｜>"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f<|tool_call_argument_begin|>{}"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{x}"),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"x": NaN}<｜tool▁call▁end｜>'),
    ("qwen3_coder", "<tool_call>\n<parameter=x>1</parameter>\n</tool_call>"),
    ("glm45", "<tool_call>\n<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>"),
])
def test_calls_that_do_not_parse_leave_the_output_as_content(parser, text):
    assert parse_auto(parser, text, TOOLS) == (text, [])


@pytest.mark.parametrize("text, schema, want", [
    ("3", {"type": "integer"}, 3), ("-12", {"type": "integer"}, -12), ("3.5", {"type": "number"}, 3.5),
    ("4", {"type": "number"}, 4), ("1e3", {"type": "number"}, 1000.0), ("nan", {"type": "number"}, "nan"),
    ("TRUE", {"type": "boolean"}, True), ("yes", {"type": "boolean"}, "yes"),
    ('{"a": [1]}', {"type": "object"}, {"a": [1]}), ("[1, 2]", {"type": "array"}, [1, 2]),
    ("[1, 2]", {"type": "object"}, "[1, 2]"), ("null", {"type": ["integer", "null"]}, None),
    ("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 7), ("2", {"enum": [1, 2]}, 2),
    ("007", {"type": "string"}, "007"), ("42", None, "42"), ("3", {"type": ["string", "integer"]}, 3),
])
def test_text_values_read_as_their_schema_types(text, schema, want):
    got = typed_value(text, schema)
    assert got == want and type(got) is type(want)


def test_xml_values_keep_their_text_but_the_template_newlines():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n  two\nlines \n</parameter>\n"
            "<parameter=unknown>\n5\n</parameter>\n<parameter=limit>\nnull\n</parameter>\n</function>\n</tool_call>")
    _, calls = parse_auto("qwen3_coder", text, TOOLS)
    assert calls_of(calls) == [("get_weather", {"city": "  two\nlines ", "unknown": "5", "limit": None})]
    # A last call cut off at the end still counts, with the parameters it finished.
    _, calls = parse_auto("qwen3_coder", "<tool_call>\n<function=now>\n", TOOLS)
    assert calls_of(calls) == [("now", {})]


@pytest.mark.parametrize("parser", FORMATS)
def test_a_stream_shows_the_content_and_holds_back_the_calls(parser):
    stream, shown = ToolCallStream(ToolPlan("auto", TOOLS, parser=parser)), ""
    text = FORMATS[parser]
    for i in range(0, len(text), 3):
        shown += stream.feed(text[i:i + 3])
        assert MARKERS[parser] not in shown
    rest, calls = stream.finish()
    assert shown + rest == "Let me check." and calls_of(calls) == WANT


def merged(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas put together by index, as OpenAI's clients do."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": None, "type": None, "function": {"name": "", "arguments": ""}})
        call["id"] = d.get("id") or call["id"]
        call["type"] = d.get("type") or call["type"]
        call["function"]["name"] += d.get("function", {}).get("name") or ""
        call["function"]["arguments"] += d.get("function", {}).get("arguments") or ""
    return [calls[k] for k in sorted(calls)]


@pytest.mark.parametrize("parser", FORMATS)
def test_a_stream_begins_each_call_at_its_name_and_sends_its_arguments_as_written(parser):
    stream, deltas = ToolCallStream(ToolPlan("auto", TOOLS, parser=parser)), []
    text = FORMATS[parser]
    first_end = text.index({"qwen3_coder": "</tool_call>", "glm45": "</tool_call>", "deepseek_v3": "<｜tool▁call▁end｜>",
                            "deepseek_v31": "<｜tool▁call▁end｜>", "kimi_k2": "<|tool_call_end|>"}[parser])
    fed = 0
    for i in range(0, len(text), 4):
        stream.feed(text[i:i + 4])
        deltas += stream.take_deltas()
        fed = i + 4
        if deltas:
            break
    # the call begins at its name, before its close
    assert fed < first_end and deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    while fed < first_end + len("</tool_call>"):  # (GLM's arguments close with the block)
        stream.feed(text[fed:fed + 4])
        deltas += stream.take_deltas()
        fed += 4
    assert len([d for d in deltas if d["index"] == 0]) > 3  # its arguments in pieces, as written
    assert fed < text.index("now")  # the first call went before the second was written
    assert calls_of(merged(deltas)) == WANT[:1]
    for i in range(fed, len(text), 4):
        stream.feed(text[i:i + 4])
        deltas += stream.take_deltas()
    _, calls = stream.finish()
    deltas += stream.take_deltas()
    assert calls_of(calls) == WANT and merged(deltas) == calls  # the same ids, names and arguments


@pytest.mark.parametrize("parser", ["qwen3_coder", "kimi_k2"])
def test_through_the_router_whole_and_streamed(make_stack, tokenizer, parser):
    script = tokenizer.encode(FORMATS[parser], add_special_tokens=False)
    stack = make_stack(prefill=1, decode=1, tool_call_parser=parser, prefill_kwargs=[{"script": script}],
                       decode_kwargs=[{"script": script}])
    body = {"messages": [{"role": "user", "content": "Weather in New York?"}], "tools": list(TOOLS),
            "max_tokens": 400}
    status, _, out = stack.post("/v1/chat/completions", body)
    assert status == 200, out
    message = out["choices"][0]["message"]
    assert message["content"] == "Let me check." and out["choices"][0]["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == WANT
    # Kimi's markers are special tokens in its tokenizer: the engines keep special tokens' text.
    assert stack.decodes[0].engine.requests[-1].sampling.skip_special_tokens is (parser != "kimi_k2")
    events = stack.sse("/v1/chat/completions", {**body, "stream": True})[:-1]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "Let me check."
    streamed = merged([c for e in events for c in e["choices"][0]["delta"].get("tool_calls") or []])
    assert calls_of(streamed) == WANT
    if parser == "kimi_k2":  # Kimi's ids are its headers: the same streamed or not
        assert [c["id"] for c in streamed] == [c["id"] for c in message["tool_calls"]]


def test_hermes_arguments_stream_through_the_router_as_written(make_stack, tokenizer):
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "New York", "days": 3}}\n'
            '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    script = tokenizer.encode(text, add_special_tokens=False)
    stack = make_stack(prefill=1, decode=1, prefill_kwargs=[{"script": script}], decode_kwargs=[{"script": script}])
    body = {"messages": [{"role": "user", "content": "Weather in New York?"}], "tools": list(TOOLS), "max_tokens": 400}
    whole = stack.post("/v1/chat/completions", body)[2]["choices"][0]["message"]["tool_calls"]
    events = stack.sse("/v1/chat/completions", {**body, "stream": True})[:-1]
    deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls") or []]
    assert calls_of(merged(deltas)) == calls_of(whole) == [("get_weather", {"city": "New York", "days": 3}),
                                                           ("now", {})]
    assert merged(deltas)[0]["function"]["arguments"] == '{"city": "New York", "days": 3}'
    # One event per piece of the arguments as the tokens came, the name first, alone.
    pieces = [d for d in deltas if d["index"] == 0]
    assert pieces[0]["function"] == {"name": "get_weather", "arguments": ""} and pieces[0]["id"].startswith("call_")
    assert len(pieces) > 3 and all("id" not in d for d in pieces[1:])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


TEMPLATE = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
            "[{{ c.function.name }}{% for k, v in c.function.arguments | items %} {{ k }}={{ v }}{% endfor %}]"
            "{% endfor %};{% endfor %}")


def test_an_assistants_tool_calls_reach_the_template_as_mappings(make_stack, tokenizer):
    """vLLM's rule: OpenAI's `arguments` JSON text becomes a mapping for the template (which
    Qwen3-Coder's iterates); arguments that are not a JSON object become {} (the turn still
    renders)."""
    stack = make_stack(prefill=1, decode=1, trust_request_chat_template=True)

    def rendered(arguments) -> str:
        messages = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
        status, _, out = stack.post("/tokenize", {"messages": messages, "chat_template": TEMPLATE,
                                                  "add_generation_prompt": False})
        assert status == 200, out
        return tokenizer.decode(out["tokens"])

    assert rendered('{"city": "Paris", "days": 3}') == "user:hi;assistant:[f city=Paris days=3];tool:ok;"
    assert rendered({"city": "Paris"}) == "user:hi;assistant:[f city=Paris];tool:ok;"
    for broken in ("{not json", "[1, 2]", "", None):
        assert rendered(broken) == "user:hi;assistant:[f];tool:ok;"
    status, _, err = stack.post("/tokenize", {"messages": [{"role": "assistant", "content": "", "tool_calls": "f"}]})
    assert status == 400 and "tool_calls must be an array" in err["error"]["message"]


def streamed_in_pieces(parser: str, text: str, step: int) -> tuple[str, list[dict], list[dict]]:
    """(the content shown, the calls at the finish, every delta) of `text` fed `step` characters at a time."""
    stream, deltas, shown = ToolCallStream(ToolPlan("auto", TOOLS, parser=parser)), [], ""
    for i in range(0, len(text), step):
        shown += stream.feed(text[i:i + step])
        deltas += stream.take_deltas()
    rest, calls = stream.finish()
    return shown + rest, calls, deltas + stream.take_deltas()


@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v31", "kimi_k2"])
def test_json_arguments_stream_as_written_cut_anywhere(parser):
    """Cut into pieces of any size, the stream's calls are the whole output's (their arguments the
    model's JSON text, as written); the text before them is the content; a call whose arguments
    are cut off is no call at the end."""
    text = FORMATS[parser]
    whole_content, whole_calls = parse_auto(parser, text, TOOLS)
    for step in (1, 2, 3, 5, 11, len(text)):
        content, calls, deltas = streamed_in_pieces(parser, text, step)
        assert content == whole_content and calls_of(calls) == calls_of(whole_calls), step
        assert merged(deltas) == calls
    cut = text[:text.index("New York") + 4]
    stream = ToolCallStream(ToolPlan("auto", TOOLS, parser=parser))
    shown = stream.feed(cut)
    rest, calls = stream.finish()
    assert calls == [] and shown + rest == "Let me check."



XML_TEXTS = {
    "qwen3_coder": ("Sure.<tool_call>\n<function=get_weather>\n<parameter=city>\nSa\"o <Paulo> \\ a < b\nsecond line"
                    "\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n"
                    "<parameter=metric>\nfalse\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n"
                    "</function>\n</tool_call>"),
    "glm45": ("Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Sa\"o <Paulo> \\ a < b\nsecond line"
              "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>opts</arg_key>\n"
              "<arg_value>{\"a\": [1, 2]}</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>false</arg_value>\n"
              "</tool_call><tool_call>now</tool_call>"),
}


@pytest.mark.parametrize("parser", XML_TEXTS)
def test_xml_arguments_stream_as_json_as_the_parameters_come(parser):
    """Each parameter as it comes: a text value piece by piece as a JSON string (quotes, newlines,
    a "<" that starts no tag), a typed one whole at its end; cut anywhere, the stream's calls are
    the whole output's."""
    text = XML_TEXTS[parser]
    whole_content, whole_calls = parse_auto(parser, text, TOOLS)
    assert calls_of(whole_calls)[0][1]["city"] == 'Sa"o <Paulo> \\ a < b\nsecond line'
    for step in (1, 2, 3, 7, 13, len(text)):
        content, calls, deltas = streamed_in_pieces(parser, text, step)
        assert content == whole_content and calls_of(calls) == calls_of(whole_calls), step
        assert merged(deltas) == calls and calls[0]["function"]["arguments"] == whole_calls[0]["function"]["arguments"]
    # The city's text streams before its parameter closes.
    stream = ToolCallStream(ToolPlan("auto", TOOLS, parser=parser))
    stream.feed(text[:text.index("second line") + 6])
    sent = "".join(d["function"].get("arguments", "") for d in stream.take_deltas())
    assert sent == '{"city": "Sa\\"o <Paulo> \\\\ a < b\\nsecond'


KIMI_CALL = "<|tool_call_begin|>functions.{}:{}<|tool_call_argument_begin|>{}"
ODD_OUTPUTS = [  # what models write now and then; the stream reads each as the whole output parses
    ("kimi_k2", "<|tool_calls_section_begin|>" + KIMI_CALL.format("now", 0, "{}")  # a call's end left out
     + KIMI_CALL.format("get_weather", 1, '{"city": "X"}') + "<|tool_call_end|>"),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁begin｜>get_weather'
     '<｜tool▁sep｜>{"city": "X"}<｜tool▁call▁end｜>'),
    ("qwen3_coder", "<tool_call>\n<function=now>\n</function>\n<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\nX\n</parameter>\n</function>\n</tool_call>"),
    ("glm45", "Hi.<tool_call>now\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>X</arg_value>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
     "</tool_call>"),  # a key without its value
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```'
     '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n{"city": "X"}<｜tool▁call▁end｜>'),  # no fence: none
]


@pytest.mark.parametrize("parser,text", ODD_OUTPUTS)
def test_odd_outputs_stream_as_they_parse_whole(parser, text):
    whole_content, whole_calls = parse_auto(parser, text, TOOLS)
    for step in (1, 2, 5, len(text)):
        content, calls, deltas = streamed_in_pieces(parser, text, step)
        assert calls_of(calls) == calls_of(whole_calls), step
        assert content.strip() == (whole_content or "").strip() or not whole_calls, step


TRAILED = [  # text after a call's arguments: no call whole; streamed, the call has begun and stands
    ("deepseek_v31", 'Hi.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "X"}}'
     '<｜tool▁call▁end｜>', "Hi.", X),
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
     '{"city": "X"}\n``` and so<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```\n{}'
     '<｜tool▁call▁end｜>', "", X + [("now", {})]),
    ("kimi_k2", "<|tool_calls_section_begin|>" + KIMI_CALL.format("get_weather", 0, '{"city": "X"} and so')
     + "<|tool_call_end|>" + KIMI_CALL.format("now", 1, "{}") + "<|tool_call_end|>", "", X + [("now", {})]),
]


@pytest.mark.parametrize("parser,text,content,want", TRAILED)
def test_a_call_begun_on_the_stream_stands_with_text_after_its_arguments(parser, text, content, want):
    """The whole output leaves such a call out; a stream has sent it by then (id, name and
    arguments), so it stands as sent, as under every parser (the text after it is not content)."""
    assert [c[0] for c in calls_of(parse_auto(parser, text, TOOLS)[1])] == [name for name, _ in want[1:]]
    for step in (1, 2, 5, len(text)):
        got, calls, deltas = streamed_in_pieces(parser, text, step)
        assert (got, calls_of(calls)) == (content, want) and merged(deltas) == calls, step


def test_a_value_cut_by_the_blocks_end_reads_the_same_whatever_the_pieces():
    text = "Hi.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>"
    got = {json.dumps(calls_of(streamed_in_pieces("qwen3_coder", text, step)[1])) for step in (1, 2, 3, 5, 7, 11, 99)}
    assert len(got) == 1


def test_hermes_reads_nan_as_python_does():
    text = '<tool_call>{"name": "get_weather", "arguments": {"ratio": NaN}}</tool_call>'
    assert [c["function"]["name"] for c in streamed_in_pieces("hermes", text, 3)[1]] == ["get_weather"]


class _AnyId:
    def __eq__(self, other) -> bool:
        return isinstance(other, str) and len(other) > 0


ANY_ID = _AnyId()

SEQUENCES = {  # whole-output and untagged-end formats: Llama 3's JSON, Mistral's two, pythonic
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "New York", "days": 3, '
                    '"metric": false}}; {"name": "now", "parameters": {}}'),
    "mistral": ('Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "New York", "days": 3, "metric": false}'
                "[TOOL_CALLS]now[ARGS]{}"),
    "mistral-array": ('Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "New York", '
                      '"days": 3, "metric": false}}, {"name": "now", "arguments": {}, "id": "a1b2c3d4e"}]'),
    "pythonic": '<|python_start|>[get_weather(city="New York", days=3, metric=False), now()]<|python_end|>',
}


@pytest.mark.parametrize("name", SEQUENCES)
def test_llama_mistral_and_pythonic_calls_stream_as_they_come_cut_anywhere(name):
    """Cut into pieces of any size, the stream's calls are the whole output's (Llama 3's and
    Mistral's arguments the model's JSON text as written), its content the text before them; and
    the first call is on the stream before the output ends: its arguments in pieces as written
    (pythonic: whole, once its parenthesis closes, before the next is written)."""
    parser, text = name.split("-")[0], SEQUENCES[name]
    whole_content, whole_calls = parse_auto(parser, text, TOOLS)
    assert calls_of(whole_calls) == WANT
    for step in (1, 2, 3, 5, 11, len(text)):
        content, calls, deltas = streamed_in_pieces(parser, text, step)
        assert content == (whole_content or "") and calls_of(calls) == WANT, step
        assert merged(deltas) == calls, step
        if parser == "mistral":
            assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    stream = ToolCallStream(ToolPlan("auto", TOOLS, parser=parser))
    if parser == "pythonic":
        stream.feed(text[:text.index("now")])
        assert calls_of(merged(stream.take_deltas())) == WANT[:1]
    else:
        stream.feed(text[:text.index("New York") + 4])
        assert merged(stream.take_deltas()) == [{"id": ANY_ID, "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "New '}}]

SEQUENCE_ODDITIES = [  # each read by the stream as the whole output parses it
    ("llama3_json", '{"parameters": {"city": "X"}, "name": "get_weather"}; {"name": "now", "parameters": {}}'),
    ("llama3_json", '{"name": "get_weather", "arguments": "{\\"city\\": \\"X\\"}"}'),  # arguments as a string
    ("llama3_json", '{"name": "now", "parameters": {}};'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "a}b{\\"c"}, "extra": [1, {"d": 2}]}'),
    ("mistral", "[TOOL_CALLS]now[CALL_ID]abcdefghi[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{\"city\": \"]\"}"),
    ("mistral", '[TOOL_CALLS][{"arguments": {}, "name": "now"}, {"name": "get_weather", "arguments": {"city": "X"}}]'),
    # a part the stream cannot read (arguments not an object, a name with markup, an array
    # between v11 calls, a second tag): it and the calls after it at the finish, in order
    ("mistral", "[TOOL_CALLS]now[ARGS][1][TOOL_CALLS]get_weather[ARGS]{}"),
    ("mistral", "[TOOL_CALLS]get<x>[ARGS]{}[TOOL_CALLS]now[ARGS]{}"),
    ("mistral", '[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS][{"name": "now", "arguments": {}}][TOOL_CALLS]get_weather'
                '[ARGS]{"city": "X"}'),
    ("mistral", '[TOOL_CALLS] [TOOL_CALLS]get_weather[ARGS]{"city": "X"}'),
    ("pythonic", '[get_weather(city="a), ]b\\"c", days=(3)), now()]'),
    ("pythonic", "[now(), get_weather(city='''x)''')]"),
    ("pythonic", "[get_weather(city=open('/etc/passwd'))]"),  # no call begun: content, whole
]


@pytest.mark.parametrize("parser,text", SEQUENCE_ODDITIES)
def test_odd_sequences_stream_as_they_parse_whole(parser, text):
    whole_content, whole_calls = parse_auto(parser, text, TOOLS)
    for step in (1, 2, 3, 5, len(text)):
        content, calls, deltas = streamed_in_pieces(parser, text, step)
        assert calls_of(calls) == calls_of(whole_calls) and content == (whole_content or ""), step
        if whole_calls:
            assert merged(deltas) == calls, step


STREAMED_CALLS_STAND = [  # outputs that do not parse whole (all content, unstreamed) after calls began on the stream
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "X"}} and then some', " and then some", X),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "X"}};  and so', "  and so", X),
    ("mistral", 'Hi.[TOOL_CALLS]get_weather[ARGS]{"city": "X"} trailing', "Hi. trailing", X),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "X"}!![TOOL_CALLS]now[ARGS][1]', "!![TOOL_CALLS]now[ARGS][1]", X),
    ("mistral", "[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]Sorry, let me explain instead.",
     "[TOOL_CALLS]Sorry, let me explain instead.", [("now", {})]),
    ("pythonic", "[now(), and so on", " and so on", [("now", {})]),
    # an object the stream could not follow (its head past 4,096 characters), then prose: content
    ("llama3_json", '{"name": "now", "parameters": {}}; {"parameters": {"city": "' + "a" * 5000
     + '"}, "name": "get_weather"} tail', ' {"parameters": {"city": "' + "a" * 5000 + '"}, "name": "get_weather"} tail',
     [("now", {})]),
    ("mistral", '[TOOL_CALLS][{"name": "now", "arguments": {}}] and more', " and more", [("now", {})]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "X"}}, 7]', " 7]", X),
    ("pythonic", "[get_weather(city='X'), 1]", " 1]", X),
    ("pythonic", "[get_weather(city='X'), 1]<|python_end|>", " 1]", X),
    ("pythonic", "<|python_start|>[get_weather(city='X')]<|python_end|> text", " text", X),
    ("pythonic", "[now()", "", [("now", {})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"ratio": NaN}} tail', " tail",
     [("get_weather", {"ratio": float("nan")})]),
    # cut off after its arguments, before the object's end: its arguments are complete, it stands
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "X"}}; {"name": "now", "parameters": {}', "",
     X + [("now", {})]),
    ("mistral", '[TOOL_CALLS][{"name": "now", "arguments": {}', "", [("now", {})]),
    # an object that says two things is no call whole; streamed, the reading the stream sent stands
    ("llama3_json", '{"name": "get_weather", "arguments": {"city": "X"}, "parameters": {"city": "Y"}}', "", X),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "X"}, "name": "now"}', "", X),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "parameters": {"city": "X"}, "arguments": {"city": "Y"}}]',
     "", X),
]


@pytest.mark.parametrize("parser,text,content,want", STREAMED_CALLS_STAND)
def test_calls_begun_on_the_stream_stand_when_the_output_does_not_parse_whole(parser, text, content, want):
    """vLLM's streams keep the calls they sent; so do these: the answer's calls are the ones the
    stream sent (ids, arguments as written), the text after them content, however the output
    comes in pieces. Unstreamed, the same output is content, whole (vLLM's rule)."""
    assert parse_auto(parser, text, TOOLS) == (text, [])
    for step in (1, 2, 3, 5, len(text)):
        got, calls, deltas = streamed_in_pieces(parser, text, step)
        assert (got, json.dumps(calls_of(calls))) == (content, json.dumps(want)), step  # (NaN == NaN as text)
        assert merged(deltas) == calls, step


@pytest.mark.parametrize("parser,text", [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "X"'),
    ("llama3_json", '{"name": "now", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "X"'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "X"'),
    ("mistral", '[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "X"'),
])
def test_a_call_cut_off_on_the_stream_is_no_call_and_no_content(parser, text):
    """Cut off by max_tokens inside its arguments: the call has begun on the stream but is no call
    in the answer, and its text is not content as well; the calls before it stand."""
    for step in (1, 3, len(text)):
        got, calls, deltas = streamed_in_pieces(parser, text, step)
        begun = [d["function"]["name"] for d in merged(deltas)]
        assert got == "" and begun[-1] == "get_weather", step
        assert [c["function"]["name"] for c in calls] == begun[:-1], step


@pytest.mark.parametrize("parser,text", [
    ("llama3_json", '{"name": "now", "parameters": {}}; {"name": "get_wea'),
    ("llama3_json", '{"name": "now", "parameters": {}}; {"na'),
    ("pythonic", "[now(), get_weather(city='Osl"),
    ("pythonic", "<|python_start|>[now(), get_wea"),
    ("mistral", '[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]get_wea'),
    ("mistral", '[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]get_weather[ARGS]'),
    ("mistral", '[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]get_weather[CALL_ID]ab'),
    ("mistral", '[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]get_weather[AR'),
    ("mistral", '[TOOL_CALLS][{"name": "now", "arguments": {}}, {"name": "get'),
])
def test_a_call_cut_off_before_the_stream_began_it_is_not_content(parser, text):
    """Cut off before its head was out (the stream had not begun it): no call, and its fragment of
    call syntax is not content either; the calls before it stand."""
    for step in (1, 2, 5, len(text)):
        got, calls, deltas = streamed_in_pieces(parser, text, step)
        assert (got, calls_of(calls)) == ("", [("now", {})]) and merged(deltas) == calls, step


QWEN_BARE = QWEN.replace("<tool_call>\n", "").replace("\n</tool_call>", "")


@pytest.mark.parametrize("text, content, want", [
    (QWEN_BARE, "Let me check.", WANT),
    # the first marker decides: bare first, a block after it still holds a call
    ("Hi <function=now></function> then <tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n"
     "</function>\n</tool_call>", "Hi", [("now", {}), ("get_weather", {"city": "X"})]),
    ("A <function word, no call", "A <function word, no call", []),
    # a bare tag that names none of the request's tools is prose
    ("Write `<function=foo>` in HTML? no.", "Write `<function=foo>` in HTML? no.", []),
    ("The syntax is <function=NAME>.\n<tool_call>\n<function=now>\n</function>\n</tool_call>",
     "The syntax is <function=NAME>.", [("now", {})]),
    # a bare call ends where the next begins; a value is text, </tool_call> in it included
    ("<function=get_weather><parameter=city>x<function=now></function>", "", [("get_weather", {"city": "x"}),
                                                                            ("now", {})]),
    ("<function=get_weather>\n<parameter=city>\nParis</tool_call>x\n</parameter>\n</function>", "",
     [("get_weather", {"city": "Paris</tool_call>x"})]),
    ("Use <function=foo> tags. <function=now></function>", "Use <function=foo> tags.", [("now", {})]),
    ("<function=\nnow></function>", "<function=\nnow></function>", []),  # a name has no newline
    ("<function=now\n></function>", "<function=now\n></function>", []),
])
def test_qwen3_coder_calls_without_their_tool_call_blocks(text, content, want):
    """Qwen3-Coder models now and then leave out `<tool_call>`: a `<function=NAME>...</function>`
    before any `<tool_call>` is a call (vLLM reads it so), whole and streamed in pieces of any size,
    the text before it content; `<function` alone is text."""
    got_content, calls = parse_auto("qwen3_coder", text, TOOLS)
    assert ((got_content or ""), calls_of(calls)) == (content, want)
    for step in (1, 2, 3, 7, len(text)):
        shown, calls, deltas = streamed_in_pieces("qwen3_coder", text, step)
        assert shown.strip() == content and calls_of(calls) == want, step
        assert merged(deltas) == calls, step
    if text == QWEN_BARE:  # the call begins at its name, the city's text streaming before its parameter closes
        stream = ToolCallStream(ToolPlan("auto", TOOLS, parser="qwen3_coder"))
        assert stream.feed(text[:text.index("New York") + 4]) == "Let me check."
        assert merged(stream.take_deltas()) == [{"id": ANY_ID, "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "New '}}]


@pytest.mark.parametrize("parser, text", [
    ("kimi_k2", "Use <|tool_call_begin|>functions.now:0<|tool_call_argument_begin|>{}<|tool_call_end|> ok"
     + KIMI.split("Let me check.")[1]),
    ("deepseek_v31", "Use <｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜> ok" + DEEPSEEK_V31.split("Let me check.")[1]),
])
def test_a_call_marker_written_before_the_calls_section_is_content(parser, text):
    """A model quoting a call's marker in prose before its calls' section: the quote is content,
    the section's calls the calls, whole and streamed."""
    content, calls = parse_auto(parser, text, TOOLS)
    assert content.startswith("Use ") and content.endswith(" ok") and calls_of(calls) == WANT
    for step in (1, 2, 5, len(text)):
        shown, calls, deltas = streamed_in_pieces(parser, text, step)
        assert (shown, calls_of(calls)) == (content, WANT) and merged(deltas) == calls, step


@pytest.mark.parametrize("parser, text", [
    ("mistral", "[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]now[ARGS]" + " " * 5000 + "{}"),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>" + "\n " * 2500 + "{}<｜tool▁call▁end｜>"),
    ("kimi_k2", "<|tool_calls_section_begin|>" + KIMI_CALL.format("now", 0, " " * 5000 + "{}") + "<|tool_call_end|>"),
    ("hermes", "<tool_call>" + "\n " * 2500 + '{"name": "now", "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "now", "arguments":' + " " * 5000 + "{}}</tool_call>"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n" + " " * 3000
     + "```json\n{}\n```<｜tool▁call▁end｜>"),
])
def test_whitespace_between_a_separator_and_the_arguments_is_read_once(parser, text):
    """A model writing a long run of whitespace after `[ARGS]` / its separator (Hermes: before its
    object or its arguments; DeepSeek-V3: before its fence): each feed reads on from where the
    last stopped (it re-read the run every piece: 40k spaces a character at a time
    held the router's event loop for 49 s), and the call is the whole output's whatever the pieces."""
    whole = calls_of(parse_auto(parser, text, TOOLS)[1])
    assert whole and whole[-1] == ("now", {})
    for step in (1, 2, 7, len(text)):
        _, calls, deltas = streamed_in_pieces(parser, text, step)
        assert calls_of(calls) == whole and merged(deltas) == calls, step


DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n"
LONG_HEADS = [  # (parser, text, the content shown, the calls)
    ("hermes", '<tool_call>{"name": "' + "{" * 6000 + '", "arguments": {"a": 1}}</tool_call> ok', "ok",
     [("{" * 6000, {"a": 1})]),
    ("hermes", '<tool_call>{"name": "' + "{" * 3000 + '", "arguments": {"a": 1}}</tool_call>', "",
     [("{" * 3000, {"a": 1})]),
    ("mistral", '[TOOL_CALLS][{"name": "' + "{" * 3000 + '", "arguments": {"a": 1}}]', "", [("{" * 3000, {"a": 1})]),
    ("hermes", '<tool_call>{"name": "now", "arguments":' + " " * 5000 + '{"a": 1}} junk</tool_call>', "",
     [("now", {"a": 1})]),
    ("hermes", 'Hi <tool_call>{"name": "' + "x" * 5000 + '", "arguments": {"a": ', "Hi", []),
    ("llama3_json", '{"name": "now", "arguments":' + " " * 5000 + '{"a": 1}}', "", [("now", {"a": 1})]),
    ("llama3_json", '{"name": "now", "arguments":' + " " * 5000 + '{"a": 1}}; {"name": "now", "arguments": {}} and',
     "and", [("now", {"a": 1}), ("now", {})]),
    ("llama3_json", '{"name": "now", "arguments":' + " " * 5000 + '{"a": ', "", []),
    ("mistral", '[TOOL_CALLS][{"name": "now", "arguments":' + " " * 5000 + '{"a": 1}}, {"name": "now", "arguments": {}}]',
     "", [("now", {"a": 1}), ("now", {})]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>" + DS_CALL + " " * 6000 + '```json\n{"a": 1}\n```<｜tool▁call▁end｜>'
     "<｜tool▁calls▁end｜>", "", [("now", {"a": 1})]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>" + DS_CALL + " " * 5000 + '```json\n{"a": 1}\n```' + DS_CALL
     + "```json\n{}\n```<｜tool▁call▁end｜>", "", [("now", {"a": 1}), ("now", {})]),
]


@pytest.mark.parametrize("parser, text, content, want", LONG_HEADS)
def test_a_head_longer_than_the_stream_follows_is_read_at_its_close(parser, text, content, want):
    """A call's head past 4,096 characters (a name of braces; a run of whitespace inside the head
    or before DeepSeek-V3's fence): the stream stops reading it at every piece (each reading was
    the whole head again) and reads it once when its block (Llama's and Mistral's array's: its
    object) closes or the output ends; a name of
    braces below that is read again only at a brace after the head's markup (`:`, the fence): the
    same content and calls as the text fed whole, whatever the pieces."""
    def reading(step):
        shown, streamed, deltas = streamed_in_pieces(parser, text, step)
        return shown.strip(), calls_of(streamed), [d["function"] for d in merged(deltas)]
    whole = reading(len(text))
    assert whole[:2] == (content, want)
    for step in (1, 3, 7):
        assert reading(step) == whole, step


@pytest.mark.parametrize("parser, text", [
    ("hermes", 'Hi <tool_call>{"name": "now", "arguments": [1]}</tool_call>'),
    ("hermes", 'Hi <tool_call>{"name": "now", "arguments": "x"}</tool_call>'),
    ("llama3_json", '{"name": "now", "parameters": 5}'),
    ("llama3_json", '{"name": "now", "parameters": "[1]"}'),
    ("mistral", "[TOOL_CALLS]now[ARGS][1]"),
    ("mistral", '[TOOL_CALLS][{"name": "now", "arguments": true}]'),
])
def test_arguments_that_are_not_an_object_make_no_call(parser, text):
    """A call's arguments are an object's JSON (clients pass them as keyword arguments): a list, a
    number, or a string that does not hold an object makes no call, whole (where vLLM's parsers
    pass them on) and streamed alike: the output is content, as written."""
    assert parse_auto(parser, text, TOOLS) == (text, [])
    for step in (1, 4, len(text)):
        shown, calls, _ = streamed_in_pieces(parser, text, step)
        assert (shown, calls) == (text, []), step


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": "now", "arguments": null}</tool_call>'),
    ("hermes", '<tool_call>{"name": "now", "arguments": "{\\"a\\": 1}"}</tool_call>'),
    ("llama3_json", '{"name": "now", "parameters": null}'),
    ("mistral", '[TOOL_CALLS][{"name": "now", "arguments": null}]'),
    ("mistral", '[TOOL_CALLS][{"name": "now"}]'),
])
def test_null_arguments_are_none_and_a_string_holding_an_object_is_kept(parser, text):
    """null (or no arguments at all) is a call without arguments (`{}`); arguments written as a
    string holding an object's JSON are that object's text, as written."""
    want = [("now", {"a": 1} if '\\"a\\": 1' in text else {})]
    content, calls = parse_auto(parser, text, TOOLS)
    assert (content, calls_of(calls)) == (None, want)
    for step in (1, 4, len(text)):
        shown, streamed, deltas = streamed_in_pieces(parser, text, step)
        assert (shown, calls_of(streamed)) == ("", want) and merged(deltas) == streamed, step


def test_mistral_arguments_that_are_not_an_object_after_a_call_are_content():
    """Tokenizer v11: a second call whose arguments are a number (the output ends there) is no
    call cut off in its head: it is content, and the first call, streamed, stands."""
    text = "[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]now[ARGS]5"
    assert parse_auto("mistral", text, TOOLS) == (text, [])
    for step in (1, 3, len(text)):
        shown, calls, _ = streamed_in_pieces("mistral", text, step)
        assert (shown, calls_of(calls)) == ("[TOOL_CALLS]now[ARGS]5", [("now", {})]), step
