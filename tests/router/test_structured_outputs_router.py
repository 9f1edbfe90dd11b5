"""The gateway's side of structured outputs and tools: request fields -> one constraint (or a 400
before any engine sees it), and generated text -> OpenAI tool_calls."""
from __future__ import annotations

import json

import pytest

from services.router.errors import RouterError
from services.router.structured_outputs import parse_structured_outputs
from services.router.tool_calls import PARSE, ToolCallStream, ToolPlan, parse_hermes, parse_tools

F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                   "properties": {"x": {"type": "integer"}}}}}
G = {"type": "function", "function": {"name": "g"}}


@pytest.mark.parametrize("body, kind, spec", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"},
                                                                 "strict": True}}}, "json", '{"type": "object"}'),
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, "json", '{"type": "integer"}'),
    ({"guided_json": {"type": "array"}}, "json", '{"type": "array"}'),
    ({"guided_choice": ["a", "b"]}, "choice", '["a", "b"]'),
    ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
])
def test_every_spelling_becomes_one_constraint(body, kind, spec):
    params = parse_structured_outputs(body)
    assert (params.kind, params.spec) == (kind, spec)


def test_options_without_a_kind_apply_to_the_constraint_given_elsewhere():
    params = parse_structured_outputs({"response_format": {"type": "json_object"},
                                       "structured_outputs": {"disable_any_whitespace": True},
                                       "guided_decoding_backend": "llguidance"})
    assert params.json_object and params.disable_any_whitespace and params.backend == "llguidance"
    assert parse_structured_outputs({"response_format": {"type": "text"}}) is None
    assert parse_structured_outputs({}) is None


@pytest.mark.parametrize("body, param, words", [
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "only one"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}}, "structured_outputs",
     "only one"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json", "invalid JSON schema"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a(?=b)"}, "guided_regex", "look-around"),
    ({"guided_choice": "yes"}, "guided_choice", "list of strings"),
    ({"structured_outputs": {"choice": ["a"], "backend": "outlines"}}, "structured_outputs", "backend"),
    ({"structured_outputs": {"grammar": "root ::= (\"a\"", "backend": "llguidance"}}, "structured_outputs", "grammar"),
])
def test_bad_constraints_are_400s_naming_the_field(body, param, words):
    with pytest.raises(RouterError) as info:
        parse_structured_outputs(body)
    assert info.value.status == 400 and info.value.param == param
    assert words in info.value.message


def test_tool_choice_constrains_to_the_function_or_an_array_of_calls():
    import jsonschema

    named = parse_tools({"tools": [F, G], "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert json.loads(named.schema(True)) == F["function"]["parameters"]
    required = json.loads(parse_tools({"tools": [F, G], "tool_choice": "required"}).schema(False))
    jsonschema.validate([{"name": "f", "arguments": {"x": 3}}], required)
    jsonschema.validate([{"name": "g", "arguments": {}}], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}], required)  # maxItems 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "h", "arguments": {}}], required)
    assert parse_tools({"tools": [F]}).mode == "auto"
    assert parse_tools({"tools": [F], "tool_choice": "none"}) is None
    assert parse_tools({}) is None
    # A tool_choice schema and another constraint at once: one too many.
    with pytest.raises(RouterError, match="only one"):
        parse_structured_outputs({"response_format": {"type": "json_object"}}, named.schema(True))


@pytest.mark.parametrize("body, words", [
    ({"tools": [F], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ({"tools": [F], "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": [{"type": "function", "function": {}}]}, "name"),
    ({"tools": [F, F]}, "same name"),
    ({"tool_choice": "required"}, "needs tools"),
])
def test_bad_tools_are_400s(body, words):
    with pytest.raises(RouterError, match=words):
        parse_tools(body)


def test_constrained_outputs_become_tool_calls():
    named = ToolPlan("named", (F,), "f")
    content, (call,) = named.tool_calls('{"x": 1}')
    assert content is None and call["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert call["type"] == "function" and call["id"].startswith("call_")
    required = ToolPlan("required", (F, G))
    content, calls = required.tool_calls('[{"name": "g", "arguments": {}}, {"name": "f", "arguments": {"x": 2}}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("g", {}), ("f", {"x": 2})]
    assert named.tool_calls('{"x": 1') == ('{"x": 1', [])  # cut off by max_tokens: content, no call


def test_hermes_parser_splits_calls_from_content():
    text = ('Let me check. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("f", '{"x": 1}'), ("g", "{}")]
    assert parse_hermes("no calls here") == ("no calls here", [])
    content, calls = parse_hermes("<tool_call>not json</tool_call>")
    assert calls == [] and "not json" in content


def test_streaming_auto_holds_back_a_tag_and_reports_calls_at_the_end():
    text = 'Hi <tool_call>{"name": "f", "arguments": {"x": 5}}</tool_call>'
    stream, shown = ToolCallStream(ToolPlan("auto", (F,))), ""
    for i in range(0, len(text), 2):
        shown += stream.feed(text[i:i + 2])
        assert "<" not in shown
    rest, calls = stream.finish()
    assert (shown + rest).strip() == "Hi" and json.loads(calls[0]["function"]["arguments"]) == {"x": 5}
    plain = ToolCallStream(ToolPlan("auto", (F,)))
    shown = "".join(plain.feed(c) for c in "a < b <tool")
    assert shown + plain.finish()[0] == "a < b <tool"


def test_a_hermes_call_streams_its_name_then_its_arguments_as_written():
    from test_tool_parsers import merged

    arguments = '{"x": 5, "note": "a } and a \\"{\\" in a string", "list": [1, {"y": []}]}'
    text = f'Hi <tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>\n' \
           '<tool_call>{"arguments": {}, "name": "g"}</tool_call>'
    for step in (1, 3, 7):
        stream, deltas, shown = ToolCallStream(ToolPlan("auto", (F, G))), [], ""
        before_close = None
        for i in range(0, len(text), step):
            shown += stream.feed(text[i:i + step])
            deltas += stream.take_deltas()
            if i + step <= text.index("</tool_call>"):  # the block not closed yet
                before_close = list(deltas)
        rest, calls = stream.finish()
        deltas += stream.take_deltas()
        assert (shown + rest).strip() == "Hi"
        assert [c["function"]["name"] for c in calls] == ["f", "g"] and merged(deltas) == calls
        assert calls[0]["function"]["arguments"] == arguments  # the model's text, as written
        assert json.loads(calls[1]["function"]["arguments"]) == {}  # another shape: sent whole at its close
        # Before the block closed, the call had begun (id and name) and its arguments were coming.
        assert before_close and before_close[0]["function"] == {"name": "f", "arguments": ""}
        assert len([d for d in deltas if d["index"] == 0]) > 2
        assert arguments.startswith("".join(d["function"]["arguments"] for d in before_close))
    # Cut off in its arguments (max_tokens): the call had begun, but it is no call at the end.
    stream = ToolCallStream(ToolPlan("auto", (F,)))
    cut = 'Hi <tool_call>{"name": "f", "arguments": {"x": '
    shown = stream.feed(cut)
    assert stream.take_deltas()[0]["function"]["name"] == "f"
    rest, calls = stream.finish()
    assert calls == [] and shown + rest == "Hi "  # nor is its text content: the stream showed it as a call


def test_a_migrated_request_tells_the_engine_where_its_grammar_resumes():
    from services.api.pdserve.v1 import pdserve_pb2 as pb
    from services.router.dispatcher import continued_sampling

    sampling = pb.SamplingParams(max_tokens=50, structured_outputs=pb.StructuredOutputs(regex="a+"))
    once = continued_sampling(sampling, 7)
    assert once.resumed_tokens == 7 and once.max_tokens == 43 and once.structured_outputs.regex == "a+"
    assert continued_sampling(once, 5).resumed_tokens == 12  # moved twice: the grammar saw both parts
    assert not continued_sampling(pb.SamplingParams(max_tokens=5), 2).HasField("structured_outputs")


def test_a_migrated_request_tells_the_engine_which_prompt_tokens_are_its_output():
    """Penalties and bad words on the output keep counting what was generated before the move."""
    from services.api.pdserve.v1 import pdserve_pb2 as pb
    from services.router.dispatcher import continued_sampling

    sampling = pb.SamplingParams(max_tokens=50, min_tokens=10, frequency_penalty=1.0)
    once = continued_sampling(sampling, 7)
    assert (once.resumed_tokens, once.max_tokens, once.min_tokens) == (7, 43, 3)
    assert continued_sampling(once, 5).resumed_tokens == 12  # moved twice: both parts are output


def test_tools_reach_the_chat_template(tiny_llama):
    """tool_choice auto (and the constrained ones) render the tools as the model's template wants."""
    from services.router.served_model import ServedModel

    model = ServedModel(tiny_llama, "tiny")
    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}"
    text = model.chat_text([{"role": "user", "content": "hi"}], False, False, {}, template, tools=[F, G])
    assert model.decode(model.encode(text, add_special_tokens=False)) == "[f][g]hi"


LLAMA = '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": {}}'
PYTHONIC = '[f(x=1, y="a b", z=[True, None]), g()]'


@pytest.mark.parametrize("parser, text, calls", [
    ("llama3_json", LLAMA, [("f", {"x": 1}), ("g", {})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": 2}}', [("f", {"x": 2})]),
    ("llama3_json", '  {"name": "f", "arguments": "{\\"x\\": 3}"}\n', [("f", {"x": 3})]),
    ("pythonic", PYTHONIC, [("f", {"x": 1, "y": "a b", "z": [True, None]}), ("g", {})]),
    ("pythonic", '<|python_start|>[f(x=4)]<|python_end|>', [("f", {"x": 4})]),
])
def test_llama3_json_and_pythonic_outputs_are_calls(parser, text, calls):
    content, got = PARSE[parser](text)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls


@pytest.mark.parametrize("parser, text", [
    ("llama3_json", "The answer is 4."),
    ("llama3_json", 'Sure: {"name": "f", "parameters": {}}'),  # prose first: content, whole
    ("llama3_json", '{"name": "f", "parameters": {}} and then some'),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1'),  # cut off by max_tokens
    ("llama3_json", '{"city": "Paris"}'),  # JSON, but not a call
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[f(1)]"),  # a positional argument names nothing
    ("pythonic", "[f(x=open('/etc/passwd'))]"),  # not a literal: never evaluated
    ("pythonic", "[f(x=1e999)]"),  # infinity: no JSON
    ("pythonic", "[f(x=1), "),
    ("pythonic", "I would call [f(x=1)]"),
])
def test_other_outputs_stay_content(parser, text):
    assert PARSE[parser](text) == (text, [])


@pytest.mark.parametrize("parser, text, want_content, want_calls", [
    ("llama3_json", LLAMA, "", ["f", "g"]),
    ("llama3_json", "  <|python_tag|> " + LLAMA, "", ["f", "g"]),
    ("llama3_json", "It is sunny, {not a call}.", "It is sunny, {not a call}.", []),
    # (a call cut off after it began on the stream: tests/router/test_tool_parsers.py, no call and no content)
    ("pythonic", PYTHONIC, "", ["f", "g"]),
    ("pythonic", "[not, a, call]", "[not, a, call]", []),
    ("pythonic", "No tools needed.", "No tools needed.", []),
])
def test_streamed_llama3_json_and_pythonic_match_the_whole(parser, text, want_content, want_calls):
    """Cut anywhere, a stream shows the content (as it comes when the output is not calls) and
    the calls `finish()` returns, as the whole output parses."""
    plan = ToolPlan("auto", (F, G), parser=parser)
    whole_content, whole_calls = plan.tool_calls(text)
    assert (whole_content or "", [c["function"]["name"] for c in whole_calls]) == (want_content, want_calls)
    for step in (1, 2, 5, len(text)):
        stream, shown = ToolCallStream(plan), []
        shown = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)]
        rest, calls = stream.finish()
        assert "".join(shown) + rest == want_content and [c["function"]["name"] for c in calls] == want_calls
        if step < len(text) and want_content and not text.lstrip().startswith(("{", "[")):
            assert "".join(shown[:-1])  # prose streams as it comes, not at the end


def test_the_tool_call_parser_is_a_router_flag(make_stack, tokenizer):
    from services.router.config import RouterConfig

    with pytest.raises(ValueError, match="unknown --tool-call-parser 'granite'"):
        RouterConfig(model="tiny", served_model_name="tiny", decode=("127.0.0.1:1",), tool_call_parser="granite")
    script = tokenizer.encode('{"name": "f", "parameters": {"x": 7}}', add_special_tokens=False)
    stack = make_stack(prefill=1, decode=1, tool_call_parser="llama3_json", prefill_kwargs=[{"script": script}],
                       decode_kwargs=[{"script": script}])
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [F], "max_tokens": 100}
    message = stack.post("/v1/chat/completions", body)[2]["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "f"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"x": 7}
    events = stack.sse("/v1/chat/completions", {**body, "stream": True})[:-1]
    calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls if "id" in c] == ["f"] and {c["index"] for c in calls} == {0}
    assert len(calls) > 2  # its arguments in pieces as the model writes them
    assert json.loads("".join(c["function"].get("arguments") or "" for c in calls)) == {"x": 7}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_tool_choice_can_be_turned_off_as_vllm_without_the_flag(make_stack, tiny_model_path, monkeypatch):
    """--enable-auto-tool-choice is on by default (vLLM command lines carry it); with
    --no-enable-auto-tool-choice, tool_choice "auto" (the default with tools) is a 400, and
    "required", a named function and "none" are served."""
    from router_harness import router_config

    def config(*argv):
        return router_config(tiny_model_path, *argv)

    assert config().enable_auto_tool_choice and config("--enable-auto-tool-choice").enable_auto_tool_choice
    assert not config("--no-enable-auto-tool-choice").enable_auto_tool_choice
    monkeypatch.setenv("PDSERVE_ROUTER_ENABLE_AUTO_TOOL_CHOICE", "false")
    assert not config().enable_auto_tool_choice
    stack = make_stack(prefill=1, decode=1, enable_auto_tool_choice=False)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [F], "max_tokens": 20}
    for extra in ({}, {"tool_choice": "auto"}):
        status, _, err = stack.post("/v1/chat/completions", {**body, **extra})
        assert status == 400 and "--enable-auto-tool-choice" in err["error"]["message"]
        assert err["error"]["param"] == "tool_choice"
    for choice in ("required", "none", {"type": "function", "function": {"name": "f"}}):
        assert stack.post("/v1/chat/completions", {**body, "tool_choice": choice})[0] == 200, choice
    # Counting a prompt generates nothing: /tokenize renders tools with the default choice.
    assert stack.post("/tokenize", {"messages": body["messages"], "tools": [F]})[0] == 200


@pytest.mark.parametrize("text, content, calls", [
    # Tokenizer v11 and later: name[ARGS]{...} per [TOOL_CALLS], content before the first.
    ('Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}', "Let me look.",
     [("get_weather", {"city": "Paris"}), ("now", {})]),
    # Earlier tokenizers: one JSON array of calls.
    ('[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": "{}"}]', None,
     [("f", {"x": 1}), ("g", {})]),
    ('[TOOL_CALLS]f[CALL_ID]Ab3De6Gh9[ARGS]{"x": 2}', None, [("f", {"x": 2})]),
])
def test_mistral_outputs_are_calls(text, content, calls):
    got_content, got = PARSE["mistral"](text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    # Mistral's templates take back only 9-character alphanumeric ids: the model's own when given.
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got)
    if "[CALL_ID]" in text:
        assert got[0]["id"] == "Ab3De6Gh9"


@pytest.mark.parametrize("text", ["no calls here", '[TOOL_CALLS]f[ARGS]{"x": ', "[TOOL_CALLS]f{}",
                                  '[TOOL_CALLS][{"name": 3}]', '[TOOL_CALLS]f[ARGS]{} trailing words', "[TOOL_CALLS]"])
def test_mistral_outputs_that_do_not_parse_stay_content(text):
    assert PARSE["mistral"](text) == (text, [])


def test_streamed_mistral_holds_back_the_tag(make_stack, tiny_model_path, tokenizer):
    text = 'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    stream, shown = ToolCallStream(ToolPlan("auto", (F,), parser="mistral")), ""
    for i in range(0, len(text), 3):
        shown += stream.feed(text[i:i + 3])
        assert "[" not in shown
    rest, calls = stream.finish()
    assert shown + rest == "Let me look." and calls[0]["function"]["name"] == "get_weather"
    # Through the router: whole and streamed; the engines are asked to keep special tokens
    # ([TOOL_CALLS] is one in Mistral's tokenizers), and the call's id goes back in the next turn.
    script = tokenizer.encode(text, add_special_tokens=False)
    stack = make_stack(prefill=1, decode=1, tool_call_parser="mistral", prefill_kwargs=[{"script": script}],
                       decode_kwargs=[{"script": script}])
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [F], "max_tokens": 100}
    status, _, out = stack.post("/v1/chat/completions", body)
    message = out["choices"][0]["message"]
    assert status == 200 and message["content"] == "Let me look." and out["choices"][0]["finish_reason"] == "tool_calls"
    assert message["tool_calls"][0]["function"]["name"] == "get_weather" and len(message["tool_calls"][0]["id"]) == 9
    assert not stack.decodes[0].engine.requests[-1].sampling.skip_special_tokens
    events = stack.sse("/v1/chat/completions", {**body, "stream": True})[:-1]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "Let me look."
    deltas = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls") or []]
    assert [c["function"]["name"] for c in deltas if "id" in c] == ["get_weather"] and len(deltas[0]["id"]) == 9
    assert len(deltas) > 2  # its arguments in pieces as the model writes them
    assert json.loads("".join(c["function"].get("arguments") or "" for c in deltas)) == {"city": "Paris"}
    follow = body["messages"] + [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                                           "content": "Sunny"}]
    assert stack.post("/v1/chat/completions", {**body, "messages": follow})[0] == 200


def test_mistral_tags_survive_detokenization_as_special_tokens(tiny_model_path, tokenizer):
    """With a tokenizer where [TOOL_CALLS] and [ARGS] are special (Mistral's), the text the router
    reads keeps them for a tools request, so the calls parse; plain requests still drop specials."""
    import copy

    from engine.detokenizer import IncrementalDetokenizer
    from services.router.openai_protocol import parse_chat
    from services.router.sampling import RequestLimits
    from services.router.served_model import ServedModel

    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    model = ServedModel(tiny_model_path, "m", tokenizer=tok, tool_call_parser="mistral")
    ids = tok.encode('[TOOL_CALLS]f[ARGS]{"x": 3}', add_special_tokens=False)
    assert tok.convert_tokens_to_ids("[TOOL_CALLS]") in ids
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
    texts = {}
    for name, extra, keeps in (("tools", {"tools": [F]}, True), ("plain", {}, False),
                               ("none", {"tools": [F], "tool_choice": "none"}, False)):
        params = parse_chat({**body, **extra}, model, RequestLimits()).prompts[0].params
        assert params.skip_special_tokens is not keeps
        texts[name] = IncrementalDetokenizer(model.codec, params).add_tokens(ids, finished=True)
        assert ("[TOOL_CALLS]" in texts[name]) is keeps
    _, calls = PARSE["mistral"](texts["tools"])
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 3}
