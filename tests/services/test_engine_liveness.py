"""An engine core that dies is noticed: requests in flight fail with UNAVAILABLE, the service exits
non-zero (its supervisor restarts it); a request id still in use is refused with ALREADY_EXISTS."""
from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from service_procs import Service, children_of

pytestmark = pytest.mark.e2e
LONG = pb.SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)


def test_a_dead_engine_core_fails_requests_and_stops_the_service(tiny_model_factory):
    model = tiny_model_factory("llama", max_position_embeddings=4096)
    svc = Service("colocated", model).wait_ready()
    try:
        (core,) = [p for p in children_of(svc.proc.pid)  # not multiprocessing's resource tracker
                   if "spawn_main" in open(f"/proc/{p}/cmdline").read()]

        async def main():
            async with grpc.aio.insecure_channel(svc.address) as ch:
                stub = pb_grpc.DecodeStub(ch)
                call = stub.Decode(pb.DecodeRequest(request_id="long", prompt_token_ids=[1, 2, 3], sampling=LONG))
                await call.read()  # it runs: its first tokens arrived
                with pytest.raises(grpc.aio.AioRpcError) as dup:  # the same id while it runs
                    async for _ in stub.Decode(pb.DecodeRequest(request_id="long", prompt_token_ids=[4, 5],
                                                                sampling=LONG)):
                        pass
                assert dup.value.code() == grpc.StatusCode.ALREADY_EXISTS
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    os.kill(core, signal.SIGKILL)  # mid-stream
                    while await call.read() is not grpc.aio.EOF:
                        pass
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "engine core process died" in err.value.details()

        asyncio.run(main())
        assert svc.proc.wait(60) != 0  # exits on its own, non-zero: its supervisor restarts it
        assert "its engine core died" in svc.output()
    except BaseException:
        print(f"--- service log ---\n{svc.output()}")
        raise
    finally:
        if svc.proc.poll() is None:
            svc.kill()


def test_an_aborted_decode_is_an_error_not_a_short_stream(e2e_model):
    svc = Service("colocated", e2e_model).wait_ready()
    try:
        async def main():
            async with grpc.aio.insecure_channel(svc.address) as ch:
                call = pb_grpc.DecodeStub(ch).Decode(pb.DecodeRequest(
                    request_id="victim", prompt_token_ids=[1, 2, 3],
                    sampling=pb.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)))
                await call.read()  # it runs
                found = await pb_grpc.EngineStub(ch).Abort(pb.AbortRequest(request_id="victim"))
                assert found.found
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while (msg := await call.read()) is not grpc.aio.EOF:
                        assert msg.finish_reason != "abort"
                assert err.value.code() == grpc.StatusCode.ABORTED

        asyncio.run(main())
    finally:
        assert svc.stop() == 0
