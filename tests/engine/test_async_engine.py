"""AsyncEngine: streams, aborts, and the engine core in its own process."""
from __future__ import annotations

import asyncio

import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from engine.async_engine import AsyncEngine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


async def collect(engine: AsyncEngine, prompt, params=GREEDY):
    """(final output, every streamed token id, the streamed text): the stream carries deltas."""
    final, token_ids, text = None, [], ""
    async for out in engine.generate(prompt, params):
        assert out.outputs[0].token_ids == out.delta_token_ids and out.outputs[0].text == out.delta_text
        token_ids += out.delta_token_ids
        text += out.delta_text
        final = out
    return final, token_ids, text


@pytest.mark.parametrize("multiprocess", [False, True], ids=["thread", "process"])
def test_async_matches_offline_and_streams(tiny_llama, multiprocess):
    prompts = ["The old king", "Green river stone", "a b c", "Winter"]
    expected = LLM(tiny_llama).generate(prompts, GREEDY)

    async def main():
        engine = await AsyncEngine.create(tiny_llama, multiprocess=multiprocess)
        try:
            results = await asyncio.gather(*(collect(engine, p) for p in prompts))
            for (final, token_ids, text), exp in zip(results, expected):
                assert final.finished and final.outputs[0].finish_reason == "length"
                assert token_ids == exp.outputs[0].token_ids and text == exp.outputs[0].text
            with pytest.raises(InvalidRequestError):
                await collect(engine, "")
            # Abort by leaving the stream early: the engine keeps serving and frees the request.
            agen = engine.generate("The old king", SamplingParams(max_tokens=200, ignore_eos=True))
            await agen.__anext__()
            await agen.aclose()
            assert not engine.streams
            _, token_ids, _ = await collect(engine, prompts[0])
            assert token_ids == expected[0].outputs[0].token_ids
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


def test_abort_ends_a_waiting_generate_with_an_aborted_output(tiny_llama):
    async def main():
        engine = await AsyncEngine.create(tiny_llama)
        try:
            outputs = []

            async def consume():
                async for out in engine.generate("The old king", SamplingParams(max_tokens=500, ignore_eos=True),
                                                 request_id="victim"):
                    outputs.append(out)

            task = asyncio.create_task(consume())
            while not outputs:
                await asyncio.sleep(0.005)
            engine.abort("victim")  # from elsewhere: e.g. the service's Abort RPC
            await asyncio.wait_for(task, timeout=10)
            assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
            assert not engine.streams
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_admission_control_sheds_beyond_the_bounds_and_recovers(tiny_llama):
    from engine.request import EngineOverloadedError

    async def main():
        # One running, one waiting: a third request in flight is refused, not queued without end.
        engine = await AsyncEngine.create(tiny_llama, max_num_seqs=1, max_waiting_requests=1)
        try:
            long = SamplingParams(max_tokens=300, ignore_eos=True)
            held = [engine.generate([5, 6, 7], long), engine.generate([8, 9], long)]
            await held[0].__anext__()  # running
            waiting = asyncio.ensure_future(held[1].__anext__())
            await asyncio.sleep(0)  # the second is queued (its first output needs the seat)
            assert len(engine.streams) == 2
            with pytest.raises(EngineOverloadedError, match="at capacity"):
                await collect(engine, "The old king")
            assert engine.stats()["num_requests_shed"] == 1
            await held[0].aclose()
            await waiting
            await held[1].aclose()
            final, _, _ = await collect(engine, "The old king")  # room again
            assert final.outputs[0].finish_reason == "length"
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_inflight_prompts_count_a_shared_prefix_once():
    from engine.async_engine import InflightPrompts

    inflight = InflightPrompts(block_size=4, shared=True)
    prefix = list(range(100, 112))  # three full blocks
    for i, tail in enumerate(([1, 2], [3, 4, 5, 6, 7])):  # 14 tokens (3 blocks + 2), 17 (4 blocks + 1)
        added, keys = inflight.cost(prefix + tail)
        assert added == (14 if i == 0 else 5)  # the second adds its own block and its last token
        inflight.add(f"r{i}", prefix + tail, keys)
    assert inflight.total == 19
    salted, keys = inflight.cost(prefix + [1, 2], cache_salt="tenant-b")  # another tenant shares nothing
    assert salted == 14
    inflight.remove("r0")
    assert inflight.total == 17  # r1 still holds the prefix
    inflight.remove("r1")
    inflight.remove("r1")  # twice (finished, then aborted) is harmless
    assert inflight.total == 0 and not inflight._refs
    whole = InflightPrompts(block_size=4, shared=False)  # no prefix caching: every prompt whole
    whole.add("a", prefix + [1, 2], whole.cost(prefix + [1, 2])[1])
    assert whole.cost(prefix + [1, 2]) == (14, []) and whole.total == 14


def test_admission_counts_shared_prefixes_once(tiny_llama):
    from engine.request import EngineOverloadedError

    async def main():
        # 16 blocks of 16 tokens: at most 512 prompt tokens in flight. Six 200-token prompts with
        # one 192-token prefix hold 192 + 6 x 8 tokens of KV; counted whole they were 1,200.
        engine = await AsyncEngine.create(tiny_llama, num_blocks=16, block_size=16, max_num_seqs=4)

        async def drain(prompt, params, rid):
            async for _ in engine.generate(prompt, params, request_id=rid):
                pass

        long = SamplingParams(max_tokens=1500, ignore_eos=True)  # in flight for the whole test
        prefix = [(7 * i) % 500 + 10 for i in range(192)]
        tasks = []
        try:
            assert engine.max_inflight_tokens == 512
            tasks = [asyncio.ensure_future(drain(prefix + [600 + i] * 8, long, f"t{i}")) for i in range(6)]
            await asyncio.sleep(0)  # each has called add_request
            assert len(engine.streams) == 6 and engine._inflight.total == 192 + 6 * 8
            with pytest.raises(EngineOverloadedError, match="shared prefixes once"):  # 240 + 300 > 512
                await collect(engine, [20 + i % 400 for i in range(300)])
            # Another tenant's salt shares nothing: its prompt counts whole, and a third one no longer fits.
            tasks.append(asyncio.ensure_future(drain(prefix + [600] * 8, SamplingParams(
                max_tokens=1500, ignore_eos=True, cache_salt="tenant-b"), "b0")))
            await asyncio.sleep(0)
            assert len(engine.streams) == 7 and engine._inflight.total == 240 + 200
            with pytest.raises(EngineOverloadedError):
                await collect(engine, prefix + [600] * 8, SamplingParams(max_tokens=1, cache_salt="tenant-c"))
            assert engine.stats()["num_requests_shed"] == 2
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert engine._inflight.total == 0 and not engine.streams
            await engine.shutdown()

    asyncio.run(main())


def _expect_merged(pieces, expected):
    """The streamed pieces put together are the offline output: tokens, text, logprobs."""
    assert [p.outputs[0].token_ids for p in pieces] == [p.delta_token_ids for p in pieces]
    assert sum((p.delta_token_ids for p in pieces), []) == expected.token_ids
    assert "".join(p.outputs[0].text for p in pieces) == expected.text
    got = [e for p in pieces for e in p.outputs[0].logprobs]
    for p in pieces:
        assert len(p.outputs[0].logprobs) == len(p.outputs[0].token_ids)
    assert [list(e) for e in got] == [list(e) for e in expected.logprobs]  # the same tokens, sampled first
    assert [v for e in got for v in e.values()] == pytest.approx([v for e in expected.logprobs for v in e.values()],
                                                                 abs=1e-4)
    assert pieces[-1].finished and pieces[-1].outputs[0].finish_reason == "length"


def test_a_consumer_that_falls_behind_gets_the_backlog_as_one_output(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2)
    expected = LLM(tiny_llama).generate(["The old king"], params)[0].outputs[0]

    async def main():
        engine = await AsyncEngine.create(tiny_llama, multiprocess=True)
        try:
            async def finished_unread():  # nobody reads until the engine has produced every step
                while engine.streams:
                    await asyncio.sleep(0.01)

            whole = [out async for out in engine.generate("The old king", params, admitted=finished_unread)]

            stream = engine.generate("The old king", params)
            first = await stream.__anext__()
            await finished_unread()  # every later step's output is queued while nobody reads
            rest = [out async for out in stream]
            return whole, first, rest
        finally:
            await engine.shutdown()

    whole, first, rest = asyncio.run(main())
    # All 64 steps' outputs were queued before the first read: one output carries them all.
    assert len(whole) == 1 and len(whole[0].delta_token_ids) == 64
    _expect_merged(whole, expected)
    # Read once, then fallen behind: whatever the first read did not take (it may itself have
    # merged a few steps when the engine ran ahead of it) comes as one output.
    assert not first.finished and len(rest) == 1
    _expect_merged([first, *rest], expected)


def test_an_engine_death_behind_a_backlog_comes_after_it():
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.request import EngineDeadError

    def delta(ids, finished=False):
        return RequestOutput("r", None, [1], [CompletionOutput(0, "x" * len(ids), list(ids), None, None, None)],
                             finished, delta_text="x" * len(ids), delta_token_ids=list(ids))

    engine, aborted, q = AsyncEngine.__new__(AsyncEngine), [], asyncio.Queue()
    engine.add_request = lambda *a, **k: ("r", q)
    engine.abort = aborted.append

    async def main():
        for item in (delta([3]), delta([4, 5]), EngineDeadError("core died"), delta([6])):
            q.put_nowait(item)
        stream, got = engine.generate([1], SamplingParams()), []
        with pytest.raises(EngineDeadError, match="core died"):
            async for out in stream:
                got.append(out.delta_token_ids)
        return got

    assert asyncio.run(main()) == [[3, 4, 5]]
    assert aborted == []  # a dead engine has nothing left to abort


@pytest.mark.parametrize("multiprocess", [False, True], ids=["thread", "process"])
def test_load_counts_a_request_the_core_has_not_taken_in(tiny_llama, multiprocess):
    # A core in a long step (a long prompt on a CPU runs a second) takes nothing in and reports
    # nothing: a request sent meanwhile counts in the outstanding tokens at once, or a router
    # polling this engine sees it idle and sends it the next request too. Held here: a stopped
    # process, or a thread core held before it takes the request in.
    import os
    import signal
    import threading

    async def settled(engine, check):
        for _ in range(500):
            stats = engine.stats()
            if check(stats):
                return stats
            await asyncio.sleep(0.01)
        raise AssertionError(f"stats never settled: {stats}")

    async def main():
        engine = await AsyncEngine.create(tiny_llama, multiprocess=multiprocess)
        try:
            await collect(engine, "warm up")
            await settled(engine, lambda s: s.get("outstanding_tokens") == 0 and s.get("requests_received") == 1)
            prompt = list(range(5, 45))
            params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
            if multiprocess:
                pid = engine.client.proc.pid
                os.kill(pid, signal.SIGSTOP)
                resume = lambda: os.kill(pid, signal.SIGCONT)  # noqa: E731
            else:
                loop, gate = engine.client._loop, threading.Event()
                handle = loop._handle
                loop._handle = lambda msg: (gate.wait(), handle(msg))
                resume = gate.set
            try:
                stream = asyncio.ensure_future(collect(engine, prompt, params))
                await asyncio.sleep(0.2)
                assert engine.stats()["outstanding_tokens"] == len(prompt) + 30
                assert engine.stats()["requests_received"] == 1  # the core has not taken it
            finally:
                resume()
            final, token_ids, _ = await stream
            assert len(token_ids) == 30
            # Taken in, computed and finished: counted once, then not at all.
            await settled(engine, lambda s: s["requests_received"] == 2 and s["outstanding_tokens"] == 0)
        finally:
            await engine.shutdown()

    asyncio.run(main())


FRONT_END = """
import asyncio, sys
from engine.async_engine import AsyncEngine

async def main():
    engine = await AsyncEngine.create(sys.argv[1], multiprocess=True)
    print(engine.client.in_addr, engine.client.out_addr, engine.client.proc.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_a_killed_front_end_leaves_no_ipc_socket_files(tiny_llama):
    """SIGKILL of the process holding the engine: its core exits (SIGTERM on its parent's death)
    and takes the IPC sockets' files with it, which the front end's shutdown would have unlinked."""
    import os
    import signal
    import subprocess
    import sys

    from service_procs import poll_until

    root = __file__.rsplit("/tests/", 1)[0]
    proc = subprocess.Popen([sys.executable, "-c", FRONT_END, tiny_llama], cwd=root, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": root})
    try:
        in_addr, out_addr, core = proc.stdout.readline().split()
        paths = [in_addr.removeprefix("ipc://"), out_addr.removeprefix("ipc://")]
        assert all(os.path.exists(p) for p in paths)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert poll_until(lambda: not os.path.exists(f"/proc/{core}"), timeout=60), "the core outlived its front end"
        assert not any(os.path.exists(p) for p in paths), paths
    finally:
        if proc.poll() is None:
            proc.kill()
