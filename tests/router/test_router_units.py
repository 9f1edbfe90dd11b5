"""Small pieces: addresses, the tokenizer fast path, stream merging, logprob shapes."""
from __future__ import annotations

import asyncio
import copy

import pytest

from engine.request import InvalidRequestError
from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.convert import sampling_from_proto, sampling_kwargs, sampling_to_proto
from services.router.config import parse_addresses
from services.router.openai_format import chat_logprobs
from services.router.served_model import ServedModel, _RustCodec, make_codec
from services.router.streams import merge


def test_parse_addresses():
    assert parse_addresses("a:1, b:2,,a:1") == ("a:1", "b:2")
    assert parse_addresses(["a:1,b:2", "c:3"]) == ("a:1", "b:2", "c:3")
    assert parse_addresses("[::1]:50051") == ("[::1]:50051",)
    for bad in ("a", "a:", ":5", "a:0", "a:x", "a:70000"):
        with pytest.raises(ValueError, match="host:port"):
            parse_addresses(bad)


def test_proto_zeros_mean_unset_where_zero_is_not_usable():
    kw = sampling_kwargs(pb.SamplingParams(stop=["x"]))
    assert (kw["max_tokens"], kw["temperature"], kw["top_p"]) == (None, 0.0, 1.0)
    assert kw["seed"] is None and kw["logprobs"] is None
    assert kw["stop"] == ("x",)  # engines get them too: a decode stops where one matches
    assert sampling_kwargs(pb.SamplingParams(top_p=0.5, seed=0))["top_p"] == 0.5
    with pytest.raises(InvalidRequestError, match="max_tokens"):  # engines get it set, always
        sampling_from_proto(pb.SamplingParams())
    with pytest.raises(InvalidRequestError, match="top_p"):  # only zero is "unset"
        sampling_from_proto(pb.SamplingParams(max_tokens=2, top_p=-0.5))
    p = pb.SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, seed=3, stop=["a"], stop_token_ids=[9],
                          logprobs=2, skip_special_tokens=True)
    assert sampling_to_proto(sampling_from_proto(p)) == p
    # stream_interval: unset stays unset (the engine's own interval), a value travels as sent.
    assert sampling_from_proto(p).stream_interval is None
    p.stream_interval = 7
    assert sampling_from_proto(p).stream_interval == 7
    assert sampling_to_proto(sampling_from_proto(p)) == p
    with pytest.raises(InvalidRequestError, match="stream_interval"):
        sampling_from_proto(pb.SamplingParams(max_tokens=2, stream_interval=0))


def test_fast_codec_agrees_with_the_tokenizer(tokenizer):
    codec = make_codec(tokenizer)
    assert isinstance(codec, _RustCodec)
    for text in ("The quick brown fox", " </s>x<s> ", "\u00fc\u00f1\u00ef \U0001f600", "a" * 300, ""):
        for add in (True, False):
            ids = tokenizer.encode(text, add_special_tokens=add)
            assert codec.encode(text, add) == ids
            assert codec.decode(ids, True) == tokenizer.decode(ids, skip_special_tokens=True)


def test_codec_falls_back_when_transformers_post_processes(tokenizer):
    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert make_codec(cleaning) is cleaning


def test_served_model_limits(tiny_model_path, tokenizer):
    model = ServedModel(tiny_model_path, "m", tokenizer=tokenizer)
    assert model.max_model_len == 2048 and model.vocab_size == 977
    model.on_load_report(pb.LoadReport(max_model_len=1024))
    model.on_load_report(pb.LoadReport(max_model_len=4096))
    assert model.max_model_len == 1024
    assert ServedModel(tiny_model_path, "m", max_model_len=100, tokenizer=tokenizer).max_model_len == 100


def test_chat_top_logprobs_rank_the_sampled_token_among_the_others(tiny_model_path, tokenizer):
    model = ServedModel(tiny_model_path, "m", tokenizer=tokenizer)
    # The engines send the sampled token, then the other top tokens.
    lp = pb.TokenLogprob(token_id=10, logprob=-2.0, top=[pb.TopLogprob(token_id=11, logprob=-1.0),
                                                          pb.TopLogprob(token_id=12, logprob=-3.0)])
    top = chat_logprobs(model, [10], [lp], 2)["content"][0]["top_logprobs"]
    assert [t["logprob"] for t in top] == [-1.0, -2.0]
    assert chat_logprobs(model, [10], [lp], 0)["content"][0]["top_logprobs"] == []


def test_merge_interleaves_and_cancels_the_rest_on_error():
    closed = []

    async def numbers(name, n, fail=False):
        try:
            for i in range(n):
                await asyncio.sleep(0)
                yield f"{name}{i}"
            if fail:
                raise RuntimeError(name)
            await asyncio.Event().wait()  # never ends by itself
        finally:
            closed.append(name)

    async def main():
        got = []
        with pytest.raises(RuntimeError, match="b"):
            async for i, item in merge([numbers("a", 3), numbers("b", 2, fail=True)]):
                got.append((i, item))
        return got

    got = asyncio.run(main())
    assert (1, "b1") in got and all(item.startswith("ab"[i]) for i, item in got)
    assert sorted(closed) == ["a", "b"]
