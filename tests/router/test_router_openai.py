"""The official `openai` client drives the gateway: completions and chat, streamed and not."""
from __future__ import annotations

import openai
import pytest

from router_fakes import VOCAB, toy_generate, toy_logprob


@pytest.fixture
def stack(make_stack):
    return make_stack(prefill=2, decode=1)


@pytest.fixture
def client(stack):
    with openai.OpenAI(base_url=stack.url, api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def expected_text(tokenizer, prompt_ids, n, **kw):
    ids, finish = toy_generate(prompt_ids, n, **kw)
    return tokenizer.decode(ids), ids, finish


def test_completion_matches_the_engines_tokens(client, tokenizer):
    prompt = "The quick brown fox"
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, temperature=0)
    text, ids, _ = expected_text(tokenizer, tokenizer.encode(prompt), 7)
    assert out.choices[0].text == text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert out.usage.completion_tokens == 7 and out.usage.total_tokens == out.usage.prompt_tokens + 7
    assert out.model == "tiny" and out.object == "text_completion"


def test_streamed_completion_concatenates_to_the_whole(client):
    kwargs = dict(model="tiny", prompt="Hello world", max_tokens=9, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9


def test_a_token_whose_text_is_held_back_still_streams_its_chunk(client, tokenizer):
    # The fakes answer prompt [7] with token 230 first: one byte of a UTF-8 character, no text
    # of its own until the next token completes it. Its chunk still comes (empty text, as vLLM
    # streams it): a client's time to first token is the first token's, not the second's.
    ids, _ = toy_generate([7], 6)
    assert "\ufffd" in tokenizer.decode(ids[:1])
    kwargs = dict(model="tiny", prompt=[7], max_tokens=6, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert len(chunks) == 6  # one a token
    assert chunks[0].choices[0].text == "" and chunks[0].choices[0].finish_reason is None
    assert "".join(c.choices[0].text for c in chunks) == whole == tokenizer.decode(ids)
    messages = [{"role": "user", "content": "hi"}]
    chat = [c for c in client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                                       temperature=0, stream=True) if c.choices]
    assert len(chat) == 1 + 6  # the role, then one a token


def test_chat_completion_uses_the_chat_template(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                  add_special_tokens=False)
    text, _, _ = expected_text(tokenizer, prompt_ids, 5)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == text
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == 5


def test_chat_content_parts_and_max_completion_tokens(client):
    plain = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "one\ntwo"}], max_completion_tokens=4)
    parts = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "one"},
                                                             {"type": "text", "text": "two"}]}],
        max_tokens=4)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.completion_tokens == 4


def test_streamed_chat_with_usage_and_logprobs(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Count"}], max_tokens=6)
    whole = client.chat.completions.create(logprobs=True, top_logprobs=2, **kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                 logprobs=True, top_logprobs=2, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    streamed_lps = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in streamed_lps] == [t.logprob for t in whole.choices[0].logprobs.content]
    assert len(whole.choices[0].logprobs.content) == 6
    assert all(len(t.top_logprobs) == 2 for t in whole.choices[0].logprobs.content)
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []


def test_prompt_forms_and_several_choices(client, tokenizer):
    ids = tokenizer.encode("green tree")
    by_text = client.completions.create(model="tiny", prompt="green tree", max_tokens=3).choices[0].text
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=3).choices[0].text == by_text
    out = client.completions.create(model="tiny", prompt=["green tree", "red sun", "green tree"], max_tokens=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.choices[0].text == by_text == out.choices[2].text
    assert out.usage.completion_tokens == 9
    out = client.completions.create(model="tiny", prompt=[ids, tokenizer.encode("red sun")], max_tokens=3)
    assert out.choices[0].text == by_text and len(out.choices) == 2


def test_several_prompts_stream_interleaved_by_index(client):
    chunks = list(client.completions.create(model="tiny", prompt=["a b", "c d e"], max_tokens=4, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    single = [client.completions.create(model="tiny", prompt=p, max_tokens=4).choices[0].text for p in ["a b", "c d e"]]
    assert [texts[0], texts[1]] == single


def test_echo_with_prompt_logprobs_for_loglikelihood(client, tokenizer):
    prompt = "the king and the queen"
    ids = tokenizer.encode(prompt)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    # max_tokens=0 with echo: the prompt and its logprobs only (what lm-eval's loglikelihood sends).
    only = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert only.choices[0].text == prompt
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    assert only.usage.completion_tokens == 0


def test_vllms_prompt_logprobs_field(stack, client, tokenizer):
    """vLLM's prompt_logprobs: per prompt token after the first, the token's own entry and the
    top-n, each {logprob, rank, decoded_token} by token id; on a completion's choice, beside a
    chat's choices; with echo and logprobs too (vLLM's rule); not streamed."""
    prompt = "the king and the queen"
    ids = tokenizer.encode(prompt)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 2})
    lps = out.choices[0].model_extra["prompt_logprobs"]
    assert lps[0] is None and len(lps) == len(ids)
    for token, entry in zip(ids[1:], lps[1:]):
        want = toy_logprob(token, 2, prompt=True)
        assert list(entry) == [str(token), str(want.top[0].token_id)]  # the prompt's token first
        assert entry[str(token)] == {"logprob": want.logprob, "rank": 1, "decoded_token": tokenizer.decode([token])}
        assert entry[str(want.top[0].token_id)]["rank"] == 1 and entry[str(want.top[0].token_id)]["logprob"] == \
            pytest.approx(want.top[0].logprob)
    assert out.choices[0].logprobs is None  # the completion's own logprobs were not asked for
    # prompt_logprobs 0: each prompt token's own entry alone.
    zero = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert all(len(e) == 1 for e in zero.choices[0].model_extra["prompt_logprobs"][1:])
    # echo + logprobs shows them as well (top-1 here); asked for, the field wins for the list.
    echo = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                     extra_body={"prompt_logprobs": 2})
    assert echo.choices[0].model_extra["prompt_logprobs"] == lps
    # Echo's own top_logprobs stay at logprobs=1: the token and the likeliest other.
    assert all(len(t) <= 2 for t in echo.choices[0].logprobs.top_logprobs[1:])
    plain_echo = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, echo=True, logprobs=1)
    assert all(len(e) == 1 for e in plain_echo.choices[0].model_extra["prompt_logprobs"][1:])  # top-1 lists
    # Chat: once, beside the choices (the chat template's prompt).
    body = stack.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                               "prompt_logprobs": 1, "return_token_ids": True})[2]
    assert len(body["prompt_logprobs"]) == len(body["prompt_token_ids"]) and body["prompt_logprobs"][0] is None
    assert "prompt_logprobs" not in body["choices"][0]
    # Refused as vLLM refuses them: streamed (but 0), -1 (the whole vocabulary: more than
    # --max-logprobs, 20 by default), past 20, not a number.
    for extra, message in (({"prompt_logprobs": 2, "stream": True}, "not available when `stream=True`"),
                           ({"prompt_logprobs": -1}, "which is greater than max allowed: 20"),
                           ({"prompt_logprobs": 21}, "Requested prompt logprobs of 21, which is greater"),
                           ({"prompt_logprobs": "2"}, "must be an integer")):
        status, _, err = stack.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, **extra})
        assert status == 400 and message in err["error"]["message"] and err["error"]["param"] == "prompt_logprobs"
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=2, stream=True,
                                              extra_body={"prompt_logprobs": 0}))
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_stop_strings_end_the_text(client, tokenizer):
    prompt = "Hello world"
    full, _, _ = expected_text(tokenizer, tokenizer.encode(prompt), 12)
    stop = full[5:8]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, stop=[stop, "zzzz"])
    assert out.choices[0].text == full[:full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_stop_token_ids_reported_as_stop_reason(client, tokenizer):
    ids = tokenizer.encode("Hello world")
    _, toks, _ = expected_text(tokenizer, ids, 6)
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=6, extra_body={"stop_token_ids": [toks[3]]})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == toks[3]
    assert out.usage.completion_tokens == 4


def test_client_errors_come_back_as_openai_exceptions(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi")
    assert "gpt-4" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", n=99)
    assert "n" == e.value.param and "--max-n" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=100000)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    assert client.completions.create(model="tiny", prompt="still serving", max_tokens=2).usage.completion_tokens == 2


def test_models_lists_the_served_model(client, stack):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["max_model_len"] == 2048
    assert models[0].model_extra["root"] == stack.router.model.path
    assert models[0].owned_by == "pdserve"


def test_colocated_mode_sends_prompts_to_decode_instances(make_stack, tokenizer):
    stack = make_stack(prefill=0, decode=2)
    with openai.OpenAI(base_url=stack.url, api_key="x", max_retries=0) as client:
        ids = tokenizer.encode("Hello world")
        out = client.completions.create(model="tiny", prompt=ids, max_tokens=5, echo=True, logprobs=1)
        assert out.choices[0].text == tokenizer.decode(ids) + tokenizer.decode(toy_generate(ids, 5)[0])
        assert out.choices[0].logprobs.token_logprobs[0] is None
        assert len(out.choices[0].logprobs.token_logprobs) == len(ids) + 5
        assert client.completions.create(model="tiny", prompt="x", max_tokens=1).usage.completion_tokens == 1
    requests = [r for d in stack.decodes for r in d.engine.requests]
    assert len(requests) == 2 and not any(r.HasField("first_token_id") for r in requests)


def test_one_token_or_a_first_stop_token_needs_no_decode(client, stack, tokenizer):
    """The prefill engine decides whether its first token ends the request (it knows max_tokens,
    the stop token ids, EOS): the router always asks it to publish KV and takes its answer."""
    ids = tokenizer.encode("Hello world")
    first = toy_generate(ids, 1)[0]
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=1)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 1
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=8, extra_body={"stop_token_ids": first})
    assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["stop_reason"] == first[0]
    requests = [r for p in stack.prefills for r in p.engine.requests]
    assert len(requests) == 2 and all(r.publish_kv for r in requests)
    assert not stack.decodes[0].engine.requests


def test_prefill_stop_reason_ends_the_stream_at_the_first_token(make_stack, tokenizer):
    stack = make_stack(prefill=1, decode=1)
    # A prompt whose first token is 7, so the prefill engine stops on stop_token_ids [7].
    ids = next([a, 6] for a in range(6, VOCAB) if toy_generate([a, 6], 1)[0] == [7])
    events = stack.sse("/v1/completions", {"prompt": ids, "max_tokens": 8, "stream": True, "stop_token_ids": [7],
                                           "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 1
    last = [e for e in events[:-2] if e["choices"]][-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", 7)  # an int, as vLLM sends it
    assert [r.publish_kv for r in stack.prefills[0].engine.requests] == [True]
    assert not stack.decodes[0].engine.requests
    assert "/pdserve.v1.Decode/Decode" not in stack.decodes[0].calls


def test_router_trusts_the_prefill_engine_on_eos(make_stack, tokenizer):
    """EOS is the engine's to know: a first token the prefill engine calls EOS ends the request
    with finish_reason stop and no stop_reason, though the request named no stop token."""
    ids = tokenizer.encode("Hello world")
    first = toy_generate(ids, 1)[0][0]
    stack = make_stack(prefill=1, decode=1, prefill_kwargs=[{"eos_token_id": first}])
    status, _, body = stack.post("/v1/completions", {"prompt": ids, "max_tokens": 8})
    assert status == 200, body
    choice = body["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    assert body["usage"]["completion_tokens"] == 1 and not stack.decodes[0].engine.requests
    status, _, body = stack.post("/v1/completions", {"prompt": ids, "max_tokens": 8, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 8, body


def test_continuous_usage_stats_give_every_chunk_its_choices_usage_so_far(stack, tokenizer):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): each chunk carries its
    choice's prompt and completion tokens so far; the last chunk still has the request's usage."""
    ids = tokenizer.encode("Hello world")
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = stack.sse("/v1/completions", {"prompt": ids, "max_tokens": 5, "stream": True, "n": 2, "seed": 1,
                                           "temperature": 1.0, "stream_options": options})
    chunks = [e for e in events[:-2] if e["choices"]]
    for index in (0, 1):
        mine = [e for e in chunks if e["choices"][0]["index"] == index]
        assert [e["usage"]["completion_tokens"] for e in mine] == [1, 2, 3, 4, 5]
        assert all(e["usage"]["prompt_tokens"] == len(ids) and e["usage"]["total_tokens"] == len(ids)
                   + e["usage"]["completion_tokens"] for e in mine)
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 10
    chat = stack.sse("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                              "stream": True, "stream_options": options})
    assert [e["usage"]["completion_tokens"] for e in chat[:-2]] == [0, 1, 2, 3]  # the role chunk first
    # Without include_usage, as in vLLM, nothing changes; a non-boolean is 400.
    plain = stack.sse("/v1/completions", {"prompt": ids, "max_tokens": 2, "stream": True,
                                          "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in e for e in plain[:-1])
    status, _, body = stack.post("/v1/completions", {"prompt": ids, "stream": True,
                                                     "stream_options": {"continuous_usage_stats": "yes"}})
    assert status == 400 and "continuous_usage_stats" in body["error"]["message"]


def test_version_is_the_distributions_everywhere(make_stack):
    """GET /version (vLLM's; no API key, as the probes) and `pdserve --version` say pyproject's version."""
    import subprocess
    import sys
    import tomllib

    with open(f"{__file__.rsplit('/tests/', 1)[0]}/pyproject.toml", "rb") as f:
        expected = tomllib.load(f)["project"]["version"]
    stack = make_stack(api_key="sekret")
    status, _, body = stack.request("GET", "/version")
    assert status == 200 and body == {"version": expected}
    out = subprocess.run([sys.executable, "-m", "services.cli", "--version"], capture_output=True, text=True,
                         check=True, cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.stdout.strip() == f"pdserve {expected}"


def test_return_token_ids_and_tokens_as_ids_as_vllm_sends_them(stack, tokenizer):
    """vLLM's return_token_ids: a completion choice has its prompt's ids and its own (echo: the
    prompt's first), a chat response the prompt's ids beside the choices; streamed, each chunk has
    its new ids and the first the prompt's, none lost where a chunk holds its text back (tools).
    return_tokens_as_token_ids names logprobs' tokens "token_id:<id>"."""
    ids = tokenizer.encode("Hello world")
    out, _ = toy_generate(ids, 6)
    whole = stack.post("/v1/completions", {"prompt": ids, "max_tokens": 6, "return_token_ids": True,
                                           "logprobs": 1, "return_tokens_as_token_ids": True})[2]
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == ids and choice["token_ids"] == out
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in out]
    assert all(set(top) <= {f"token_id:{t}" for t in range(VOCAB)} for top in choice["logprobs"]["top_logprobs"])
    assert choice["text"] == tokenizer.decode(out)  # the text itself is unchanged
    echoed = stack.post("/v1/completions", {"prompt": ids, "max_tokens": 6, "echo": True,
                                            "return_token_ids": True})[2]["choices"][0]
    assert echoed["token_ids"] == ids + out
    events = stack.sse("/v1/completions", {"prompt": ids, "max_tokens": 6, "stream": True, "return_token_ids": True})
    chunks = [e["choices"][0] for e in events[:-1]]
    assert chunks[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == out
    plain = stack.post("/v1/completions", {"prompt": ids, "max_tokens": 2})[2]["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain

    messages = [{"role": "user", "content": "Hello there"}]
    chat = stack.post("/v1/chat/completions", {"messages": messages, "max_tokens": 5, "return_token_ids": True,
                                               "logprobs": True, "return_tokens_as_token_ids": True})[2]
    sent = list(stack.decodes[0].engine.requests[-1].prompt_token_ids)
    chat_out, _ = toy_generate(sent, 5)
    assert chat["prompt_token_ids"] == sent and chat["choices"][0]["token_ids"] == chat_out
    assert [c["token"] for c in chat["choices"][0]["logprobs"]["content"]] == [f"token_id:{t}" for t in chat_out]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra in ({}, {"tools": tools}):  # tools: content is held until the call is known
        events = stack.sse("/v1/chat/completions", {"messages": messages, "max_tokens": 5, "stream": True,
                                                    "return_token_ids": True, **extra})[:-1]
        assert events[0]["prompt_token_ids"] == sent and all("prompt_token_ids" not in e for e in events[1:])
        assert [t for e in events for t in e["choices"][0]["token_ids"]] == chat_out


def test_every_served_name_is_served_and_answers_carry_the_first(make_stack):
    """--served-model-name with several names (vLLM's): each is accepted and listed; the answer's
    `model` is the first name."""
    stack = make_stack(served_model_aliases=("meta/tiny-1b", "t"))
    status, _, body = stack.post("/v1/completions", {"model": "t", "prompt": "hi", "max_tokens": 2})
    assert status == 200 and body["model"] == "tiny"
    assert stack.post("/v1/chat/completions", {"model": "meta/tiny-1b", "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "hi"}]})[2]["model"] == "tiny"
    assert [m["id"] for m in stack.request("GET", "/v1/models")[2]["data"]] == ["tiny", "meta/tiny-1b", "t"]
    assert stack.request("GET", "/v1/models/t")[2]["id"] == "t"
    assert stack.post("/v1/completions", {"model": "other", "prompt": "hi"})[0] == 404


def test_sagemakers_ping_and_invocations(stack):
    """SageMaker's container contract, as vLLM serves it: /ping is the health check, /invocations
    answers a chat or a completions body, streamed or not."""
    status, _, body = stack.request("GET", "/ping")
    assert (status, body) == (200, {"status": "ok"})
    assert stack.request("POST", "/ping")[0] == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    got, want = stack.post("/invocations", chat)[2], stack.post("/v1/chat/completions", chat)[2]
    assert got["object"] == "chat.completion" and got["choices"] == want["choices"]
    completion = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
    got, want = stack.post("/invocations", completion)[2], stack.post("/v1/completions", completion)[2]
    assert got["object"] == "text_completion" and got["choices"] == want["choices"]
    events = stack.sse("/invocations", {**completion, "stream": True})
    assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]) == want["choices"][0]["text"]
    status, _, body = stack.post("/invocations", {"input": "hi"})
    assert status == 400 and "messages" in body["error"]["message"]
