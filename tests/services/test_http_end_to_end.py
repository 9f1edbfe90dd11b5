"""Through the HTTP gateway: disaggregated over every transport, token-exact, no KV left behind."""
from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from engine import LLM, SamplingParams
from service_procs import metric
from stack import SERVED_MODEL

pytestmark = pytest.mark.e2e


def workload(n: int) -> list[tuple[list[int], int]]:
    rng = random.Random(n)
    # Lengths past the prefill's 64-token budget are chunked there; none is a whole number of blocks.
    return [([rng.randrange(10, 500) for _ in range(rng.choice((3, 17, 40, 90, 150)))], rng.randint(4, 24))
            for _ in range(n)]


async def stream_choices(session, url, body) -> list[dict]:
    """Every streamed chunk's choices, in order."""
    choices = []
    async with session.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                choices += json.loads(line[6:])["choices"]
    return choices


async def stream_completion(session, url, prompt, max_tokens) -> tuple[str, str]:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text = [c["text"] for c in await stream_choices(session, url, body)]
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


def test_stream_interval_sends_fewer_chunks_and_every_token(llm, e2e_model):
    """A decode started with --stream-interval 6: after the prefill's token and the decode's first,
    each streamed chunk through the router carries at least 6 tokens (the last may carry fewer),
    the text is the reference's, and the router's inter-token histogram still counts tokens."""
    from stack import Stack, StackSpec

    max_tokens = 26
    prompts = [[(7 * i + 3 * k) % 480 + 10 for k in range(20 + 13 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    expected = [o.outputs[0] for o in llm.generate(prompts, params)]

    with Stack(e2e_model, StackSpec(decode_args=("--stream-interval", "6"))) as stack:
        itl = "pdserve:router_inter_token_latency_seconds_count"
        before = stack.router.metric(itl)

        async def main():
            async with aiohttp.ClientSession() as session:
                return await asyncio.gather(*(stream_choices(session, stack.url, {
                    "model": SERVED_MODEL, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "logprobs": 0}) for p in prompts))

        got = asyncio.run(main())
        for chunks, exp in zip(got, expected):
            assert "".join(c["text"] for c in chunks) == exp.text
            sizes = [len(c["logprobs"]["tokens"]) for c in chunks if c["logprobs"]]
            assert sum(sizes) == max_tokens
            # The prefill's token, then the decode's first update (merged with the next when the
            # decode's stream fell behind), then at least 6 a chunk.
            assert sizes[0] == 1 and all(n >= 6 for n in sizes[2:-1]), sizes
        assert stack.router.metric(itl) - before == len(prompts) * (max_tokens - 1)

        # A request's own stream_interval (vLLM's field) raises the decode's for it alone, one below
        # the decode's changes nothing, and a text stop string (the router's) still cuts the output
        # where it matched, though it now arrives inside a chunk.
        stop_at = expected[0].text[8:12]
        stopped = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                           stop=[stop_at]))[0].outputs[0]

        async def own():
            base = {"model": SERVED_MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "logprobs": 0}
            async with aiohttp.ClientSession() as session:
                return await asyncio.gather(
                    stream_choices(session, stack.url, {**base, "prompt": prompts[1], "stream_interval": 9}),
                    stream_choices(session, stack.url, {**base, "prompt": prompts[2], "stream_interval": 2}),
                    stream_choices(session, stack.url, {**base, "prompt": prompts[0], "stream_interval": 9,
                                                        "stop": [stop_at]}))

        def decoded(name: str, labels: dict | None = None) -> float:
            return sum(metric(d.metrics_port, name, labels) for d in stack.decodes)

        tokens = decoded("pdserve:generation_tokens_total")
        stops = decoded("pdserve:request_success_total", {"finished_reason": "stop"})
        nine, two, stop = asyncio.run(own())
        for chunks, exp, interval in ((nine, expected[1], 9), (two, expected[2], 6)):
            assert "".join(c["text"] for c in chunks) == exp.text
            sizes = [len(c["logprobs"]["tokens"]) for c in chunks if c["logprobs"]]
            assert sum(sizes) == max_tokens
            assert sizes[0] == 1 and all(n >= interval for n in sizes[2:-1]), sizes
        assert "".join(c["text"] for c in stop) == stopped.text
        assert stop[-1]["finish_reason"] == "stop"
        # The decode stopped that request itself, at the token that completed the stop string (its
        # engine finds it too), instead of generating on until the router aborted it.
        assert decoded("pdserve:request_success_total", {"finished_reason": "stop"}) == stops + 1
        assert decoded("pdserve:generation_tokens_total") - tokens == 2 * max_tokens + len(stopped.token_ids)

        # A stop string that begins in the prefill's token and ends in the decode's first: the
        # decode reads the prefill's token too, so it finishes the request itself as stopped (a
        # not-streamed request's tokens reach the router 64 a message: it could not have cut it).
        from engine.processor import load_tokenizer

        tok = load_tokenizer(e2e_model)
        for exp, prompt in zip(expected, prompts):
            first, two = tok.decode(exp.token_ids[:1]), tok.decode(exp.token_ids[:2])
            start = max(0, len(first) - 3)
            spanning = two[start:len(first) + 3]
            # It spans the boundary, first matches there, and the decode's own text never holds
            # it: only a decode that reads the prefill's token can stop on it.
            if (first and len(two) > len(first) and two.find(spanning) == start
                    and spanning not in tok.decode(exp.token_ids[1:])):
                break
        else:
            pytest.fail("no prompt's first two tokens give a stop string that spans them")
        tokens = decoded("pdserve:generation_tokens_total")
        stops = decoded("pdserve:request_success_total", {"finished_reason": "stop"})
        status, body = stack.post("/v1/completions", {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                      "temperature": 0, "ignore_eos": True, "stop": [spanning]})
        assert status == 200 and body["choices"][0]["text"] == first[:start], body
        assert decoded("pdserve:request_success_total", {"finished_reason": "stop"}) == stops + 1
        assert decoded("pdserve:generation_tokens_total") - tokens < max_tokens - 1  # not run to its length
