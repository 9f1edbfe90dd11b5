"""--stream-interval: a request's streamed updates after its first carry at least N tokens, and
every token, logprob and the text still arrive once, in order."""
from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.outputs import OutputKind, OutputProcessor
from engine.request import InvalidRequestError
from engine.scheduler_output import EngineCoreOutput


def steps(processor: OutputProcessor, rid: str, tokens: list[int], last: str | None = "length",
          logprobs: bool = False) -> list:
    """Feed one token a step (the last with `last` as its finish reason); every update out."""
    outs = []
    for i, tok in enumerate(tokens):
        final = i == len(tokens) - 1 and last is not None
        co = EngineCoreOutput(rid, [tok], finish_reason=last if final else None, finished=final,
                              new_logprobs=[(-0.5 * i, [])] if logprobs else None,
                              queue_time=0.25 if i == 0 else None)
        got, _ = processor.process([co])
        outs += got
    return outs


def test_updates_hold_back_until_the_interval_and_lose_nothing():
    p = OutputProcessor(None, OutputKind.DELTA, stream_interval=4)
    p.add("r", None, [1, 2, 3], SamplingParams(max_tokens=11, logprobs=0))
    outs = steps(p, "r", list(range(100, 111)), logprobs=True)
    # The first token goes at once, then four at a time; the finish flushes the remainder.
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 4, 4, 2]
    assert [t for o in outs for t in o.outputs[0].token_ids] == list(range(100, 111))
    assert [t for o in outs for t in o.delta_token_ids] == list(range(100, 111))
    assert [next(iter(e.values())) for o in outs for e in o.outputs[0].logprobs] == [-0.5 * i for i in range(11)]
    assert outs[0].queue_time == 0.25 and [o.finished for o in outs] == [False, False, False, True]
    assert outs[-1].outputs[0].finish_reason == "length" and not p.states


def test_an_abort_carries_the_tokens_held_back():
    p = OutputProcessor(None, OutputKind.DELTA, stream_interval=8)
    p.add("r", None, [1], SamplingParams(max_tokens=100))
    outs = steps(p, "r", [5, 6, 7, 8], last=None)
    assert [o.outputs[0].token_ids for o in outs] == [[5]]
    aborted = p.abort("r")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert aborted.outputs[0].token_ids == [6, 7, 8]


def test_one_and_non_streaming_kinds_are_unchanged():
    p = OutputProcessor(None, OutputKind.DELTA)
    p.add("r", None, [1], SamplingParams(max_tokens=3))
    assert [o.outputs[0].token_ids for o in steps(p, "r", [5, 6, 7])] == [[5], [6], [7]]
    final_only = OutputProcessor(None, OutputKind.FINAL_ONLY, stream_interval=4)
    final_only.add("r", None, [1], SamplingParams(max_tokens=3))
    assert [o.outputs[0].token_ids for o in steps(final_only, "r", [5, 6, 7])] == [[5, 6, 7]]
    with pytest.raises(ValueError, match="stream_interval"):
        OutputProcessor(None, OutputKind.DELTA, stream_interval=0)


def test_a_request_raises_its_own_interval_never_lowers_it():
    """SamplingParams.stream_interval (vLLM's per-request field): above the engine's it holds that
    request's updates to it; below, the engine's stands; other requests keep the engine's."""
    p = OutputProcessor(None, OutputKind.DELTA, stream_interval=3)
    for rid, si in (("own", 5), ("low", 2), ("none", None)):
        p.add(rid, None, [1], SamplingParams(max_tokens=12, stream_interval=si))
    sizes = {rid: [len(o.outputs[0].token_ids) for o in steps(p, rid, list(range(12)))]
             for rid in ("own", "low", "none")}
    assert sizes == {"own": [1, 5, 5, 1], "low": [1, 3, 3, 3, 2], "none": [1, 3, 3, 3, 2]}
    one = OutputProcessor(None, OutputKind.DELTA)  # the default engine: the request's alone
    one.add("r", None, [1], SamplingParams(max_tokens=9, stream_interval=4))
    assert [len(o.outputs[0].token_ids) for o in steps(one, "r", list(range(9)))] == [1, 4, 4]
    cumulative = OutputProcessor(None, OutputKind.CUMULATIVE)  # the offline API: every step, whole
    cumulative.add("r", None, [1], SamplingParams(max_tokens=3, stream_interval=4))
    assert [o.outputs[0].token_ids for o in steps(cumulative, "r", [5, 6, 7])] == [[5], [5, 6], [5, 6, 7]]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(InvalidRequestError, match="stream_interval"):
            SamplingParams(stream_interval=bad)


def test_a_wide_top_n_takes_fewer_tokens_an_update(monkeypatch):
    """An update travels as one gRPC message: a request asking for logprobs as wide as the
    vocabulary gets fewer tokens an update than the interval says (engine and request alike),
    every token still there once, in order."""
    from engine import outputs

    monkeypatch.setattr(outputs, "MAX_LOGPROB_ENTRIES_PER_MESSAGE", 100)
    p = OutputProcessor(None, OutputKind.DELTA, stream_interval=8)
    p.add("wide", None, [1], SamplingParams(max_tokens=12, logprobs=24, stream_interval=64))  # 100 // 25
    p.add("narrow", None, [1], SamplingParams(max_tokens=12, logprobs=1))
    wide, narrow = steps(p, "wide", list(range(12)), logprobs=True), steps(p, "narrow", list(range(12)))
    assert [len(o.outputs[0].token_ids) for o in wide] == [1, 4, 4, 3]
    assert [t for o in wide for t in o.outputs[0].token_ids] == list(range(12))
    assert [len(o.outputs[0].token_ids) for o in narrow] == [1, 8, 3]


def test_engine_streams_in_intervals_token_exact(tiny_llama):
    """Through the engine (its core in its own process): the same greedy tokens and text as the
    offline API, the first update at the first token, then updates of at least the interval, and a
    stop string still ends the request where it matched."""
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    prompts = ["The old king", "Green river stone", "a b c"]
    expected = LLM(tiny_llama).generate(prompts, params)
    stop_at = expected[0].outputs[0].text[5:9]
    stopped = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True, stop=[stop_at])
    expected_stop = LLM(tiny_llama).generate(prompts[:1], stopped)[0].outputs[0]

    async def stream(engine, prompt, p):
        return [out async for out in engine.generate(prompt, p)]

    async def main():
        engine = await AsyncEngine.create(tiny_llama, multiprocess=True, stream_interval=5)
        try:
            results = await asyncio.gather(*(stream(engine, p, params) for p in prompts))
            for outs, exp in zip(results, expected):
                sizes = [len(o.delta_token_ids) for o in outs]
                # The first update goes at once; a reader that fell behind gets it merged with the
                # next (the generator sends a backlog as one), so only its lower bound holds.
                assert all(n >= 5 for n in sizes[1:-1]) and sum(sizes) == 23 and len(sizes) <= 6, sizes
                assert [t for o in outs for t in o.delta_token_ids] == exp.outputs[0].token_ids
                assert "".join(o.delta_text for o in outs) == exp.outputs[0].text
            outs = await stream(engine, prompts[0], stopped)
            assert outs[-1].outputs[0].finish_reason == "stop"
            assert "".join(o.delta_text for o in outs) == expected_stop.text
            assert [t for o in outs for t in o.delta_token_ids] == expected_stop.token_ids
        finally:
            await engine.shutdown()

    asyncio.run(main())
