"""--generation-config (vLLM's): the model's generation_config.json sampling defaults apply to
the requests that do not set them, on every HTTP API; a request's own values win; `vllm` turns
them off; --override-generation-config goes on top; a bad file stops the router at start."""
from __future__ import annotations

import json

import pytest

from services.convert import sampling_from_proto
from services.router.generation_config import sampling_defaults

from router_harness import router_config

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def folder(tmp_path, name: str, files: dict) -> str:
    d = tmp_path / name
    d.mkdir()
    for file, content in files.items():
        (d / file).write_text(content if isinstance(content, str) else json.dumps(content))
    return str(d)


def test_the_defaults_a_model_folder_gives(tmp_path, caplog):
    qwen = folder(tmp_path, "qwen", {"generation_config.json": {**QWEN3, "max_new_tokens": 300,
                                                                "repetition_penalty": 1.05}})
    with caplog.at_level("WARNING"):
        got = sampling_defaults(qwen)
    assert got == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 300, "repetition_penalty": 1.05}
    assert "generation_config.json" in caplog.text and "--generation-config vllm" in caplog.text
    assert sampling_defaults(qwen, "vllm") == {}
    assert sampling_defaults(folder(tmp_path, "ids-only", {"generation_config.json": {"eos_token_id": 2}})) == {}
    # No generation_config.json: the same keys in config.json (transformers' from_model_config).
    old = folder(tmp_path, "old", {"config.json": {"vocab_size": 10, "temperature": 0.7}})
    assert sampling_defaults(old) == {"temperature": 0.7}
    assert sampling_defaults(folder(tmp_path, "bare", {})) == {}
    # Another folder's file; the override on top.
    assert sampling_defaults(old, qwen)["top_k"] == 20
    assert sampling_defaults(qwen, override={"temperature": 0.2, "min_p": 0.05})["temperature"] == 0.2
    assert sampling_defaults(qwen, "vllm", {"top_p": 0.5}) == {"top_p": 0.5}


@pytest.mark.parametrize("files, source, override, message", [
    ({"generation_config.json": "{not json"}, "auto", None, "is not JSON"),
    ({"generation_config.json": "[1, 2]"}, "auto", None, "not a JSON object"),
    ({"generation_config.json": {"temperature": -1}}, "auto", None, "temperature must be >= 0"),
    ({"generation_config.json": {"top_k": 2.5}}, "auto", None, "top_k must be an integer"),
    ({"generation_config.json": {"top_p": "0.9"}}, "auto", None, "top_p must be a number"),
    ({"generation_config.json": {"max_new_tokens": 0}}, "auto", None, "max_tokens must be an integer >= 1"),
    ({}, "elsewhere", None, "no generation_config.json there"),
    ({}, "auto", {"temprature": 0.5}, "unknown keys"),
])
def test_bad_defaults_stop_the_router_at_start(tmp_path, files, source, override, message):
    model = folder(tmp_path, "m", files)
    with pytest.raises(ValueError, match=message):
        sampling_defaults(model, str(tmp_path / "nowhere") if source == "elsewhere" else source, override)


def test_the_flags(tiny_model_path):
    def config(*argv):
        return router_config(tiny_model_path, *argv)

    c = config()
    assert (c.generation_config, c.override_generation_config) == ("auto", None)
    c = config("--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.3}')
    assert (c.generation_config, c.override_generation_config) == ("vllm", {"temperature": 0.3})
    with pytest.raises(SystemExit):
        config("--override-generation-config", "[0.3]")


def sampled(stack):
    """The SamplingParams the decode made of what it got for the last request (a field left
    unset on the wire reads as its neutral value)."""
    return sampling_from_proto(stack.decodes[0].engine.requests[-1].sampling)


def test_requests_sample_with_the_models_defaults(make_stack, tmp_path):
    qwen = folder(tmp_path, "qwen", {"generation_config.json": {**QWEN3, "max_new_tokens": 7}})
    stack = make_stack(prefill=1, decode=1, generation_config=qwen)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    status, _, body = stack.post("/v1/chat/completions", chat)
    assert status == 200, body
    s = sampled(stack)
    assert (round(s.temperature, 6), round(s.top_p, 6), s.top_k) == (0.6, 0.95, 20)
    assert s.max_tokens == 7 and body["usage"]["completion_tokens"] == 7  # max_new_tokens, in the room left
    # A request's own values win, field by field.
    stack.post("/v1/chat/completions", {**chat, "temperature": 0, "top_k": -1, "max_tokens": 3})
    s = sampled(stack)
    assert (s.temperature, round(s.top_p, 6), s.top_k, s.max_tokens) == (0.0, 0.95, -1, 3)
    # Completions keep their max_tokens default of 16 (vLLM's), and take the sampling defaults.
    stack.post("/v1/completions", {"prompt": "hi"})
    s = sampled(stack)
    assert (round(s.temperature, 6), s.top_k, s.max_tokens) == (0.6, 20, 16)
    # The Responses API (whose answer says what it sampled with) and the Messages API too.
    status, _, body = stack.post("/v1/responses", {"input": "hi"})
    assert status == 200 and (body["temperature"], body["top_p"]) == pytest.approx((0.6, 0.95))
    assert round(sampled(stack).temperature, 6) == 0.6
    stack.post("/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert (round(sampled(stack).temperature, 6), sampled(stack).top_k) == (0.6, 20)
    # --generation-config vllm: OpenAI's defaults.
    plain = make_stack(prefill=1, decode=1, generation_config="vllm")
    plain.post("/v1/chat/completions", {**chat, "max_tokens": 2})
    assert (sampled(plain).temperature, sampled(plain).top_p, sampled(plain).top_k) == (1.0, 1.0, 0)


def test_grpc_generate_takes_the_models_defaults_for_what_it_leaves_unset(make_stack, tmp_path):
    import grpc

    from services.api.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc

    qwen = folder(tmp_path, "qwen", {"generation_config.json": {**QWEN3, "max_new_tokens": 7, "min_p": 0.05,
                                                                "repetition_penalty": 1.1}})
    stack = make_stack(prefill=1, decode=1, generation_config=qwen)
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = pb_grpc.GenerateStub(channel)

        def generate(**sampling):
            chunks = list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**sampling)),
                                        timeout=30))
            assert chunks[-1].finish_reason
            return sampled(stack)

        s = generate()
        assert (round(s.temperature, 6), round(s.top_p, 6), s.top_k, round(s.min_p, 6)) == (0.6, 0.95, 20, 0.05)
        assert round(s.repetition_penalty, 6) == 1.1 and s.max_tokens == 16  # Generate's default, as completions'
        # Set, even to 0, wins, field by field: temperature 0 is greedy whatever the model says.
        s = generate(temperature=0, top_k=-1, min_p=0, max_tokens=3)
        assert (s.temperature, round(s.top_p, 6), s.top_k, s.min_p, s.max_tokens) == (0.0, 0.95, -1, 0.0, 3)
        s = generate(top_p=0.5, presence_penalty=0.25, repetition_penalty=1.0)
        assert (round(s.temperature, 6), s.top_p, s.presence_penalty, s.repetition_penalty) == (0.6, 0.5, 0.25, 1.0)
    # --generation-config vllm: nothing to apply, so unset is greedy (Generate's neutral values).
    plain = make_stack(prefill=1, decode=1, generation_config="vllm")
    with grpc.insecure_channel(plain.grpc_target) as channel:
        list(pb_grpc.GenerateStub(channel).Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams()),
                                                    timeout=30))
    s = sampled(plain)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (0.0, 1.0, 0, 0.0, 1.0)
