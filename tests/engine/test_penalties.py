"""Penalties, logit_bias, bad words and min_tokens: the batched processors against a plain loop, and
greedy decoding with them token-exact against transformers' model run with the same loop."""
from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.engine_core import next_decode_step
from engine.logits_processors import apply_logits_processors
from engine.processor import InputProcessor, validate_sampling
from engine.request import InvalidRequestError, Request

VOCAB = 50


def reference_processors(row: list[float], prompt: list[int], output: list[int], p: SamplingParams,
                         eos: int | None) -> list[float]:
    """One row, the slow obvious way, in vLLM's order."""
    row = [x if not p.allowed_token_ids or t in p.allowed_token_ids else -math.inf for t, x in enumerate(row)]
    for token, bias in p.logit_bias:
        row[token] += bias
    for word in p.bad_words_token_ids:
        before = list(word[:-1])
        if len(before) <= len(output) and output[len(output) - len(before):] == before:
            row[word[-1]] = -math.inf
    if len(output) < p.min_tokens:
        for token in [*p.stop_token_ids, *([eos] if eos is not None else [])]:
            row[token] = -math.inf
    for token in range(len(row)):
        if p.repetition_penalty != 1.0 and (token in prompt or token in output):
            row[token] = row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
        count = output.count(token)
        row[token] -= p.frequency_penalty * count
        if count:
            row[token] -= p.presence_penalty
    return row


def random_params(rng: random.Random, kind: str) -> SamplingParams:
    if kind == "none":
        return SamplingParams(max_tokens=64)
    if kind == "bias":
        return SamplingParams(max_tokens=64, logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(5)})
    if kind == "bad_words":
        return SamplingParams(max_tokens=64, bad_words_token_ids=[[rng.randrange(VOCAB)], [3, 4], [5, 6, 7], [9, 9]])
    if kind == "min_tokens":
        return SamplingParams(max_tokens=64, min_tokens=40, stop_token_ids=[11, 12])
    if kind == "frequency":
        return SamplingParams(max_tokens=64, frequency_penalty=rng.uniform(-2, 2))
    if kind == "presence":
        return SamplingParams(max_tokens=64, presence_penalty=rng.uniform(-2, 2))
    if kind == "repetition":
        return SamplingParams(max_tokens=64, repetition_penalty=rng.choice([0.5, 1.3, 2.0]))
    if kind == "allowed":
        return SamplingParams(max_tokens=64, allowed_token_ids=rng.sample(range(VOCAB), 6))
    if kind == "allowed+bias":
        return SamplingParams(max_tokens=64, allowed_token_ids=[2, 3, 5, 8], logit_bias={3: 50.0, 4: 100.0},
                              frequency_penalty=0.5)
    return SamplingParams(  # everything at once
        max_tokens=64, min_tokens=30, stop_token_ids=[1], frequency_penalty=0.7, presence_penalty=-0.4,
        repetition_penalty=1.7, logit_bias={2: 5.0, 3: -7.5, 4: 100.0},
        bad_words_token_ids=[[8], [3, 4], [4, 5, 6]])


KINDS = ["none", "bias", "bad_words", "min_tokens", "frequency", "presence", "repetition", "allowed", "allowed+bias",
         "all"]


def random_batch(seed: int):
    rng = random.Random(seed)
    requests, rows = [], []
    for i, kind in enumerate(KINDS * 2):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
        r = Request(f"{kind}-{i}", prompt, random_params(rng, kind), eos_token_id=0)
        # Histories over a small alphabet, so tokens repeat and bad-word prefixes match.
        for _ in range(rng.randrange(0, 50)):
            r.append_token(rng.choice([3, 4, 5, 6, 9, rng.randrange(VOCAB)]))
        requests.append(r)
    logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    return requests, logits


@pytest.mark.parametrize("seed", range(4))
def test_processors_match_the_reference_loop(seed, device):
    requests, logits = random_batch(seed)
    out = apply_logits_processors(logits.to(device), requests).cpu()
    for i, r in enumerate(requests):
        ref = reference_processors(logits[i].tolist(), r.prompt_token_ids, r.output_token_ids,
                                   r.sampling_params, r.eos_token_id)
        assert torch.allclose(out[i], torch.tensor(ref), rtol=1e-5, atol=1e-4), r.request_id
        if r.request_id.startswith("none"):
            assert torch.equal(out[i], logits[i])  # untouched, bit for bit


def test_hypothetical_outputs_per_row(device):
    """What speculative decoding passes: one request at several positions, each with its own history."""
    p = SamplingParams(max_tokens=64, frequency_penalty=1.0, repetition_penalty=1.5, min_tokens=3,
                       bad_words_token_ids=[[3, 4]])
    r = Request("spec", [7, 8], p, eos_token_id=0)
    r.append_token(3)
    drafts = [5, 3, 3]
    histories = [r.output_token_ids + drafts[:j] for j in range(len(drafts) + 1)]
    logits = torch.randn(len(histories), VOCAB, generator=torch.Generator().manual_seed(7))
    out = apply_logits_processors(logits.to(device), [r] * len(histories), histories).cpu()
    for j, history in enumerate(histories):
        ref = reference_processors(logits[j].tolist(), r.prompt_token_ids, history, p, 0)
        assert torch.allclose(out[j], torch.tensor(ref), rtol=1e-5, atol=1e-4)
    assert out[0, 4] == -math.inf and out[1, 4] != -math.inf  # [3, 4]: only after a 3
    assert out[1, 0] == -math.inf and out[2, 0] != -math.inf  # EOS hidden before 3 tokens


@pytest.mark.parametrize("explicit_rows", [False, True], ids=["own_output", "per_row_histories"])
def test_a_resumed_prompt_tail_counts_as_output(device, explicit_rows):
    """A request resumed elsewhere (after a migration) has its earlier output as the prompt's
    tail: penalties and bad words treat it as the request that never moved does; min_tokens,
    whose budget the router has already reduced, counts only the new output."""
    prompt, before, after = [7, 8, 9], [3, 3, 5], [3]
    p = dict(max_tokens=64, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.5,
             bad_words_token_ids=[[5, 3, 4], [3, 6]], stop_token_ids=[11])
    whole = Request("whole", prompt, SamplingParams(**p, min_tokens=6), eos_token_id=0)
    moved = Request("moved", prompt + before, SamplingParams(**p, min_tokens=6 - len(before),
                                                             resumed_tokens=len(before)), eos_token_id=0)
    for t in before + after:
        whole.append_token(t)
    for t in after:
        moved.append_token(t)
    assert moved.output_history == whole.output_token_ids
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)).repeat(2, 1).to(device)
    histories = [r.output_history for r in (whole, moved)] if explicit_rows else None
    out = apply_logits_processors(logits, [whole, moved], histories).cpu()
    assert torch.equal(out[0], out[1])
    assert out[1, 4] == -math.inf and out[1, 6] == -math.inf  # bad words matched across the move
    assert out[1, 0] == -math.inf and out[1, 11] == -math.inf  # 4 of 6 tokens so far: EOS still hidden
    fresh = Request("fresh", prompt + before, SamplingParams(**p), eos_token_id=0)
    fresh.append_token(after[0])  # the same tokens as prompt only: penalised less
    assert not torch.equal(apply_logits_processors(logits[:1], [fresh]).cpu()[0], out[1])


def test_resumed_tokens_are_checked():
    with pytest.raises(InvalidRequestError, match="resumed_tokens must be an integer >= 0"):
        SamplingParams(resumed_tokens=-1)
    processor = InputProcessor(None, 64, VOCAB)
    with pytest.raises(InvalidRequestError, match=r"resumed_tokens \(4\) exceeds the prompt's 3 tokens"):
        processor.validate([1, 2, 3], SamplingParams(resumed_tokens=4))
    processor.validate([1, 2, 3], SamplingParams(resumed_tokens=3))


def test_nothing_asked_is_no_work():
    requests = [Request("a", [1, 2], SamplingParams(max_tokens=4)), Request("b", [1], SamplingParams(max_tokens=4))]
    logits = torch.randn(2, VOCAB)
    assert apply_logits_processors(logits, requests) is logits


@pytest.mark.parametrize("kwargs,message", [
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be in [-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number > 0"),
    (dict(logit_bias={3: 101}), "logit_bias values must be in [-100, 100]"),
    (dict(logit_bias={"3": 1.0}), "logit_bias keys must be token ids"),
    (dict(bad_words_token_ids=[[]]), "bad_words_token_ids must be non-empty"),
    (dict(bad_words_token_ids=["ab"]), "bad_words_token_ids must be sequences"),
    (dict(n=0), "n must be an integer >= 1"),
    (dict(allowed_token_ids="ab"), "allowed_token_ids must be a list of token ids"),
    (dict(allowed_token_ids=[1, 2.5]), "allowed_token_ids must be a list of token ids .integers."),
])
def test_bad_params_are_refused_by_name(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_ids_are_checked_against_the_vocabulary():
    with pytest.raises(InvalidRequestError, match="logit_bias token ids \\[50\\]"):
        validate_sampling(SamplingParams(logit_bias={50: 1.0}), VOCAB)
    with pytest.raises(InvalidRequestError, match="bad_words token ids \\[-1\\]"):
        validate_sampling(SamplingParams(bad_words_token_ids=[[1, -1]]), VOCAB)
    with pytest.raises(InvalidRequestError, match="allowed_token_ids \\[50\\]"):
        validate_sampling(SamplingParams(allowed_token_ids=[3, 50]), VOCAB)
    validate_sampling(SamplingParams(logit_bias={49: 1.0}, bad_words_token_ids=[[0, 49]], allowed_token_ids=[0, 49]),
                      VOCAB)


def test_logit_bias_is_stored_immutably():
    p = SamplingParams(logit_bias={9: -1, 2: 3.5})
    assert p.logit_bias == ((2, 3.5), (9, -1.0))
    assert hash(p) == hash(SamplingParams(logit_bias=[(2, 3.5), (9, -1)]))


def test_rows_reading_the_output_are_not_launched_ahead():
    """Async scheduling: a row whose processors read the previous token waits for it."""
    from engine.model_runner import LaunchedStep
    from engine.request import RequestStatus
    from engine.scheduler import SchedulerOutput

    def running(rid: str, **kwargs) -> Request:
        r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=50, **kwargs))
        r.status = RequestStatus.RUNNING
        r.append_token(4)
        r.num_computed_tokens = 3
        return r

    rows = [running("plain"), running("bias", logit_bias={5: 1.0}), running("one-word", bad_words_token_ids=[[5]]),
            running("freq", frequency_penalty=0.5), running("rep", repetition_penalty=1.2),
            running("words", bad_words_token_ids=[[5, 6]]), running("allowed", allowed_token_ids=[5, 9])]
    so = SchedulerOutput(scheduled=rows, num_scheduled_tokens=[1] * len(rows), new_block_ids=[[] for _ in rows])
    following = next_decode_step(LaunchedStep(so, requests=rows), max_model_len=512, block_size=16)
    assert [r.request_id for r in following.scheduled] == ["plain", "bias", "one-word", "allowed"]


# ---- the engine --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, device="cpu")


def greedy(llm: LLM, prompt: list[int], **kwargs) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kwargs)
    return llm.generate([prompt], params)[0].outputs[0].token_ids


def test_logit_bias_forces_a_token(llm):
    assert greedy(llm, [5, 6, 7], logit_bias={123: 100.0}) == [123] * 24


def test_bad_words_never_appear(llm):
    plain = greedy(llm, [5, 6, 7, 8])
    pair = plain[3:5]  # a pair greedy decoding produces
    out = greedy(llm, [5, 6, 7, 8], bad_words_token_ids=[pair, [plain[0]]])
    assert plain[0] not in out
    assert all(out[i:i + 2] != pair for i in range(len(out) - 1))


def test_sampling_keeps_to_the_allowed_tokens(llm):
    allowed = [17, 40, 99, 123, 250]
    params = SamplingParams(temperature=1.5, seed=8, max_tokens=40, ignore_eos=True, allowed_token_ids=allowed)
    out = llm.generate([[9, 10, 11]], params)[0].outputs[0].token_ids
    assert set(out) <= set(allowed) and len(set(out)) > 1  # sampled, not stuck on one
    assert greedy(llm, [5, 6, 7], allowed_token_ids=[321]) == [321] * 24


def test_sampled_rows_respect_the_processors(llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True,
                            bad_words_token_ids=[[t] for t in range(0, 200)], logit_bias={300: -100.0})
    out = llm.generate([[9, 10, 11]], params)[0].outputs[0].token_ids
    assert all(t >= 200 and t != 300 for t in out)


class HFReference:
    """transformers' model, step by step, the reference processors on its logits, argmax."""

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def generate(self, prompt: list[int], params: SamplingParams) -> list[int]:
        output: list[int] = []
        for _ in range(params.max_tokens):
            ids = torch.tensor([prompt + output])
            row = self.model(ids).logits[0, -1].tolist()
            row = reference_processors(row, prompt, output, params, None)
            output.append(max(range(len(row)), key=row.__getitem__))
        return output


PENALTIES = {
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=1.8),
    "repetition": dict(repetition_penalty=1.8),
    "all": dict(frequency_penalty=0.6, presence_penalty=0.4, repetition_penalty=1.3,
                logit_bias={17: 2.0, 40: -3.0}, bad_words_token_ids=[[7, 8], [60]]),
    "allowed": dict(allowed_token_ids=[7, 8, 9, 17, 40, 60, 99, 123], frequency_penalty=0.8),
}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalised_greedy_matches_transformers(tiny_llama, async_scheduling, device):
    ref = HFReference(tiny_llama)
    engine = LLM(tiny_llama, device=device, async_scheduling=async_scheduling)
    rng = random.Random(0)
    # A small alphabet in the prompts, so the repetition penalty has repeats to act on.
    prompts = [[rng.choice([7, 8, 9, 17, 40, 60]) for _ in range(n)] for n in (3, 12, 30)]
    names = list(PENALTIES)
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **PENALTIES[name]) for name in names]
    batch = [(prompt, p) for prompt in prompts for p in params]
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = engine.generate([pr for pr, _ in batch] + prompts, [p for _, p in batch] + [plain] * len(prompts))
    changed = 0
    for (prompt, p), out in zip(batch, outs):
        want = ref.generate(prompt, p)
        assert out.outputs[0].token_ids == want, (prompt, p)
        changed += want != outs[len(batch) + prompts.index(prompt)].outputs[0].token_ids
    assert changed >= len(batch) // 2  # the penalties do change what greedy decoding says


def test_llm_n_gives_distinct_reproducible_samples(llm):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, n=3, frequency_penalty=0.5)
    out = llm.generate([[3, 4, 5], [6, 7]], params)
    assert [len(o.outputs) for o in out] == [3, 3] and [c.index for c in out[0].outputs] == [0, 1, 2]
    first = [c.token_ids for c in out[0].outputs]
    assert len({tuple(t) for t in first}) == 3
    # Sample i is the request with seed + i, alone.
    for i, tokens in enumerate(first):
        alone = llm.generate([[3, 4, 5]], SamplingParams(temperature=1.0, seed=5 + i, max_tokens=8, ignore_eos=True,
                                                        frequency_penalty=0.5))
        assert alone[0].outputs[0].token_ids == tokens


def test_the_engine_core_process_gets_every_field(tiny_llama, llm):
    """AddRequest crosses to the core process as msgpack: the processors' fields survive it."""
    from engine.async_engine import AsyncEngine

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=1.0,
                            repetition_penalty=1.4, logit_bias={77: 3.0}, bad_words_token_ids=[[5, 6], [9]],
                            resumed_tokens=2, allowed_token_ids=list(range(0, 400, 3)))

    async def main():
        engine = await AsyncEngine.create(tiny_llama, multiprocess=True, num_blocks=256)
        try:
            with pytest.raises(InvalidRequestError, match="n must be 1"):
                engine.add_request([1, 2, 3], SamplingParams(n=2))
            return [t async for out in engine.generate([11, 12, 13, 11], params) for t in out.delta_token_ids]
        finally:
            await engine.shutdown()

    got = asyncio.run(main())
    assert got == llm.generate([[11, 12, 13, 11]], params)[0].outputs[0].token_ids
