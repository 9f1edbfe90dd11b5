"""Engine services over gRPC: disaggregated over every transport, bad input, wrong role, faults,
more requests than seats, drain."""
from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from engine import LLM, SamplingParams
from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from service_procs import Service, alive, children_of, poll_until
from stack import NUM_BLOCKS, Stack, StackSpec

pytestmark = pytest.mark.e2e

GREEDY = pb.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(e2e_model):
    return LLM(e2e_model)


def reference(llm, prompts, max_tokens: int = 10) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(500) for _ in range(n)] for n in (1, 16, 33, 150)]


@pytest.fixture(scope="module")
def expected(llm, prompts):
    return reference(llm, prompts)


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


def run_disaggregated(stack: Stack, prompts, tag: str, sampling=GREEDY) -> list[list[int]]:
    """All prompts at once, each from a prefill to a decode (every pairing the stack has)."""
    p, d = stack.prefills, stack.decodes

    async def main():
        return await asyncio.gather(*(
            disaggregated(p[i % len(p)].address, d[i // len(p) % len(d)].address, prompt, f"{tag}-{i}", sampling)
            for i, prompt in enumerate(prompts)))

    return asyncio.run(main())


def test_disaggregated_over_every_transport(transport_stack, prompts, expected):
    # Leaving the block one transfer_per_request waits for also checks that every pinned block went
    # back once a decode pulled it: no KV leak.
    with transport_stack.one_transfer_per_request(len(prompts)):
        got = run_disaggregated(transport_stack, prompts, transport_stack.spec.transport)
    assert got == expected


@pytest.mark.parametrize("request_kwargs,message", [
    (dict(prompt_token_ids=[], sampling=GREEDY), "empty"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=2, temperature=-1)), "temperature"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=2, top_p=1.5)), "top_p"),
    (dict(prompt_token_ids=[5] * 600, sampling=GREEDY), "context"),
    (dict(prompt_token_ids=[10 ** 8], sampling=GREEDY), "vocabulary"),
])
def test_bad_input_is_invalid_argument_and_service_keeps_serving(tcp_stack, prompts, expected, request_kwargs,
                                                                  message):
    prefill, decode = tcp_stack.prefills[0], tcp_stack.decodes[0]

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
        # Not a whole number of blocks: sent again and again, it is still pulled every time.
        assert await disaggregated(prefill.address, decode.address, prompts[2], f"after-bad-{message}") == expected[2]

    with tcp_stack.one_transfer_per_request(1):
        asyncio.run(main())


@pytest.fixture(scope="module")
def colocated(e2e_model):
    svc = Service("colocated", e2e_model, "--num-blocks", NUM_BLOCKS).wait_ready()
    yield svc
    assert svc.stop() == 0, svc.output()


def test_wrong_role_is_refused_with_its_own_code(tcp_stack, colocated):
    request = dict(request_id="r", prompt_token_ids=[1, 2], sampling=GREEDY)
    with grpc.insecure_channel(tcp_stack.decodes[0].address) as ch:
        with pytest.raises(grpc.RpcError) as err:  # a decode does not serve Prefill at all
            pb_grpc.PrefillStub(ch).Prefill(pb.PrefillRequest(publish_kv=True, **request), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with grpc.insecure_channel(tcp_stack.prefills[0].address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.DecodeStub(ch).Decode(pb.DecodeRequest(**request), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # A colocated instance serves Decode, but has no connector to pull a prefill's KV with.
    with grpc.insecure_channel(colocated.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.DecodeStub(ch).Decode(pb.DecodeRequest(first_token_id=7, kv_handle=b"handle", **request),
                                               timeout=10))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # ... and without one it computes the prompt itself.
        tokens = [t for r in pb_grpc.DecodeStub(ch).Decode(pb.DecodeRequest(**request), timeout=30)
                  for t in r.token_ids]
    assert len(tokens) == GREEDY.max_tokens
    report = colocated.load()
    assert report.role == "colocated"
    assert report.max_num_batched_tokens == 2048  # the default step budget: the router's measure of a queue


def test_client_disconnect_frees_blocks_on_both_sides(tcp_stack):
    prefill, decode = tcp_stack.prefills[0], tcp_stack.decodes[0]
    long = pb.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    prompt = list(range(100, 180))

    async def main():
        async with grpc.aio.insecure_channel(prefill.address) as pc, grpc.aio.insecure_channel(decode.address) as dc:
            first = await pb_grpc.PrefillStub(pc).Prefill(pb.PrefillRequest(
                request_id="gone", prompt_token_ids=prompt, sampling=long, publish_kv=True))
            call = pb_grpc.DecodeStub(dc).Decode(pb.DecodeRequest(
                request_id="gone", prompt_token_ids=prompt, sampling=long,
                first_token_id=first.first_token_id, kv_handle=first.kv_handle))
            async for _ in call:
                break  # a few tokens arrived
            # The decode's load says so too (it lags the engine by ~50 ms); now the client goes away.
            assert poll_until(lambda: decode.load().num_running == 1, 5)
            call.cancel()

    asyncio.run(main())
    start = time.monotonic()
    tcp_stack.wait_idle(timeout=5)
    assert time.monotonic() - start < 1.5

    # A prefill whose handle is never consumed: the Engine service's Abort frees the pinned blocks at once.
    with grpc.insecure_channel(prefill.address) as ch:
        pb_grpc.PrefillStub(ch).Prefill(pb.PrefillRequest(request_id="unused", prompt_token_ids=prompt,
                                                          sampling=long, publish_kv=True), timeout=30)
        assert poll_until(lambda: prefill.load().num_pinned_blocks > 0, 2)  # load lags the engine by ~50 ms
        pb_grpc.EngineStub(ch).Abort(pb.AbortRequest(request_id="unused"), timeout=10)
    assert poll_until(lambda: prefill.load().num_pinned_blocks == 0, 2)


def test_failed_pull_recomputes_and_stays_exact(e2e_model, prompts, expected):
    # The decode side holds another secret: every handle fails to verify, decode recomputes.
    spec = StackSpec(router=False, decode_secret="not-the-same-secret")
    with Stack(e2e_model, spec) as stack:
        before = stack.kv_counts()
        assert run_disaggregated(stack, prompts[:2], "fb") == expected[:2]
        want = {"published": 2, "transfers": 0, "recomputed": 2}
        assert stack.kv_delta(before, want) == want


def test_more_concurrent_requests_than_decode_seats(e2e_model, llm):
    # Twelve requests at once on a decode with four seats: the rest wait for room holding only a
    # lease on their prefill's blocks, and each is pulled when it is admitted.
    rng = random.Random(12)
    prompts = [[rng.randrange(500) for _ in range(rng.choice((5, 20, 37, 70, 130)))] for _ in range(12)]
    sampling = pb.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    spec = StackSpec(router=False, decode_args=("--max-num-seqs", "4"))
    with Stack(e2e_model, spec) as stack:
        with stack.one_transfer_per_request(len(prompts)):
            got = run_disaggregated(stack, prompts, "seats", sampling)
        assert got == reference(llm, prompts, max_tokens=24)
        decode = stack.decodes[0]
        assert decode.proc.poll() is None and decode.serving()
        with stack.one_transfer_per_request(1):
            assert run_disaggregated(stack, prompts[:1], "after", sampling) == got[:1]


def test_sigterm_drains_and_leaves_no_process_behind(e2e_model):
    svc = Service("colocated", e2e_model).wait_ready()
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

    try:
        asyncio.run(main())
        assert svc.proc.wait(60) == 0
    except BaseException:
        print(f"--- colocated log ---\n{svc.output()}")
        svc.stop()
        raise
    poll_until(lambda: not alive(engine_core), 10)  # exited children are reaped by init shortly after
    left = {p: open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in alive(engine_core)}
    assert not left, f"processes outlived their service: {left}"
