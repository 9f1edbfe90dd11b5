"""--async-scheduling: step n+1 is queued before step n's tokens reach the CPU, and what users get
is exactly what they get without it (tokens, logprobs, finish reasons, aborts), with no KV left."""
from __future__ import annotations

import random

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.request import Request


def make_core(path: str, device: str, async_scheduling: bool, **kwargs) -> EngineCore:
    return EngineCore(EngineConfig.create(path, device=device, async_scheduling=async_scheduling, **kwargs))


def drive(core: EngineCore, requests: list[tuple[list[int], SamplingParams]], abort_at: dict[str, int] = {}):
    """Run to completion; abort_at[request id]: abort it once it has that many tokens (a step ahead
    that includes it may be in flight then). Returns {id: (tokens, finish_reason, stop_reason, logprobs)}."""
    results = {}
    for i, (prompt, params) in enumerate(requests):
        core.add_request(Request(str(i), list(prompt), params, eos_token_id=2))
        results[str(i)] = ([], None, None, [])
    while core.has_work():
        for out in core.step():
            tokens, reason, _, lps = results[out.request_id]
            assert reason is None, "no output after a request finished"
            tokens.extend(out.new_token_ids)
            lps.extend(out.new_logprobs or [])
            results[out.request_id] = (tokens, out.finish_reason, out.stop_reason, lps)
            if out.finish_reason is None and len(tokens) == abort_at.get(out.request_id):
                core.abort_requests([out.request_id])
                results[out.request_id] = (tokens, "abort", None, lps)
    core.check_integrity(expect_all_free=True)
    return results


def workload(vocab: int, n: int, seed: int, **params) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))],
             SamplingParams(max_tokens=rng.randrange(1, 40), **params)) for _ in range(n)]


def compare(path: str, device: str, requests, abort_at={}, **kwargs):
    """Tokens, finish and stop reasons equal; logprobs equal up to float rounding (a step queued
    ahead carries fewer rows, and a matmul's rounding may depend on its row count)."""
    sync = drive(make_core(path, device, False, **kwargs), requests, abort_at)
    core = make_core(path, device, True, **kwargs)
    ahead = drive(core, requests, abort_at)
    assert {k: v[:3] for k, v in ahead.items()} == {k: v[:3] for k, v in sync.items()}
    for rid, (*_, lps) in sync.items():
        for (lp, top), (lp2, top2) in zip(lps, ahead[rid][3], strict=True):
            assert lp2 == pytest.approx(lp, abs=1e-4) and [t for t, _ in top2] == [t for t, _ in top]
            assert [v for _, v in top2] == pytest.approx([v for _, v in top], abs=1e-4)
    assert core.stats()["num_async_steps"] > 0, "some steps were queued ahead"
    return sync


def test_greedy_with_max_tokens_and_eos(tiny_llama, device):
    requests = workload(500, 12, seed=0, temperature=0.0)
    out = compare(tiny_llama, device, requests)
    assert {len(t) for t, *_ in out.values()} != {1}


def test_stop_ids_end_a_request_one_step_early(tiny_llama, device):
    """Stop on tokens the greedy run produces mid-way: each such request ends at a step whose
    successor was already queued; that successor's token never shows."""
    plain = workload(500, 10, seed=1, temperature=0.0, ignore_eos=True)
    first = drive(make_core(tiny_llama, device, False), plain)
    requests = []
    for (prompt, params), (tokens, *_) in zip(plain, first.values()):
        stop = [tokens[len(tokens) // 2]] if len(tokens) > 4 else []
        requests.append((prompt, SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True,
                                                stop_token_ids=stop, min_tokens=1 if stop else 0)))
    out = compare(tiny_llama, device, requests)
    stopped = [stop for _, reason, stop, _ in out.values() if reason == "stop"]
    assert stopped, "some requests stopped on a stop id"


def test_seeded_sampling_and_logprobs(tiny_llama, device):
    requests = [(prompt, SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=params.max_tokens,
                                        logprobs=2))
                for i, (prompt, params) in enumerate(workload(500, 9, seed=2))]
    out = compare(tiny_llama, device, requests)
    assert all(len(lps) == len(tokens) for tokens, _, _, lps in out.values())


def test_aborts_mid_run(tiny_llama, device):
    requests = workload(500, 8, seed=3, temperature=0.0, ignore_eos=True)
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)) for p, _ in requests]
    out = compare(tiny_llama, device, requests, abort_at={"0": 9, "1": 2, "4": 3, "6": 1})
    assert [len(out[rid][0]) for rid in ("0", "1", "4", "6")] == [9, 2, 3, 1]
    assert all(out[rid][1] == "abort" for rid in ("0", "1", "4", "6"))


@pytest.mark.parametrize("kwargs", [dict(num_blocks=10, max_num_seqs=8), dict(max_model_len=48),
                                    dict(enforce_eager=True)])
def test_preemption_context_limit_and_eager(tiny_llama, device, kwargs):
    requests = workload(500, 10, seed=4, temperature=0.0, ignore_eos=True)
    compare(tiny_llama, device, requests, **kwargs)


def test_steps_run_ahead_in_a_chain_while_the_scheduler_is_idle(tiny_llama, device):
    """One request, nothing waiting: every decode step but those that open a new block (the
    scheduler allocates it) is queued before the previous one's token is known."""
    prompt = [(5, 6, 7), SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)]
    core = make_core(tiny_llama, device, True)
    out = drive(core, [(list(prompt[0]), prompt[1])])
    assert out == drive(make_core(tiny_llama, device, False), [(list(prompt[0]), prompt[1])])
    stats = core.stats()
    assert stats["num_async_steps"] >= 0.8 * stats["decode_buffer_steps"] > 0


def test_engine_core_process_with_stop_strings(tiny_llama):
    """Through the front end and the engine core's own process: a stop string found by the front
    end stops the request in the core while a step ahead may carry it; streams equal the offline API."""
    import asyncio

    from engine import LLM
    from engine.async_engine import AsyncEngine

    prompts = ["The old king", "Green river stone", "a b c", "Winter"]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = [o.outputs[0].text for o in LLM(tiny_llama).generate(prompts, plain)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[text[len(text) // 2:][:3]])
              if len(text) > 8 else plain for text in first]
    expected = LLM(tiny_llama).generate(prompts, params)

    async def main():
        engine = await AsyncEngine.create(tiny_llama, multiprocess=True, async_scheduling=True)
        try:
            async def run(prompt, p):
                text, reason = "", None
                async for out in engine.generate(prompt, p):
                    text += out.delta_text
                    reason = out.outputs[0].finish_reason
                return text, reason
            results = await asyncio.gather(*(run(pr, p) for pr, p in zip(prompts, params)))
            for _ in range(100):  # the core reports its counters every 50 ms
                if engine.stats().get("num_async_steps", 0) > 0:
                    break
                await asyncio.sleep(0.05)
            assert engine.stats()["num_async_steps"] > 0
            return results
        finally:
            await engine.shutdown()

    got = asyncio.run(main())
    assert got == [(o.outputs[0].text, o.outputs[0].finish_reason) for o in expected]
    assert any(reason == "stop" for _, reason in got)
