"""vLLM's /tokenize and /detokenize at the gateway: the ids a completion or chat request would send
the engines, their count, and the text of ids; bad input is an OpenAI-style 400."""
from __future__ import annotations

import pytest


@pytest.fixture
def stack(make_stack):
    return make_stack(prefill=1, decode=1, max_model_len=64)


def ok(result) -> dict:
    status, _, body = result
    assert status == 200, body
    return body


def test_a_prompt_tokenizes_as_the_tokenizer_does(stack, tokenizer):
    text = "The quick brown fox jumps"
    got = ok(stack.post("/tokenize", {"model": "tiny", "prompt": text}))
    ids = tokenizer.encode(text)
    assert got == {"count": len(ids), "max_model_len": 64, "tokens": ids, "token_strs": None}
    bare = ok(stack.post("/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}))
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])
    # No context limit: a client counts a prompt before deciding to send it.
    long = ok(stack.post("/tokenize", {"prompt": "word " * 200}))
    assert long["count"] > 64 and long["tokens"] == tokenizer.encode("word " * 200)


def test_chat_messages_tokenize_as_the_chat_completion_sends_them(stack):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    got = ok(stack.post("/tokenize", {"messages": messages}))
    assert ok(stack.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2}))
    sent = stack.decodes[0].engine.requests[-1].prompt_token_ids
    assert got["tokens"] == list(sent) and got["count"] == len(sent)
    continued = ok(stack.post("/tokenize", {"messages": messages + [{"role": "assistant", "content": "Hi"}],
                                            "add_generation_prompt": False, "continue_final_message": True}))
    assert continued["tokens"] != got["tokens"]


def test_detokenize_gives_the_text_back(stack, tokenizer):
    ids = tokenizer.encode("Green river stone")
    assert ok(stack.post("/detokenize", {"model": "tiny", "tokens": ids})) == {"prompt": tokenizer.decode(ids)}
    assert ok(stack.post("/detokenize", {"tokens": []})) == {"prompt": ""}


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "model": "other"}, 404, "model"),
    ("/tokenize", {"messages": "hi"}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
     400, "continue_final_message"),
    ("/tokenize", b"{not json", 400, None),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, "a"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"),
])
def test_bad_input_is_an_openai_error(stack, path, body, status, param):
    got_status, _, got = stack.post(path, body)
    assert got_status == status, got
    assert set(got["error"]) == {"message", "type", "param", "code"} and got["error"]["param"] == param
    assert ok(stack.post("/tokenize", {"prompt": "still serving"}))["count"] > 0


def test_the_api_key_guards_them(make_stack):
    stack = make_stack(api_key="sekret")
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        assert stack.post(path, body)[0] == 401
        assert stack.post(path, body, {"Authorization": "Bearer sekret"})[0] == 200
