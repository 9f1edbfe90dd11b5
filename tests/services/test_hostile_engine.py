"""The engines refuse at their door what the core would index or divide with (out-of-vocabulary stop
ids, top_k beyond the vocabulary, non-finite floats, over-long stop lists): INVALID_ARGUMENT on
Prefill and Decode, 400 through the gateway, and the engines keep serving."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from test_engine_services import GREEDY, disaggregated

pytestmark = pytest.mark.e2e
PROMPT = [7, 8, 9, 10, 11]


@pytest.mark.parametrize("sampling,message", [
    # An out-of-vocabulary stop id with min_tokens > 0 once raised IndexError in the sampler and
    # killed the engine core; vLLM refuses such ids up front, and so do the engines now.
    (pb.SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[10 ** 6]), "stop_token_ids"),
    (pb.SamplingParams(max_tokens=4, stop_token_ids=[-3]), "stop_token_ids"),
    (pb.SamplingParams(max_tokens=4, stop_token_ids=list(range(300))), "at most 256"),
    (pb.SamplingParams(max_tokens=4, top_k=2 ** 31 - 1), "top_k"),
    (pb.SamplingParams(max_tokens=4, temperature=float("nan")), "temperature"),
    (pb.SamplingParams(max_tokens=4, temperature=float("inf")), "temperature"),
])
def test_engines_refuse_what_the_core_indexes_with(tcp_stack, sampling, message):
    prefill, decode = tcp_stack.prefills[0], tcp_stack.decodes[0]

    async def refused(call) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert message in err.value.details()

    async def drain(stream) -> None:
        async for _ in stream:
            pass

    async def main():
        before = await disaggregated(prefill.address, decode.address, PROMPT, f"before-{message}")
        async with grpc.aio.insecure_channel(prefill.address) as pc, grpc.aio.insecure_channel(decode.address) as dc:
            await refused(pb_grpc.PrefillStub(pc).Prefill(pb.PrefillRequest(
                request_id="bad", prompt_token_ids=PROMPT, sampling=sampling, publish_kv=True)))
            for extra in ({}, {"first_token_id": 12, "kv_handle": b"never-published"}):
                await refused(drain(pb_grpc.DecodeStub(dc).Decode(pb.DecodeRequest(
                    request_id="bad", prompt_token_ids=PROMPT, sampling=sampling, **extra))))
        after = await disaggregated(prefill.address, decode.address, PROMPT, f"after-{message}")
        assert after == before and len(after) == GREEDY.max_tokens

    asyncio.run(main())


def test_the_gateway_answers_400_and_keeps_serving(tcp_stack):
    for extra, param in (({"stop_token_ids": [10 ** 6], "min_tokens": 2}, "stop_token_ids"),
                         ({"top_k": 2 ** 31}, "top_k"), ({"seed": 2 ** 63}, "seed"),
                         ({"temperature": 1e308}, "temperature")):
        status, body = tcp_stack.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **extra})
        assert status == 400, body
        assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"
    status, body = tcp_stack.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                      "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
