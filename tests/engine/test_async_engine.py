"""AsyncEngine: streams, aborts, and the engine core in its own process."""
from __future__ import annotations

import asyncio

import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from engine.async_engine import AsyncEngine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


async def collect(engine: AsyncEngine, prompt, params=GREEDY):
    final, deltas = None, []
    async for out in engine.generate(prompt, params):
        deltas.append(out.delta_text)
        final = out
    return final, "".join(deltas)


@pytest.mark.parametrize("multiprocess", [False, True], ids=["thread", "process"])
def test_async_matches_offline_and_streams(tiny_llama, multiprocess):
    prompts = ["The old king", "Green river stone", "a b c", "Winter"]
    expected = [o.outputs[0].token_ids for o in LLM(tiny_llama).generate(prompts, GREEDY)]

    async def main():
        engine = await AsyncEngine.create(tiny_llama, multiprocess=multiprocess)
        try:
            results = await asyncio.gather(*(collect(engine, p) for p in prompts))
            for (final, streamed), exp in zip(results, expected):
                assert final.finished and final.outputs[0].token_ids == exp
                assert streamed == final.outputs[0].text
            with pytest.raises(InvalidRequestError):
                await collect(engine, "")
            # Abort by leaving the stream early: the engine keeps serving and frees the request.
            agen = engine.generate("The old king", SamplingParams(max_tokens=200, ignore_eos=True))
            await agen.__anext__()
            await agen.aclose()
            assert not engine.streams
            final, _ = await collect(engine, prompts[0])
            assert final.outputs[0].token_ids == expected[0]
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_inproc_abort_frees_blocks(tiny_llama):
    async def main():
        engine = await AsyncEngine.create(tiny_llama)
        try:
            agen = engine.generate("The old king", SamplingParams(max_tokens=500, ignore_eos=True))
            await agen.__anext__()
            await agen.aclose()
            core = engine.client.core
            for _ in range(200):  # the abort crosses a thread: poll with a deadline
                if not core.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            assert not core.has_unfinished_requests()
            core.check_integrity(expect_all_free=True)
        finally:
            await engine.shutdown()

    asyncio.run(main())
