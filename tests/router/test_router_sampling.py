"""The sampling surface at the gateway: penalties, logit_bias and bad words reach the engines; n and
best_of fan out into one engine request per sample, answered as choices with per-choice indexes."""
from __future__ import annotations

import grpc
import openai
import pytest

from engine.request import SamplingParams
from engine.thinking_budget import ThinkingBudget
from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc
from services.convert import sampling_from_proto, sampling_to_proto
from services.router.openai_protocol import ParsedRequest
from services.router.openai_serving import Choice, OpenAIServing
from services.router.sampling import bad_words_token_ids
from services.router.served_model import ServedModel

from router_fakes import toy_generate


@pytest.fixture
def stack(make_stack):
    return make_stack()  # one prefill, one decode: every engine request is seen by both


@pytest.fixture
def client(stack):
    c = openai.OpenAI(base_url=stack.url, api_key="unused", max_retries=0, timeout=30)
    yield c
    c.close()


def engine_samplings(stack) -> list[pb.SamplingParams]:
    """What the engines were asked, one per engine request (the decode side sees each once)."""
    return [r.sampling for r in stack.decodes[0].engine.requests]


def test_the_new_fields_survive_the_wire():
    s = SamplingParams(max_tokens=5, presence_penalty=-1.5, frequency_penalty=0.25, repetition_penalty=1.25,
                       logit_bias={7: -100.0, 3: 0.5}, bad_words_token_ids=[[1, 2], [9]], seed=4,
                       resumed_tokens=3, allowed_token_ids=[9, 4, 4])
    assert sampling_from_proto(sampling_to_proto(s)) == s
    for tb in (ThinkingBudget(3, end=(9, 10)), ThinkingBudget(0, end=(9,), start=(8,), starts_in_reasoning=False,
                                                                forced=(4, 5, 9))):
        s = SamplingParams(max_tokens=5, thinking_budget=tb)
        assert sampling_from_proto(sampling_to_proto(s)) == s
    plain = sampling_from_proto(sampling_to_proto(SamplingParams(max_tokens=5)))
    assert plain.repetition_penalty == 1.0 and plain.logit_bias == () and plain.bad_words_token_ids == ()
    assert plain.resumed_tokens == 0 and plain.allowed_token_ids == ()


def test_bad_words_are_tokenized_as_vllm_does(tiny_model_path, tokenizer):
    model = ServedModel(tiny_model_path, "tiny", tokenizer=tokenizer)
    words = ["hello", "  world", "quick brown"]
    got = bad_words_token_ids(model, words)
    want = []
    for word in words:  # vLLM's SamplingParams.update_from_tokenizer, spelled out
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        want.append(tuple(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            want.append(tuple(spaced))
    assert list(got) == want and len(got) >= len(words)


def test_n_fans_out_into_seeded_samples_with_usage(stack, client, tokenizer):
    prompt = "The quick brown fox"
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, n=3, seed=11, temperature=0.8,
                                    presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"42": 3},
                                    extra_body={"repetition_penalty": 1.1, "bad_words": ["hello"]})
    text = tokenizer.decode(toy_generate(tokenizer.encode(prompt), 5)[0])
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.text == text for c in out.choices)  # the toy model ignores sampling
    n_prompt = len(tokenizer.encode(prompt))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (n_prompt, 15)
    sent = engine_samplings(stack)
    assert sorted(s.seed for s in sent) == [11, 12, 13]  # distinct, and the same again next time
    for s in sent:
        assert (s.presence_penalty, s.frequency_penalty) == (0.5, -0.5)
        assert s.repetition_penalty == pytest.approx(1.1) and dict(s.logit_bias) == {42: 3.0}
        assert [tuple(w.ids) for w in s.bad_words_token_ids][0] == tuple(tokenizer.encode("hello",
                                                                                          add_special_tokens=False))


def test_several_prompts_times_n_are_indexed_prompt_major(client, tokenizer):
    prompts = ["one two", "three four five"]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=3, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        ids = tokenizer.encode(prompts[c.index // 2])
        assert c.text == tokenizer.decode(toy_generate(ids, 3)[0])
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == 12


def test_streamed_chat_with_n_has_per_choice_indexes(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Count"}], max_tokens=6)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, n=3, stream_options={"include_usage": True},
                                                 **kwargs))
    texts = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert texts == {0: whole, 1: whole, 2: whole}
    finished = [ch.index for c in chunks for ch in c.choices if ch.finish_reason]
    assert sorted(finished) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == 18


def test_best_of_counts_every_sample_and_hides_the_logprobs_it_used(stack, client):
    out = client.completions.create(model="tiny", prompt="Hello there", max_tokens=4, n=2, best_of=4, seed=1)
    assert [c.index for c in out.choices] == [0, 1] and all(c.logprobs is None for c in out.choices)
    assert out.usage.completion_tokens == 16
    sent = engine_samplings(stack)
    assert len(sent) == 4 and all(s.HasField("logprobs") and s.logprobs == 0 for s in sent)


def test_best_of_keeps_the_highest_cumulative_logprobs():
    req = ParsedRequest("tiny", prompts=[None] * 6, n=2, best_of=3)
    choices = [Choice.__new__(Choice) for _ in range(6)]
    for i, (c, lp) in enumerate(zip(choices, [-3.0, -1.0, -2.0, -0.5, -9.0, -0.1])):
        c.index, c.cumulative_logprob = i, lp
    best = OpenAIServing._best(choices, req)
    assert [(c.cumulative_logprob, c.index) for c in best] == [(-1.0, 0), (-2.0, 1), (-0.1, 2), (-0.5, 3)]


@pytest.mark.parametrize("kwargs,param", [
    (dict(presence_penalty=5), "presence_penalty"),
    (dict(logit_bias={"977": 1}), "logit_bias"),
    (dict(n=2, best_of=1), "best_of"),
    (dict(n=17), "n"),
    (dict(best_of=17), "best_of"),
    (dict(extra_body={"bad_words": ["x" * 300]}), "bad_words"),
])
def test_bad_input_is_400_and_the_gateway_keeps_serving(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, **kwargs)
    assert e.value.status_code == 400 and e.value.param == param
    assert set(e.value.body) >= {"message", "type", "param", "code"}
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text


def test_fan_out_is_capped_with_the_prompt_array(make_stack):
    stack = make_stack(max_prompts_per_request=8)
    status, _, body = stack.post("/v1/completions", {"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt" and "9 generations" in body["error"]["message"]
    assert stack.post("/v1/completions", {"prompt": ["a", "b"], "n": 4, "max_tokens": 1})[0] == 200


def test_grpc_generate_takes_the_new_params(stack, tokenizer):
    with grpc.insecure_channel(stack.grpc_target) as ch:
        stub = pb_grpc.GenerateStub(ch)
        sampling = pb.SamplingParams(max_tokens=3, frequency_penalty=1.0, logit_bias={5: 2.0}, bad_words=["hello"],
                                     bad_words_token_ids=[pb.TokenIds(ids=[7, 8])])
        list(stub.Generate(pb.GenerateRequest(text="hi", sampling=sampling), timeout=10))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(
                max_tokens=3, presence_penalty=3.0)), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "presence_penalty" in e.value.details()
    s = engine_samplings(stack)[0]
    assert s.frequency_penalty == 1.0 and dict(s.logit_bias) == {5: 2.0}
    assert [tuple(w.ids) for w in s.bad_words_token_ids][:2] == [
        (7, 8), tuple(tokenizer.encode("hello", add_special_tokens=False))]
    assert not s.bad_words  # the text stays at the router


def test_the_engines_batch_what_nobody_watches_arrive(make_stack):
    """A request the client does not stream asks the engines for --non-streaming-interval tokens
    a message (vLLM answers it once, at the end), one with text stop strings too (the decode stops
    where one matches: its engine looks for them); a streamed one and the gRPC front keep what
    the client asked."""
    stack = make_stack()
    asked = {"whole": {}, "own": {"stream_interval": 80}, "streamed": {"stream": True},
             "streamed 3": {"stream": True, "stream_interval": 3}, "stop": {"stop": ["zz"]}}
    for extra in asked.values():
        assert stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 4, **extra})[0] == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert stack.post("/v1/chat/completions", chat)[0] == 200
    with grpc.insecure_channel(stack.grpc_target) as ch:
        list(pb_grpc.GenerateStub(ch).Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(
            max_tokens=3, stream_interval=5)), timeout=10))
    got = [s.stream_interval if s.HasField("stream_interval") else None for s in engine_samplings(stack)]
    assert got == [64, 80, None, 3, 64, 64, 5]

    every_step = make_stack(non_streaming_interval=1)
    assert every_step.post("/v1/completions", {"prompt": "hi", "max_tokens": 4})[0] == 200
    assert not engine_samplings(every_step)[0].HasField("stream_interval")


def test_priority_reaches_both_engines_from_every_front(make_stack):
    """vLLM's request `priority` (completions, chat, gRPC Generate) goes to the prefill and the
    decode alike; not an int32 integer is 400 at the gateway."""
    stack = make_stack()
    assert stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 3, "priority": -5})[0] == 200
    assert stack.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                               "priority": 7})[0] == 200
    assert stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 3})[0] == 200
    with grpc.insecure_channel(stack.grpc_target) as ch:
        list(pb_grpc.GenerateStub(ch).Generate(pb.GenerateRequest(text="hi", priority=2, sampling=pb.SamplingParams(
            max_tokens=3)), timeout=10))
    assert [r.priority for r in stack.prefills[0].engine.requests] == [-5, 7, 0, 2]
    assert [r.priority for r in stack.decodes[0].engine.requests] == [-5, 7, 0, 2]
    for bad, words in (("high", "integer"), (1.5, "integer"), (2 ** 31, "[-2147483648, 2147483647]")):
        status, _, body = stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 3, "priority": bad})
        assert status == 400 and body["error"]["param"] == "priority" and words in body["error"]["message"], body


def test_truncate_prompt_tokens_keeps_a_prompts_last_tokens(make_stack, tokenizer):
    """vLLM's truncate_prompt_tokens: the engines get the prompt's last k tokens (-1: the context),
    a text too long for the context included; echo shows what was kept; out of range is 400."""
    stack = make_stack(max_model_len=64)
    long = "one two three four five six seven eight nine ten " * 12
    ids = tokenizer.encode(long)
    assert len(ids) > 64 and stack.post("/v1/completions", {"prompt": long, "max_tokens": 2})[0] == 400
    status, _, body = stack.post("/v1/completions", {"prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 10,
                                                     "echo": True})
    assert status == 200, body
    assert list(stack.decodes[0].engine.requests[-1].prompt_token_ids) == ids[-10:]
    assert body["choices"][0]["text"].startswith(tokenizer.decode(ids[-10:]))
    assert body["usage"]["prompt_tokens"] == 10
    short = tokenizer.encode("hi there")
    assert stack.post("/v1/completions", {"prompt": short, "max_tokens": 2, "truncate_prompt_tokens": -1})[0] == 200
    assert list(stack.decodes[0].engine.requests[-1].prompt_token_ids) == short
    messages = [{"role": "user", "content": long}]
    assert stack.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                               "truncate_prompt_tokens": 7})[0] == 200
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert list(stack.decodes[0].engine.requests[-1].prompt_token_ids) == \
        tokenizer.encode(rendered, add_special_tokens=False)[-7:]
    for bad in (0, -2, 65, "x"):
        status, _, body = stack.post("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": bad})
        assert status == 400 and body["error"]["param"] == "truncate_prompt_tokens", body


def test_allowed_token_ids_reach_the_engines(stack):
    assert stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "allowed_token_ids": [9, 4, 4]})[0] == 200
    assert stack.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                               "allowed_token_ids": [3]})[0] == 200
    assert [list(s.allowed_token_ids) for s in engine_samplings(stack)] == [[4, 9], [3]]
