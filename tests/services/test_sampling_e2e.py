"""The sampling surface through a real disaggregated stack with the official `openai` client:
penalties, logit_bias, bad words, n and best_of, against the offline engine."""
from __future__ import annotations

import openai
import pytest

from engine import LLM, SamplingParams
from engine.processor import load_tokenizer
from stack import SERVED_MODEL

pytestmark = pytest.mark.e2e

PROMPT = [17, 230, 41, 99, 5, 300, 41, 99]


@pytest.fixture(scope="module")
def llm(e2e_model):
    return LLM(e2e_model)


@pytest.fixture
def client(tcp_stack):
    c = openai.OpenAI(base_url=f"{tcp_stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def complete(client, **kwargs):
    return client.completions.create(model=SERVED_MODEL, prompt=PROMPT, **kwargs)


def test_n_seeded_samples_are_the_offline_engines_with_seed_plus_i(llm, client):
    knobs = dict(temperature=1.0, max_tokens=12, frequency_penalty=0.7, presence_penalty=0.2)
    out = complete(client, n=3, seed=7, logit_bias={"300": 4.0}, extra_body={"ignore_eos": True}, **knobs)
    want = [llm.generate([PROMPT], SamplingParams(seed=7 + i, ignore_eos=True, logit_bias={300: 4.0}, **knobs))[0]
            .outputs[0].text for i in range(3)]
    assert [c.text for c in out.choices] == want and len(set(want)) == 3
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(PROMPT), 36)
    again = complete(client, n=3, seed=7, logit_bias={"300": 4.0}, extra_body={"ignore_eos": True}, **knobs)
    assert [c.text for c in again.choices] == want


def test_greedy_with_penalties_is_token_exact(llm, client):
    knobs = dict(frequency_penalty=1.2, presence_penalty=0.3)
    extra = dict(repetition_penalty=1.3, ignore_eos=True)
    params = SamplingParams(temperature=0, max_tokens=16, logit_bias={41: 2.5}, **knobs, **extra)
    want = llm.generate([PROMPT], params)[0].outputs[0]
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert want.token_ids != plain.token_ids  # the penalties matter here
    out = complete(client, temperature=0, max_tokens=16, logit_bias={"41": 2.5}, extra_body=extra, **knobs)
    assert out.choices[0].text == want.text


def test_best_of_returns_the_samples_of_highest_cumulative_logprob(client):
    knobs = dict(temperature=1.0, max_tokens=8, seed=3, extra_body={"ignore_eos": True})
    every = complete(client, n=4, logprobs=0, **knobs)  # best_of's samples: seeds 3..6
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = complete(client, n=2, best_of=4, **knobs)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 32


def test_bad_words_never_appear(llm, e2e_model, client):
    tokenizer = load_tokenizer(e2e_model)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = llm.generate([PROMPT], greedy)[0].outputs[0].token_ids

    def banned(word: str) -> list[list[int]]:  # vLLM's rule: the word, and " word" if as many tokens
        ids = tokenizer.encode(word, add_special_tokens=False)
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        return [ids] + ([spaced] if spaced[0] != ids[0] and len(spaced) == len(ids) else [])

    # A word the greedy output holds as one token that the word's tokenizations ban.
    token, word = next((t, w) for t in plain if (w := tokenizer.decode([t]).strip()) and [t] in banned(w))
    out = complete(client, temperature=0, max_tokens=16, logprobs=0,
                   extra_body={"ignore_eos": True, "bad_words": [word]})
    assert out.choices[0].text != tokenizer.decode(plain)
    assert tokenizer.decode([token]) not in out.choices[0].logprobs.tokens
    offline = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                    bad_words_token_ids=banned(word)))[0].outputs[0]
    assert out.choices[0].text == offline.text and token not in offline.token_ids


def test_streamed_n_over_the_stack(client):
    kwargs = dict(temperature=0.9, seed=1, max_tokens=6, extra_body={"ignore_eos": True})
    whole = complete(client, n=2, **kwargs)
    texts = {}
    for chunk in complete(client, n=2, stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: whole.choices[0].text, 1: whole.choices[1].text}


def test_bad_input_is_400_and_the_stack_keeps_serving(client):
    for kwargs in (dict(presence_penalty=5), dict(logit_bias={"100000": 1}), dict(n=3, best_of=2), dict(n=100)):
        with pytest.raises(openai.BadRequestError):
            complete(client, max_tokens=2, **kwargs)
    assert complete(client, max_tokens=2).choices[0].finish_reason == "length"
