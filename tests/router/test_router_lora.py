"""LoRA adapters at the router (vLLM's --lora-modules): a request's model name picks the adapter on
every front, the engines are asked for it, /v1/models lists it under the base model, and the
adapter's prefix-cache key goes into KV-aware routing."""
from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from engine.block_hash import hash_request_tokens, lora_key
from engine.kv_events import BlockStored, KVEventBatch
from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc
from services.router.kv_index import KvIndex
from services.router.policy import KvAware, RouteRequest

from router_harness import router_config

MODULES = (("sql", "/adapters/sql"), ("chat", "/adapters/chat"))
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def stack(make_stack):
    return make_stack(lora_modules=MODULES)


def asked(stack) -> str:
    """The adapter the last engine request ran with ("" for the base model)."""
    return stack.decodes[0].engine.requests[-1].sampling.lora_name


def test_the_model_name_picks_the_adapter_on_every_front(stack):
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
                       ("/v1/messages", {"messages": HI, "max_tokens": 2})):
        for model, lora in (("sql", "sql"), ("chat", "chat"), ("tiny", "")):
            status, _, out = stack.post(path, {**body, "model": model})
            assert status == 200, (path, model, out)
            assert asked(stack) == lora and out["model"] == model, (path, model)
        status, _, err = stack.post(path, {**body, "model": "nope"})
        assert status == 404, path
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = pb_grpc.GenerateStub(channel)
        list(stub.Generate(pb.GenerateRequest(model="sql", text="hi", sampling=pb.SamplingParams(max_tokens=2))))
        assert asked(stack) == "sql"
        list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2))))
        assert asked(stack) == ""


def test_models_lists_the_adapters_under_the_base_model(stack):
    status, _, body = stack.request("GET", "/v1/models")
    cards = {c["id"]: c for c in body["data"]}
    assert list(cards) == ["tiny", "sql", "chat"]
    assert cards["tiny"]["parent"] is None
    assert cards["sql"]["parent"] == "tiny" and cards["sql"]["root"] == "/adapters/sql"
    status, _, card = stack.request("GET", "/v1/models/chat")
    assert status == 200 and card["root"] == "/adapters/chat"


def test_kv_aware_routing_hashes_the_prompt_with_the_adapters_key():
    """The engines key an adapter's blocks with ("lora", name, path): the router's hashes must
    match them, or a prompt cached under the adapter would look uncached (and the base model's
    blocks would look like its)."""
    prompt, bs = list(range(64)), 16
    key = lora_key("sql", dict(MODULES))
    index = KvIndex()
    stream = index.add_stream("e1", "tcp://x:1", "", epoch=1, block_size=bs)
    stored = BlockStored(hash_request_tokens(prompt, bs, lora=key), None, prompt, bs, None, "GPU", "sql")
    assert index.apply(stream, 0, KVEventBatch(ts=0.0, events=[stored], epoch=1))
    policy = KvAware(index, overlap_weight=1.0)
    e1 = SimpleNamespace(address="e1", load_score=0)
    assert policy.costs([e1], RouteRequest("a", "prefill", prompt, lora=key)) == [0]
    assert policy.costs([e1], RouteRequest("b", "prefill", prompt)) == [64]


def test_the_flag_in_its_forms_and_names_that_clash(tiny_model_path, monkeypatch):
    config = router_config(tiny_model_path, "--lora-modules", "sql=/a", '{"name": "chat", "path": "/b"}')
    assert config.lora_modules == (("sql", "/a"), ("chat", "/b"))
    monkeypatch.setenv("PDSERVE_ROUTER_LORA_MODULES", "x=/x y=/y")
    assert router_config(tiny_model_path).lora_modules == (("x", "/x"), ("y", "/y"))
    monkeypatch.delenv("PDSERVE_ROUTER_LORA_MODULES")
    with pytest.raises(ValueError, match="a name of its own"):
        router_config(tiny_model_path, "--served-model-name", "m", "--lora-modules", "m=/a")
    with pytest.raises(ValueError, match="a name of its own"):
        router_config(tiny_model_path, "--lora-modules", "a=/1", "a=/2")
