"""Thinking budgets through a real disaggregated stack (router with --reasoning-parser
deepseek_r1, a prefill and a decode over tcp): the output reasons greedily for the budget, then
the closing marker is forced (six tokens in this tokenizer: the prefill forces the first when the
budget is 0, the decode the rest), then the answer goes on greedily; token-exact against the
offline engine run without a budget, the marker spelled out."""
from __future__ import annotations

import openai
import pytest

from engine import LLM, SamplingParams
from engine.processor import load_tokenizer
from services.router.reasoning import END
from stack import SERVED_MODEL, Stack, StackSpec

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16
PROMPT = [17, 230, 41, 99, 5, 300, 41, 99]


@pytest.fixture(scope="module")
def llm(e2e_model):
    return LLM(e2e_model)


@pytest.fixture(scope="module")
def stack(e2e_model):
    with Stack(e2e_model, StackSpec(prefills=1, decodes=1, router_args=("--reasoning-parser", "deepseek_r1"))) as s:
        yield s


@pytest.fixture
def client(stack):
    c = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def greedy(llm: LLM, prompt: list[int], n: int) -> list[int]:
    if n <= 0:
        return []
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids


def budgeted(llm: LLM, prompt: list[int], budget: int, end: list[int]) -> list[int]:
    """Greedy for `budget` tokens, the marker, greedy to MAX_TOKENS: what the budget means."""
    head = greedy(llm, prompt, budget) + end
    return head + greedy(llm, prompt + head, MAX_TOKENS - len(head))


def test_completions_close_the_reasoning_at_the_budget(llm, e2e_model, client):
    tok = load_tokenizer(e2e_model)
    end = tok.encode(END, add_special_tokens=False)
    assert len(end) > 1  # the marker crosses from the prefill to the decode when the budget is 0
    plain = greedy(llm, PROMPT, MAX_TOKENS)
    assert all(plain[i:i + len(end)] != end for i in range(len(plain)))  # never written unforced
    for budget in (0, 1, 4, 9):
        want = budgeted(llm, PROMPT, budget, end)
        kwargs = dict(model=SERVED_MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                      extra_body={"ignore_eos": True, "thinking_token_budget": budget, "return_token_ids": True})
        whole = client.completions.create(**kwargs)
        assert whole.choices[0].model_extra["token_ids"] == want, budget
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
        assert streamed == whole.choices[0].text == tok.decode(want)
    # Past the output's length, the budget changes nothing.
    long = client.completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True, "thinking_token_budget": 100,
                                                 "return_token_ids": True})
    assert long.choices[0].model_extra["token_ids"] == plain


def test_chat_reasoning_is_the_budget_and_the_answer_follows(llm, e2e_model, client):
    tok = load_tokenizer(e2e_model)
    end = tok.encode(END, add_special_tokens=False)
    messages = [{"role": "user", "content": "What is two and two?"}]
    prompt = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    budget = 5
    want = budgeted(llm, prompt, budget, end)
    out = client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body={"ignore_eos": True,
                                                                    "thinking_token_budget": budget})
    message = out.choices[0].message
    assert message.model_extra["reasoning"] == tok.decode(want[:budget])
    assert message.content == tok.decode(want[budget + len(end):])
    assert out.usage.completion_tokens_details.reasoning_tokens == budget
    assert out.usage.completion_tokens == MAX_TOKENS
