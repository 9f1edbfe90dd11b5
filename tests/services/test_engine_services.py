"""Engine services over gRPC: disaggregated over every transport, bad input, faults, drain."""
from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from engine import LLM, SamplingParams
from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from service_procs import Service, alive, children_of, metric, poll_until

GREEDY = pb.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama", max_position_embeddings=512)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(500) for _ in range(n)] for n in (1, 16, 33, 150)]


@pytest.fixture(scope="module")
def expected(model, prompts):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in LLM(model).generate(prompts, params)]


async def disaggregated(prefill: str, decode: str, prompt, request_id: str, sampling=GREEDY):
    async with grpc.aio.insecure_channel(prefill) as pc, grpc.aio.insecure_channel(decode) as dc:
        first = await pb_grpc.PrefillStub(pc).Prefill(pb.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling, publish_kv=True))
        tokens = [first.first_token_id]
        async for r in pb_grpc.DecodeStub(dc).Decode(pb.DecodeRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                first_token_id=first.first_token_id, kv_handle=first.kv_handle)):
            tokens += r.token_ids
        return tokens


async def load(address: str, stub=pb_grpc.PrefillStub) -> pb.LoadReport:
    async with grpc.aio.insecure_channel(address) as ch:
        return await stub(ch).GetLoad(pb.LoadRequest())


async def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("transport", ["tcp", "shm", "ucx", "nccl"])
def test_disaggregated_over_every_transport(model, prompts, expected, transport):
    prefill = Service("prefill", model, "--kv-transport", transport, "--max-num-batched-tokens", "64")
    decode = Service("decode", model, "--kv-transport", transport)
    try:
        prefill.wait_ready()
        decode.wait_ready()

        async def main():
            got = await asyncio.gather(*(disaggregated(prefill.address, decode.address, p, f"{transport}-{i}")
                                         for i, p in enumerate(prompts)))
            assert got == expected
            # Every pinned block goes back once decode has pulled: no KV leak.
            await wait_for(lambda: _no_pinned(prefill.address))
            await wait_for(lambda: _idle(decode.address, pb_grpc.DecodeStub))

        asyncio.run(main())
    except BaseException:
        print(f"--- prefill log ---\n{prefill.output()}\n--- decode log ---\n{decode.output()}")
        raise
    finally:
        assert prefill.stop() == 0
        assert decode.stop() == 0


async def _no_pinned(address: str) -> bool:
    return (await load(address)).num_pinned_blocks == 0


@pytest.fixture(scope="module")
def pair(model):
    prefill = Service("prefill", model, "--kv-transport", "tcp")
    decode = Service("decode", model, "--kv-transport", "tcp")
    prefill.wait_ready()
    decode.wait_ready()
    yield prefill, decode
    prefill.stop()
    decode.stop()


@pytest.mark.parametrize("request_kwargs,message", [
    (dict(prompt_token_ids=[], sampling=GREEDY), "empty"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=2, temperature=-1)), "temperature"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=2, top_p=1.5)), "top_p"),
    (dict(prompt_token_ids=[5] * 600, sampling=GREEDY), "context"),
    (dict(prompt_token_ids=[10 ** 8], sampling=GREEDY), "vocabulary"),
])
def test_bad_input_is_invalid_argument_and_service_keeps_serving(pair, prompts, expected, request_kwargs, message):
    prefill, decode = pair

    async def main():
        async with grpc.aio.insecure_channel(prefill.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.PrefillStub(ch).Prefill(pb.PrefillRequest(request_id="bad", **request_kwargs))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in err.value.details()
        async with grpc.aio.insecure_channel(decode.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in pb_grpc.DecodeStub(ch).Decode(pb.DecodeRequest(request_id="bad", **request_kwargs)):
                    pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert await disaggregated(prefill.address, decode.address, prompts[1], "after-bad") == expected[1]

    asyncio.run(main())


def test_wrong_role_is_failed_precondition(pair):
    prefill, decode = pair

    async def main():
        async with grpc.aio.insecure_channel(decode.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.PrefillStub(ch).Prefill(pb.PrefillRequest(
                    request_id="r", prompt_token_ids=[1, 2], sampling=GREEDY, publish_kv=True))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    asyncio.run(main())


def test_client_disconnect_frees_blocks_on_both_sides(pair):
    prefill, decode = pair
    long = pb.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def main():
        prompt = list(range(100, 180))
        async with grpc.aio.insecure_channel(prefill.address) as pc, grpc.aio.insecure_channel(decode.address) as dc:
            first = await pb_grpc.PrefillStub(pc).Prefill(pb.PrefillRequest(
                request_id="gone", prompt_token_ids=prompt, sampling=long, publish_kv=True))
            call = pb_grpc.DecodeStub(dc).Decode(pb.DecodeRequest(
                request_id="gone", prompt_token_ids=prompt, sampling=long,
                first_token_id=first.first_token_id, kv_handle=first.kv_handle))
            async for _ in call:
                break  # a few tokens arrived; the client goes away
            call.cancel()
        loop = asyncio.get_running_loop()
        start = loop.time()
        await wait_for(lambda: _idle(decode.address, pb_grpc.DecodeStub), timeout=5)
        await wait_for(lambda: _no_pinned(prefill.address), timeout=5)
        assert loop.time() - start < 1.5

        # A prefill whose handle is never consumed: Abort frees the pinned blocks at once.
        async with grpc.aio.insecure_channel(prefill.address) as pc:
            stub = pb_grpc.PrefillStub(pc)
            await stub.Prefill(pb.PrefillRequest(request_id="unused", prompt_token_ids=prompt,
                                                 sampling=long, publish_kv=True))

            async def pinned() -> bool:  # load reports lag the engine by up to ~50 ms
                return (await stub.GetLoad(pb.LoadRequest())).num_pinned_blocks > 0

            await wait_for(pinned, timeout=2)
            await stub.Abort(pb.AbortRequest(request_id="unused"))
        await wait_for(lambda: _no_pinned(prefill.address), timeout=2)

    asyncio.run(main())


async def _idle(address: str, stub) -> bool:
    r = await load(address, stub)
    return r.num_running == 0 and r.num_waiting == 0 and r.kv_cache_usage == 0.0


def test_failed_pull_recomputes_and_stays_exact(model, prompts, expected):
    # The decode side holds another secret: every handle fails to verify, decode recomputes.
    prefill = Service("prefill", model, "--kv-transport", "tcp")
    decode = Service("decode", model, "--kv-transport", "tcp", secret="not-the-same-secret")
    try:
        prefill.wait_ready()
        decode.wait_ready()

        async def main():
            for i, p in enumerate(prompts[:2]):
                assert await disaggregated(prefill.address, decode.address, p, f"fb-{i}") == expected[i]

        asyncio.run(main())
        fallbacks = "pdserve:kv_recomputed_fallbacks_total"
        poll_until(lambda: metric(decode.metrics_port, fallbacks) >= 2, 5)  # engine stats arrive within ~50 ms
        assert metric(decode.metrics_port, fallbacks) == 2.0
    finally:
        prefill.stop()
        decode.stop()


def test_sigterm_drains_and_leaves_no_process_behind(model):
    svc = Service("colocated", model).wait_ready()
    engine_core = children_of(svc.proc.pid)
    assert engine_core, "the engine core runs in a child process"

    async def main():
        async with grpc.aio.insecure_channel(svc.address) as ch:
            call = pb_grpc.DecodeStub(ch).Decode(pb.DecodeRequest(
                request_id="inflight", prompt_token_ids=[1, 2, 3],
                sampling=pb.SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)))
            got = []
            async for r in call:
                if not got:
                    svc.proc.send_signal(15)  # SIGTERM mid-stream: the stream still completes
                got += r.token_ids
            assert len(got) == 60

    asyncio.run(main())
    assert svc.proc.wait(60) == 0
    poll_until(lambda: not alive(engine_core), 10)  # exited children are reaped by init shortly after
    left = {p: open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in alive(engine_core)}
    assert not left, f"processes outlived their service: {left}"
