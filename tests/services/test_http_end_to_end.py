"""Through the HTTP gateway: disaggregated over every transport, token-exact, no KV left behind."""
from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time

import aiohttp
import grpc
import pytest

from engine import LLM, SamplingParams
from services.api.pdserve.v1 import pdserve_pb2 as pb
from services.api.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from service_procs import Service, free_port, wait_http_ok

CASES = {"tcp-2x2": ("tcp", 2, 2, 64), "shm-1x1": ("shm", 1, 1, 8), "ucx-1x1": ("ucx", 1, 1, 8),
         "nccl-1x1": ("nccl", 1, 1, 8)}


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama", max_position_embeddings=512)


def workload(n: int) -> list[tuple[list[int], int]]:
    rng = random.Random(n)
    # Lengths past the prefill's 64-token budget are chunked there.
    return [([rng.randrange(10, 500) for _ in range(rng.choice((3, 17, 40, 90, 150)))], rng.randint(4, 24))
            for _ in range(n)]


async def stream_completion(session, url, prompt, max_tokens) -> tuple[str, str]:
    body = {"model": "tiny-test", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text = []
    async with session.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
    body["stream"] = False
    async with session.post(f"{url}/v1/completions", json=body) as r:
        whole = (await r.json())["choices"][0]["text"]
    return "".join(text), whole


async def load(address: str, stub_cls) -> pb.LoadReport:
    async with grpc.aio.insecure_channel(address) as ch:
        return await stub_cls(ch).GetLoad(pb.LoadRequest())


def idle(r: pb.LoadReport) -> bool:
    return r.num_running == 0 and r.num_waiting == 0 and r.num_pinned_blocks == 0 and r.kv_cache_usage == 0.0


@pytest.mark.parametrize("case", list(CASES))
def test_http_gateway_disaggregated_token_exact(model, case):
    transport, n_prefill, n_decode, n_requests = CASES[case]
    requests = workload(n_requests)
    llm = LLM(model)
    expected = [llm.generate([p], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))[0].outputs[0].text
                for p, m in requests]
    # The default 30 s lease outlives the 20 s wait below: a block a decode fails to give back fails the test.
    services = [Service("prefill", model, "--kv-transport", transport, "--max-num-batched-tokens", "64")
                for _ in range(n_prefill)]
    services += [Service("decode", model, "--kv-transport", transport) for _ in range(n_decode)]
    port = free_port()
    router = None
    try:
        for s in services:
            s.wait_ready()
        prefills = ",".join(s.address for s in services if s.role == "prefill")
        decodes = ",".join(s.address for s in services if s.role == "decode")
        router = subprocess.Popen([sys.executable, "-m", "services.cli", "router", "--model", model,
                                   "--served-model-name", "tiny-test", "--host", "127.0.0.1", "--port", str(port),
                                   "--grpc-port", "-1", "--prefill", prefills, "--decode", decodes,
                                   "--policy", "round_robin"])
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/health", router)

        async def main():
            async with aiohttp.ClientSession() as session:
                got = await asyncio.gather(*(stream_completion(session, url, p, m) for p, m in requests))
            for (streamed, whole), exp in zip(got, expected):
                assert streamed == whole == exp
            for s in services:  # no request left, no block pinned or used, on any instance
                stub = pb_grpc.PrefillStub if s.role == "prefill" else pb_grpc.DecodeStub
                deadline = time.monotonic() + 20
                while not idle(report := await load(s.address, stub)):
                    assert time.monotonic() < deadline, f"{s.role} {s.address} still holds KV: {report}"
                    await asyncio.sleep(0.05)

        asyncio.run(main())
    except BaseException:
        for s in services:
            print(f"--- {s.role} {s.address} log ---\n{s.output()}")
        raise
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        for s in services:
            s.stop()
