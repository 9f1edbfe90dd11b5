"""LoRA adapters through a real disaggregated stack (a prefill and a decode over tcp, each with
--enable-lora --lora-modules; the router with --lora-modules): a request's model name picks the
adapter, the prefill computes the prompt's KV with it, the decode goes on with it; token-exact
against the offline engine, and the base model beside it unchanged."""
from __future__ import annotations

import openai
import pytest

from engine import LLM, SamplingParams
from stack import SERVED_MODEL, Stack, StackSpec

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
PROMPT = [17, 230, 41, 99, 5, 300, 41, 99, 12, 400, 73]


@pytest.fixture(scope="module")
def adapter(e2e_model, tiny_lora_factory) -> str:
    return tiny_lora_factory(e2e_model, 11, rank=8)


@pytest.fixture(scope="module")
def stack(e2e_model, adapter):
    lora = ("--enable-lora", "--lora-modules", f"ada={adapter}")
    spec = StackSpec(prefills=1, decodes=1, prefill_args=lora, decode_args=lora,
                     router_args=("--lora-modules", f"ada={adapter}", "ghost=/nowhere"))
    with Stack(e2e_model, spec) as s:
        yield s


@pytest.fixture(scope="module")
def offline(e2e_model, adapter) -> dict:
    llm = LLM(e2e_model, enable_lora=True, lora_modules=[f"ada={adapter}"])
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                          lora_name=name) for name in ("ada", None)])
    return {"ada": outs[0].outputs[0].token_ids, None: outs[1].outputs[0].token_ids}


def test_the_model_name_picks_the_adapter_through_prefill_and_decode(stack, offline):
    assert offline["ada"] != offline[None]
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        for name, want in (("ada", offline["ada"]), (SERVED_MODEL, offline[None])):
            out = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            assert out.model == name
            assert out.choices[0].model_extra["token_ids"] == want, name
            streamed = list(client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                      temperature=0, stream=True,
                                                      extra_body={"ignore_eos": True, "return_token_ids": True}))
            assert [t for c in streamed for t in c.choices[0].model_extra.get("token_ids") or []] == want
        models = {m.id: m for m in client.models.list().data}
        assert models["ada"].parent == SERVED_MODEL and models["ada"].root.endswith(stack.spec.router_args[1][4:])
        # The router knows an adapter the engines do not serve: their refusal, as a 400.
        with pytest.raises(openai.BadRequestError, match="'ghost' is not an adapter this engine serves"):
            client.completions.create(model="ghost", prompt=PROMPT, max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nobody", prompt=PROMPT, max_tokens=2)
    stack.wait_idle()
