"""Request priority (vLLM's `priority`, lower is sooner) through the gateway: with the engines on
--scheduling-policy priority, an urgent request waiting on a busy decode runs before an earlier,
less urgent one, all token-exact; an engine on FCFS refuses a priority instead of ignoring it."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from engine import LLM, SamplingParams
from stack import SERVED_MODEL, Stack, StackSpec

pytestmark = pytest.mark.e2e

LONG, SHORT = 400, 6  # tokens: the long request holds the decode while the others queue


def test_a_waiting_urgent_request_goes_before_an_earlier_one_all_token_exact(e2e_model):
    """A decode that runs one request at a time (--max-num-seqs 1) is busy with a long one; a
    request of priority 10 queues there, then one of priority -1: the later, urgent one runs
    first (vLLM's priority scheduling orders the waiting queue, and preempts by it when KV runs
    short), and every answer is the reference's."""
    policy = ("--scheduling-policy", "priority")
    prompts = [[(11 * k) % 400 + 20 for k in range(30)], [(5 * k + 7) % 400 + 20 for k in range(25)],
               [(3 * k + 1) % 400 + 20 for k in range(20)]]
    lengths = (LONG, SHORT, SHORT)
    expected = [o.outputs[0].text for o in LLM(e2e_model).generate(prompts, [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths])]
    spec = StackSpec(prefill_args=policy, decode_args=(*policy, "--max-num-seqs", "1"))
    with Stack(e2e_model, spec) as stack:
        decode = stack.decodes[0]
        done: list[str] = []

        async def complete(session, name: str, i: int, priority: int) -> str:
            body = {"model": SERVED_MODEL, "prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0,
                    "ignore_eos": True, "priority": priority}
            async with session.post(f"{stack.url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                text = (await r.json())["choices"][0]["text"]
            done.append(name)
            return text

        async def waiting(n: int) -> None:
            while (await asyncio.to_thread(decode.load)).num_waiting < n:
                await asyncio.sleep(0.002)

        async def main():
            async with aiohttp.ClientSession() as session:
                long = asyncio.create_task(complete(session, "long", 0, 0))
                while (await asyncio.to_thread(decode.load)).num_running < 1:
                    await asyncio.sleep(0.002)
                later = asyncio.create_task(complete(session, "priority 10", 1, 10))
                await asyncio.wait_for(waiting(1), 30)
                urgent = asyncio.create_task(complete(session, "priority -1", 2, -1))
                await asyncio.wait_for(waiting(2), 30)
                assert not done, f"{done} finished before both waited: the long request was too short"
                return await asyncio.gather(long, later, urgent)

        texts = asyncio.run(main())
        assert list(texts) == expected
        assert done == ["long", "priority -1", "priority 10"]
        stack.wait_idle()


def test_an_fcfs_engine_refuses_a_priority(tcp_stack):
    stack = tcp_stack
    status, body = stack.post("/v1/completions", {"model": SERVED_MODEL, "prompt": "hi", "max_tokens": 2,
                                                  "priority": 3})
    assert status == 400 and "--scheduling-policy priority" in body["error"]["message"], body
    status, body = stack.post("/v1/completions", {"model": SERVED_MODEL, "prompt": "hi", "max_tokens": 2,
                                                  "priority": 0})
    assert status == 200, body
    stack.wait_idle()
