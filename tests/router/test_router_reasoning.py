"""--reasoning-parser (vLLM's): a thinking model's <think> text goes to the chat message's
`reasoning`, the rest to `content`, whole and streamed, however the text is cut into pieces."""
from __future__ import annotations

import random
import zlib

import pytest

from services.router.reasoning import END, PARSERS, START, ReasoningSplitter, reasoning_parser

THINKING = f"{START}Let me see: 2 + 2 is 4, and <b> is a tag.{END}\n\nThe answer is 4."


def reference(text: str, in_reasoning: bool) -> tuple[str, str]:
    """The whole text at once (vLLM's non-streaming rule)."""
    if in_reasoning:
        text = text[len(START):] if text.startswith(START) else text
        reasoning, sep, content = text.partition(END)
        return (reasoning, content) if sep else (text, "")
    before, sep, rest = text.partition(START)
    if not sep:
        return "", text
    reasoning, sep, content = rest.partition(END)
    return (reasoning, before + content) if sep else (rest, before)


def pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("text", [THINKING, THINKING[len(START):], "No thinking at all.", f"{START}cut off mid-thought",
                                  f"Preamble {START}thought{END}answer", f"{START}{END}", f"a{END}b{START}c{END}d",
                                  "<thin", f"x{START[:-1]}"])
@pytest.mark.parametrize("in_reasoning", [True, False])
def test_any_cut_of_the_text_splits_as_the_whole(text, in_reasoning):
    rng = random.Random(zlib.crc32(f"{text}{in_reasoning}".encode()))
    want = reference(text, in_reasoning)
    for _ in range(50):
        s = ReasoningSplitter(in_reasoning)
        got = [s.feed(p) for p in pieces(text, rng)] + [s.finish()] if len(text) > 1 else [s.feed(text), s.finish()]
        assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == want


def test_where_the_output_starts_comes_from_the_prompt():
    r1, qwen3 = PARSERS["deepseek_r1"], PARSERS["qwen3"]
    assert r1.starts_in_reasoning("<|User|>hi<|Assistant|>") and not qwen3.starts_in_reasoning("user: hi\nassistant:")
    opened = f"<|im_start|>assistant\n{START}\n"
    closed = f"<|im_start|>assistant\n{START}\n\n{END}\n\n"  # Qwen3 with enable_thinking false
    for parser in (r1, qwen3):
        assert parser.starts_in_reasoning(opened) and not parser.starts_in_reasoning(closed)
    with pytest.raises(ValueError, match="unknown --reasoning-parser 'o1'"):
        reasoning_parser("o1")


@pytest.mark.parametrize("name, prompt, opened, closed, thinks_unprompted", [
    # MiniMax-M2 thinks first, as DeepSeek-R1 does.
    ("minimax_m2", "]~b]user\nhi[e~[\n]~b]ai\n", None, None, True),
    # DeepSeek-V3.1's template opens <think> with thinking on, closes it with thinking off.
    ("deepseek_v3", "<｜User｜>hi<｜Assistant｜>", f"<｜User｜>hi<｜Assistant｜>{START}",
     f"<｜User｜>hi<｜Assistant｜>{END}", False),
    # GLM-4.5 and Kimi K2 Thinking start in reasoning (vLLM's parsers, thinking on); with thinking
    # off their templates write an empty block.
    ("glm45", "<|user|>\nhi<|assistant|>", None, f"<|user|>\nhi<|assistant|>\n{START}{END}", True),
    ("kimi_k2", "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>", None,
     f"<|im_assistant|>assistant<|im_middle|>{START}{END}", True),
])
def test_vllms_other_thinking_models(name, prompt, opened, closed, thinks_unprompted):
    parser = reasoning_parser(name)
    assert parser.starts_in_reasoning(prompt) is thinks_unprompted
    if opened is not None:
        assert parser.starts_in_reasoning(opened)
    if closed is not None:
        assert not parser.starts_in_reasoning(closed)
    # Either way an output that opens its own <think> has its reasoning split out.
    splitter = parser.splitter(prompt)
    reasoning, content = splitter.feed(f"{START}Let me think.{END}The answer.")
    assert (reasoning, content) == ("Let me think.", "The answer.")


def test_a_tokenizer_that_drops_the_markers_is_refused():
    class Special:
        all_special_tokens = ["<s>", END]

    with pytest.raises(ValueError, match="drops"):
        PARSERS["qwen3"].check_tokenizer(Special())


@pytest.fixture
def thinking_stack(make_stack, tokenizer):
    script = tokenizer.encode(THINKING, add_special_tokens=False)
    return make_stack(prefill=1, decode=1, reasoning_parser="deepseek_r1", prefill_kwargs=[{"script": script}],
                      decode_kwargs=[{"script": script}]), len(script)


MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def test_whole_and_streamed_answers_split_the_reasoning(thinking_stack):
    stack, n = thinking_stack
    want_reasoning, want_content = reference(THINKING, True)
    body = stack.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": n + 5})[2]
    message = body["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (want_reasoning, want_content)
    assert message["reasoning_content"] == want_reasoning  # DeepSeek's API name too
    assert body["usage"]["completion_tokens"] == n  # the reasoning's tokens count
    events = stack.sse("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": n + 5, "stream": True})[:-1]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning") or "" for d in deltas) == want_reasoning
    assert "".join(d.get("content") or "" for d in deltas) == want_content
    assert sum(bool(d.get("reasoning")) for d in deltas) > 3  # streamed as it came, not at the end
    # With tools, the reasoning streams first and the tool-call parser reads the content only.
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    events = stack.sse("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": n + 5, "stream": True,
                                                "tools": tools})[:-1]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning") or "" for d in deltas) == want_reasoning
    assert "".join(d.get("content") or "" for d in deltas) == want_content
    whole = stack.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": n + 5, "tools": tools})[2]
    assert whole["choices"][0]["message"]["content"] == want_content
    assert whole["choices"][0]["message"]["reasoning"] == want_reasoning
    # Cut short while thinking: all of it is reasoning, no content (null).
    short = stack.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6})[2]["choices"][0]
    assert short["message"]["content"] is None and short["message"]["reasoning"] and short["finish_reason"] == "length"
    # include_reasoning false (vLLM's): the reasoning is left out.
    bare = stack.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": n + 5,
                                               "include_reasoning": False})[2]["choices"][0]["message"]
    assert bare["content"] == want_content and "reasoning" not in bare
    events = stack.sse("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": n + 5, "stream": True,
                                                "include_reasoning": False})[:-1]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == want_content
    assert not any("reasoning" in e["choices"][0]["delta"] for e in events)


def test_completions_and_routers_without_a_parser_keep_the_text(thinking_stack, make_stack, tokenizer):
    stack, n = thinking_stack
    text = stack.post("/v1/completions", {"prompt": "hi", "max_tokens": n + 5})[2]["choices"][0]["text"]
    assert text == THINKING
    script = tokenizer.encode(THINKING, add_special_tokens=False)
    plain = make_stack(prefill=1, decode=1, prefill_kwargs=[{"script": script}], decode_kwargs=[{"script": script}])
    message = plain.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": n + 5})[2]["choices"][0]["message"]
    assert message["content"] == THINKING and "reasoning" not in message


def test_a_structured_output_applies_after_the_reasoning(make_stack, tokenizer):
    """vLLM's rule: on an output that starts in reasoning, the grammar starts after the end
    marker (the engine gets its token ids); the reasoning is free, the document is the content.
    Where the output starts in content, the grammar holds from the first token."""
    doc = '{"answer": 4}'
    script = tokenizer.encode(f"{START}Two and two.{END}{doc}", add_special_tokens=False)
    stack = make_stack(prefill=1, decode=1, reasoning_parser="deepseek_r1", prefill_kwargs=[{"script": script}],
                       decode_kwargs=[{"script": script}])
    body = {"messages": MESSAGES, "max_tokens": 50, "response_format": {"type": "json_object"}}
    message = stack.post("/v1/chat/completions", body)[2]["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("Two and two.", doc)
    end = tokenizer.encode(END, add_special_tokens=False)
    for engine in (stack.prefills[0].engine, stack.decodes[0].engine):
        so = engine.requests[-1].sampling.structured_outputs
        assert so.json_object and list(so.reasoning_end_token_ids) == end
    events = stack.sse("/v1/chat/completions", {**body, "stream": True})[:-1]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == doc
    # The template closed the reasoning (Qwen3 with thinking off): the grammar from the first token.
    plain = make_stack(prefill=1, decode=1, reasoning_parser="qwen3", prefill_kwargs=[{"script": script}],
                       decode_kwargs=[{"script": script}])
    closed = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": f"{START}\n\n{END}\n\n"}]
    plain.post("/v1/chat/completions", {"messages": closed, "max_tokens": 50, "add_generation_prompt": False,
                                        "continue_final_message": True, "response_format": {"type": "json_object"}})
    assert not plain.decodes[0].engine.requests[-1].sampling.structured_outputs.reasoning_end_token_ids
