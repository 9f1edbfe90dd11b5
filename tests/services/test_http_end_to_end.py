"""Through the HTTP gateway: disaggregated over every transport, token-exact, no KV left behind."""
from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from engine import LLM, SamplingParams
from stack import SERVED_MODEL

pytestmark = pytest.mark.e2e


def workload(n: int) -> list[tuple[list[int], int]]:
    rng = random.Random(n)
    # Lengths past the prefill's 64-token budget are chunked there; none is a whole number of blocks.
    return [([rng.randrange(10, 500) for _ in range(rng.choice((3, 17, 40, 90, 150)))], rng.randint(4, 24))
            for _ in range(n)]


async def stream_completion(session, url, prompt, max_tokens) -> tuple[str, str]:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
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


@pytest.fixture(scope="module")
def llm(e2e_model):
    return LLM(e2e_model)


def test_http_gateway_disaggregated_token_exact(llm, transport_stack):
    # Concurrent streams: 64 over tcp's two prefills and two decodes, 8 over each other transport.
    requests = workload(64 if len(transport_stack.decodes) > 1 else 8)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    expected = [o.outputs[0].text for o in llm.generate([p for p, _ in requests], params)]

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(stream_completion(session, transport_stack.url, p, m)
                                          for p, m in requests))

    # Each prompt is sent twice (streamed, then whole); afterwards no request is left, no block
    # pinned or used, on any instance.
    with transport_stack.one_transfer_per_request(2 * len(requests)):
        got = asyncio.run(main())
    for (streamed, whole), exp in zip(got, expected):
        assert streamed == whole == exp
