"""vLLM's chat request fields that reach the template or the tokenizer: reasoning_effort (and the
enable_thinking it implies), documents, add_special_tokens; and truncation_side."""
from __future__ import annotations

import pytest

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if documents %}{% for d in documents %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}{% endif %}"
            "effort={{ reasoning_effort | default('unset') }} thinking={{ enable_thinking | default('unset') }}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture
def stack(make_stack):
    return make_stack(prefill=1, decode=1, trust_request_chat_template=True)


def sent(stack) -> list[int]:
    return list(stack.decodes[0].engine.requests[-1].prompt_token_ids)


def test_reasoning_effort_and_documents_reach_the_template(stack, tokenizer):
    docs = [{"title": "a", "text": "first"}, {"title": "b", "text": "second"}]
    body = {"messages": MESSAGES, "chat_template": TEMPLATE, "max_tokens": 2}
    cases = [({}, "effort=unset thinking=unset"),
             ({"reasoning_effort": "low"}, "effort=low thinking=True"),
             ({"reasoning_effort": "none"}, "effort=none thinking=False"),
             ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
              "effort=high thinking=False"),  # the client's own enable_thinking stands
             ({"documents": docs}, "[doc a: first][doc b: second]effort=unset thinking=unset")]
    for extra, rendered in cases:
        want = tokenizer.encode(f"<user>Hello there{rendered}<assistant>", add_special_tokens=False)
        status, _, got = stack.post("/v1/chat/completions", {**body, **extra})
        assert status == 200, got
        assert sent(stack) == want, extra
        assert stack.post("/tokenize", {**body, **extra})[2]["tokens"] == want, extra
    for bad, param in (({"reasoning_effort": "extreme"}, "reasoning_effort"), ({"documents": [{"t": 1}]}, "documents")):
        status, _, got = stack.post("/v1/chat/completions", {**body, **bad})
        assert status == 400 and got["error"]["param"] == param, got


def test_add_special_tokens_adds_the_tokenizers_own_on_top(tiny_model_path, tokenizer):
    """Chat's add_special_tokens (default false: the template writes its own) encodes the rendered
    text with the tokenizer's special tokens too: here a tokenizer that puts BOS first."""
    import copy

    from tokenizers import processors

    from services.router.openai_protocol import parse_chat
    from services.router.sampling import RequestLimits
    from services.router.served_model import ServedModel

    bos = copy.deepcopy(tokenizer)
    bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos.convert_tokens_to_ids("<s>"))])
    model = ServedModel(tiny_model_path, "m", tokenizer=bos)
    limits = RequestLimits(trust_request_chat_template=True)
    body = {"messages": MESSAGES, "chat_template": TEMPLATE, "max_tokens": 2}
    text = "<user>Hello thereeffort=unset thinking=unset<assistant>"
    plain = parse_chat(body, model, limits).prompts[0].token_ids
    added = parse_chat({**body, "add_special_tokens": True}, model, limits).prompts[0].token_ids
    assert plain == bos.encode(text, add_special_tokens=False)
    assert added == bos.encode(text, add_special_tokens=True) == [bos.convert_tokens_to_ids("<s>"), *plain]


def test_truncation_side_right_keeps_the_first_tokens(stack, tokenizer):
    ids = tokenizer.encode("one two three four five six seven eight")
    for side, kept in (("left", ids[-5:]), ("right", ids[:5])):
        assert stack.post("/v1/completions", {"prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": 5,
                                              "truncation_side": side})[0] == 200
        assert sent(stack) == kept
    status, _, body = stack.post("/v1/completions", {"prompt": ids, "truncation_side": "middle"})
    assert status == 400 and body["error"]["param"] == "truncation_side"


def test_chat_echo_puts_the_last_message_first(stack):
    """vLLM's chat echo: with a partial assistant message (continue_final_message), the answer's
    content starts with it, whole and streamed; a last message of another role is not echoed."""
    partial = MESSAGES + [{"role": "assistant", "content": "The answer is"}]
    body = {"messages": partial, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 4,
            "temperature": 0}
    plain = stack.post("/v1/chat/completions", body)[2]["choices"][0]["message"]["content"]
    echoed = stack.post("/v1/chat/completions", {**body, "echo": True})[2]["choices"][0]["message"]["content"]
    assert echoed == "The answer is" + plain
    events = stack.sse("/v1/chat/completions", {**body, "echo": True, "stream": True})[:-1]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[1] == {"content": "The answer is"} and "".join(d.get("content") or "" for d in deltas) == echoed
    asked = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    assert stack.post("/v1/chat/completions", {**asked, "echo": True})[2]["choices"][0]["message"]["content"] == \
        stack.post("/v1/chat/completions", asked)[2]["choices"][0]["message"]["content"]


def test_the_operators_chat_template_replaces_the_models(make_stack, tokenizer, tmp_path, caplog):
    """--chat-template (vLLM's): a file or the template's own text renders every chat request
    (and /tokenize's, and the Messages API's); a template a request sends (trusted) still wins."""
    simple = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}"
    path = tmp_path / "simple.jinja"
    path.write_text(simple)
    want = tokenizer.encode("[user] Hello there\n[bot]", add_special_tokens=False)
    for value in (str(path), simple):
        stack = make_stack(prefill=1, decode=1, chat_template=value, trust_request_chat_template=True)
        status, _, body = stack.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
        assert status == 200, body
        assert sent(stack) == want
        assert stack.post("/tokenize", {"messages": MESSAGES})[2]["tokens"] == want
        stack.post("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": MESSAGES})
        assert sent(stack) == want
        stack.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "chat_template": TEMPLATE})
        assert sent(stack) == tokenizer.encode("<user>Hello thereeffort=unset thinking=unset<assistant>",
                                               add_special_tokens=False)
    # A path that cannot be opened is a start-up error; a template that cannot render a
    # one-message chat is a warning at start, and each chat request's 400.
    from services.router.served_model import load_chat_template

    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with caplog.at_level("WARNING"):
        broken = make_stack(prefill=1, decode=1, chat_template="{{ messages[5].content }}\n")
    assert "does not render a one-message chat" in caplog.text
    status, _, err = broken.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert status == 400 and "cannot apply the chat template" in err["error"]["message"]
    assert broken.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200
