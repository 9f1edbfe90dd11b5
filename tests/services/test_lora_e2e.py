"""LoRA adapters through a real disaggregated stack (a prefill and a decode over tcp, each with
--enable-lora --lora-modules; the router with --lora-modules): a request's model name picks the
adapter, the prefill computes the prompt's KV with it, the decode goes on with it; token-exact
against the offline engine, and the base model beside it unchanged."""
from __future__ import annotations

import os

import openai
import pytest

from engine import LLM, SamplingParams
from service_procs import poll_until
from stack import SERVED_MODEL, Stack, StackSpec

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
PROMPT = [17, 230, 41, 99, 5, 300, 41, 99, 12, 400, 73]


@pytest.fixture(scope="module")
def adapter(e2e_model, tiny_lora_factory) -> str:
    return tiny_lora_factory(e2e_model, 11, rank=8)


@pytest.fixture(scope="module")
def runtime_adapter(e2e_model, tiny_lora_factory) -> str:
    return tiny_lora_factory(e2e_model, 12, rank=4, targets=("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def stack(e2e_model, adapter, runtime_adapter):
    # One device slot each (--max-loras 1): adapters loaded at run time wait in host memory and
    # take the slot from "ada" for their requests (and give it back); one adapter in host memory
    # (--max-cpu-loras 1): the others read back from their files when they run.
    lora = ("--enable-lora", "--lora-modules", f"ada={adapter}", "--max-loras", "1", "--max-cpu-loras", "1")
    spec = StackSpec(prefills=1, decodes=1, prefill_args=lora, decode_args=lora,
                     router_args=("--lora-modules", f"ada={adapter}", "ghost=/nowhere",
                                  "--allow-runtime-lora-updating",
                                  "--lora-resolver-dir", os.path.dirname(runtime_adapter)))
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


def test_an_adapter_loaded_at_run_time_serves_token_exact_then_unloads(stack, e2e_model, runtime_adapter, offline,
                                                                       tmp_path):
    """vLLM's /v1/load_lora_adapter through the router: the prefill and the decode both load it, the
    answers match the offline engine started with it; a checkpoint that does not load is a 400 and
    leaves nothing behind; after /v1/unload_lora_adapter the name is a 404 and the stack serves on."""
    want = LLM(e2e_model, enable_lora=True, lora_modules=[f"late={runtime_adapter}"]).generate(
        [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, lora_name="late"))
    want = want[0].outputs[0].token_ids
    assert want not in (offline["ada"], offline[None])
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 64, "lora_alpha": 16}')
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        status, text = stack.post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": runtime_adapter})
        assert status == 200 and text == b"Success: LoRA adapter 'late' added successfully."
        for stream in (False, True):
            out = client.completions.create(model="late", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=stream, extra_body={"ignore_eos": True, "return_token_ids": True})
            chunks = list(out) if stream else [out]
            assert [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []] == want, stream
        status, err = stack.post("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(tmp_path)})
        assert status == 400 and "outside [1, --max-lora-rank 16]" in err["error"]["message"]
        assert "big" not in {m.id for m in client.models.list().data}
        status, _ = stack.post("/v1/unload_lora_adapter", {"lora_name": "late"})
        assert status == 200
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="late", prompt=PROMPT, max_tokens=2)
        out = client.completions.create(model="ada", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == offline["ada"]
        for service in (*stack.prefills, *stack.decodes):  # "late" came to the slot and went; "ada" back
            # ... "ada" read back from its files: "late"'s load took its place in host memory. The
            # gauges come from the engine's stats, which reach /metrics after the answer may.
            want_gauges = {"pdserve:lora_swaps_total": lambda v: v >= 1, "pdserve:lora_adapters_on_device": 1,
                           "pdserve:lora_reloads_total": lambda v: v >= 1, "pdserve:lora_adapters_in_host_memory": 1}

            def settled(service=service):
                got = {name: service.metric(name) for name in want_gauges}
                return all(want(got[n]) if callable(want) else got[n] == want for n, want in want_gauges.items())

            assert poll_until(settled, timeout=10), {name: service.metric(name) for name in want_gauges}
        # Loaded again: the freed slot takes it, the answers the same.
        assert stack.post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": runtime_adapter})[0] == 200
        out = client.completions.create(model="late", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == want
    stack.wait_idle()



def test_the_resolver_serves_an_adapter_folder_named_by_a_request(stack, e2e_model, runtime_adapter):
    """--lora-resolver-dir: the adapter's folder name as the model loads it on both engines first."""
    name = os.path.basename(runtime_adapter)
    want = LLM(e2e_model, enable_lora=True, lora_modules=[f"{name}={runtime_adapter}"]).generate(
        [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, lora_name=name))
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.model == name and out.choices[0].model_extra["token_ids"] == want[0].outputs[0].token_ids
        with pytest.raises(openai.NotFoundError):  # no such folder
            client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
    stack.post("/v1/unload_lora_adapter", {"lora_name": name})
    stack.wait_idle()
