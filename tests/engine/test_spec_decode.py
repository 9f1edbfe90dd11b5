"""Speculative decoding: the scheduler's rollback with fake outputs, n-gram lookup against a plain
reference, the rejection sampler's distribution (chi-square), and whole engines whose greedy tokens
equal non-speculative decoding (n-gram and a draft model) in every mode."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampler import Sampler
from engine.scheduler import ModelOutput, Scheduler
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer, ngram_lookup
from engine.spec_decode.rejection_sampler import RejectionSampler

BS = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


# -- the scheduler, with fake model outputs ---------------------------------------------------------

def make_scheduler(num_blocks=64, budget=32, k=3, method="ngram", draft_path=None, max_model_len=1024):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, model=draft_path)
    kv = KVCacheManager(num_blocks, BS, enable_caching=True)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget), kv, max_model_len,
                     speculative=spec)


def req(rid, prompt, max_tokens=32, **params):
    return Request(rid, list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params),
                   eos_token_id=2)


def step(s: Scheduler, accept: dict[str, int] | None = None, token: int = 50):
    """One step: a row verifying proposals accepts accept[rid] of them (default all), then adds `token`."""
    out = s.schedule()
    runs = []
    for r, n in zip(out.scheduled, out.num_scheduled_tokens):
        spec = out.spec_token_ids.get(r.request_id, [])
        if r.num_computed_tokens + n - len(spec) < r.num_tokens:
            continue  # a prefill chunk
        a = len(spec) if accept is None or r.request_id not in accept else accept[r.request_id]
        runs.append(spec[:a] + [token])
    return out, s.update_from_output(out, ModelOutput([], sampled_token_runs=runs))


def test_proposals_scheduled_and_rejected_ones_rolled_back():
    s = make_scheduler()
    r = req("a", range(10, 16))  # 6 prompt tokens: blocks 0-1
    s.add_request(r)
    step(s)  # prefill, first token
    assert r.num_computed_tokens == 6 and r.num_tokens == 7
    r.spec_token_ids = [61, 62, 63]
    out, results = step(s, accept={"a": 1}, token=70)
    assert out.num_scheduled_tokens == [4] and out.spec_token_ids == {"a": [61, 62, 63]}
    # Positions 6..9 needed 3 blocks during the step; 61 and 70 are the new tokens, 62 and 63 rejected.
    assert results[0].new_token_ids == [61, 70]
    assert r.all_token_ids[-3:] == [50, 61, 70] and r.num_computed_tokens == 8 == r.num_tokens - 1
    # Position 8 (the next input) is in block 2, which stays; nothing past it was held.
    assert len(s.kv.get_block_ids("a")) == 3
    assert r.spec_token_ids == []
    s.kv.check_integrity()
    stats = (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens, s.spec_accepted_per_pos)
    assert stats == (1, 3, 1, [1, 0, 0])


def test_blocks_only_rejected_tokens_needed_are_released():
    s = make_scheduler()
    r = req("a", range(10, 17))  # 7 prompt tokens, +1 sampled = 8: blocks 0-1 full
    s.add_request(r)
    step(s)
    free_before = s.kv.block_pool.num_free_blocks
    r.spec_token_ids = [61, 62, 63]
    out, _ = step(s, accept={"a": 0})  # positions 7..10: block 2 allocated for rejected tokens 8..10
    assert len(out.new_block_ids[0]) == 1
    assert r.num_computed_tokens == 8 and r.num_tokens == 9
    # Position 8 (the next input) lives in block 2: kept. Had the row been at a block's end, freed:
    assert len(s.kv.get_block_ids("a")) == 3 and s.kv.block_pool.num_free_blocks == free_before - 1
    s.kv.check_integrity()

    s2 = make_scheduler()
    r2 = req("b", range(10, 15))  # 5 + 1 = 6 tokens, computed 5; proposals reach position 8 (block 2)
    s2.add_request(r2)
    step(s2)
    free_before = s2.kv.block_pool.num_free_blocks
    r2.spec_token_ids = [61, 62, 63]
    out, _ = step(s2, accept={"b": 0})
    assert len(out.new_block_ids[0]) == 1
    # Only rejected tokens (positions 6..8) needed block 2: released, and the runner is told.
    assert len(s2.kv.get_block_ids("b")) == 2 and s2.kv.block_pool.num_free_blocks == free_before
    assert s2.schedule().num_kept_blocks == {"b": 2}
    s2.kv.check_integrity()


def test_prefix_cache_holds_verified_tokens_only():
    s = make_scheduler()
    r = req("a", range(10, 15))
    s.add_request(r)
    step(s)
    r.spec_token_ids = [61, 62, 63]  # would fill block 1 (positions 4..7) with proposals
    step(s, accept={"a": 0}, token=99)
    cached = s.kv.num_cached_blocks["a"]
    assert cached == 1, "block 1 holds rejected proposals: not published"
    # Once verified tokens fill it, it is cached under their hash.
    r.spec_token_ids = [71, 72]
    step(s)
    assert r.all_token_ids[4:8] == [14, 50, 99, 71]
    s.schedule()  # the next allocation publishes the block verified tokens filled
    hits, n = s.kv.get_computed_blocks(req("b", r.all_token_ids[:9]))
    assert n == 8


def test_stop_inside_an_accepted_run_truncates_it():
    s = make_scheduler()
    r = req("a", range(10, 16), stop_token_ids=(62,))
    s.add_request(r)
    step(s)
    r.spec_token_ids = [61, 62, 63]
    _, results = step(s)  # all accepted: 61, 62 (stop), 63 and the bonus dropped
    assert results[0].new_token_ids == [61, 62] and results[0].finish_reason == "stop"
    assert results[0].stop_reason == 62
    assert not s.has_unfinished_requests()
    s.kv.check_integrity(expect_all_free=True)


def test_max_tokens_min_tokens_and_eos_token_by_token():
    s = make_scheduler()
    r = req("a", range(10, 16), max_tokens=3)
    s.add_request(r)
    step(s)
    r.spec_token_ids = [61, 62, 63]
    out, results = step(s)
    assert out.spec_token_ids == {"a": [61]}, "trimmed: the target's token after them must fit max_tokens"
    assert results[0].new_token_ids == [61, 50] and results[0].finish_reason == "length"

    s = make_scheduler()
    r = Request("b", list(range(10, 16)), SamplingParams(temperature=0, max_tokens=10, min_tokens=3), eos_token_id=2)
    s.add_request(r)
    step(s, token=5)
    r.spec_token_ids = [2, 2, 7]  # EOS before min_tokens does not stop; after it does
    _, results = step(s)
    assert results[0].new_token_ids == [2, 2] and results[0].finish_reason == "stop"


def test_proposals_fit_the_token_budget_and_max_model_len():
    s = make_scheduler(budget=8)
    a, b = req("a", range(10, 14)), req("b", range(20, 24))
    s.add_request(a)
    s.add_request(b)
    step(s)
    a.spec_token_ids = [1, 2, 3]
    b.spec_token_ids = [4, 5, 6]
    out, _ = step(s)
    assert out.num_scheduled_tokens == [4, 4]
    s2 = make_scheduler(budget=6)
    c, d = req("c", range(10, 13)), req("d", range(20, 23))
    s2.add_request(c)
    s2.add_request(d)
    step(s2)
    c.spec_token_ids, d.spec_token_ids = [1, 2, 3], [4, 5, 6]
    out, _ = step(s2)
    assert out.num_scheduled_tokens == [4, 2] and out.spec_token_ids == {"c": [1, 2, 3], "d": [4]}

    s3 = make_scheduler(max_model_len=8)
    e = req("e", range(10, 15))
    s3.add_request(e)
    step(s3)  # 6 tokens; the last position a request computes is max_model_len - 2 = 6
    e.spec_token_ids = [1, 2, 3]
    out, results = step(s3)
    assert out.spec_token_ids == {"e": [1]} and results[0].finish_reason == "length"


def test_preemption_drops_proposals_and_recomputes():
    s = make_scheduler(num_blocks=5)
    a, b = req("a", range(10, 16), max_tokens=6), req("b", range(20, 26), max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    step(s)
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3], [4, 5, 6]
    out, _ = step(s)
    assert out.preempted_req_ids == ["b"] and b.spec_token_ids == [] and b.num_computed_tokens == 0
    s.kv.check_integrity()
    finished = {}
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        for res in step(s)[1]:
            if res.finish_reason:
                finished[res.request_id] = res.finish_reason
    assert finished == {"a": "length", "b": "length"}
    s.kv.check_integrity(expect_all_free=True)


def test_draft_model_rows_hold_lookahead_slots(tiny_llama):
    s = make_scheduler(method="draft_model", draft_path=tiny_llama, k=3)
    r = req("a", range(10, 15))  # 5 tokens: the prefill allocates 5 + 3 lookahead = 2 blocks
    s.add_request(r)
    step(s)
    assert len(s.kv.get_block_ids("a")) == 2
    r.spec_token_ids = [1, 2, 3]
    step(s, accept={"a": 0})
    # computed 6: the draft writes positions 6..8 next, so blocks 0-2 stay held.
    assert r.num_computed_tokens == 6 and len(s.kv.get_block_ids("a")) == 3
    s.kv.check_integrity()


# -- n-gram lookup ---------------------------------------------------------------------------------

def reference_lookup(tokens, k, lo, hi):
    """Plain Python: the longest suffix of length lo..hi seen earlier (latest occurrence wins);
    the k tokens after it, continuing into the proposal itself."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                seq = list(tokens)
                for i in range(k):
                    seq.append(seq[start + n + i])
                return seq[len(tokens):]
    return []


def test_ngram_lookup_matches_reference():
    rng = random.Random(0)
    assert ngram_lookup([1, 2, 3, 9, 1, 2], 3, 1, 4) == [3, 9, 1]
    assert ngram_lookup([5, 6, 5, 6], 5, 1, 4) == [5, 6, 5, 6, 5]  # a cycle proposes through itself
    assert ngram_lookup([1, 2, 3], 2, 1, 4) == []
    assert ngram_lookup([1, 2, 3, 1], 2, 2, 4) == []  # only a 1-gram repeats: below prompt_lookup_min
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        k, lo = rng.randrange(1, 6), rng.randrange(1, 3)
        hi = lo + rng.randrange(0, 3)
        assert ngram_lookup(tokens, k, lo, hi) == reference_lookup(tokens, k, lo, hi), (tokens, k, lo, hi)


def drive_proposer(proposer, request, next_tokens) -> list[bool]:
    """Propose, then append the next token, per step; whether each step had proposals."""
    request.status = RequestStatus.RUNNING
    proposed = []
    for token in next_tokens:
        request.num_computed_tokens = request.num_tokens - 1
        request.spec_token_ids = []
        proposer.propose([request])
        proposed.append(bool(request.spec_token_ids))
        request.append_token(token)
    return proposed


def test_ngram_proposes_only_where_an_ngram_repeats():
    proposed = drive_proposer(NgramProposer(3, 1024, 1, 4), req("a", [1, 2, 3, 1, 2, 3, 1, 2]),
                              range(100, 300))  # fresh tokens: nothing repeats after the prompt
    assert proposed[0] and not any(proposed[1:])


class AlwaysWrong(NgramProposer):
    def propose_tokens(self, requests, ks):
        return [[0] * k for k in ks]


def test_backoff_doubles_after_each_miss_and_resets_on_a_hit():
    proposed = drive_proposer(AlwaysWrong(3, 1024, 1, 4), req("a", [1, 2, 3], max_tokens=1000), range(100, 300))
    # Waits of 1, 3, 7, ... 63 tokens between misses, not a proposal every step.
    assert [i for i, p in enumerate(proposed) if p] == [0, 2, 6, 14, 30, 62, 126, 190]
    # A miss, (backed off), a hit, a miss, (backed off), a hit.
    proposed = drive_proposer(AlwaysWrong(3, 1024, 1, 4), req("b", [1, 2, 3], max_tokens=1000),
                              [100, 101, 0, 102, 0, 0])
    assert proposed == [True, False, True, True, False, True], "an acceptance resets the back-off"


# -- the rejection sampler ---------------------------------------------------------------------------

V = 6


def rows_of(n, **params):
    return [Request(str(i), [1, 2, 3], SamplingParams(**params)) for i in range(n)]


def check_distribution(samples: torch.Tensor, probs: torch.Tensor):
    counts = torch.bincount(samples, minlength=V).double()
    expected = probs.double() * len(samples)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was produced"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()  # chi2 sf
    assert p_value > 1e-3, (counts, expected)


@pytest.mark.parametrize("full_draft", [False, True], ids=["one-hot", "draft-distribution"])
def test_rejection_sampling_keeps_the_target_distribution(device, full_draft):
    gen = torch.Generator().manual_seed(1)
    n, k = 20000, 2
    base = torch.randn(k + 1, V, generator=gen) * 1.5
    target_logits = base.clone()
    target_logits[1, 4] = float("-inf")  # a token the target never picks (the draft may propose it)
    p = torch.softmax(target_logits, dim=-1)
    # Proposals: from q, a distribution near p (a full draft), or one-hot (an n-gram guess).
    q = torch.softmax(base[:k] + 0.7 * torch.randn(k, V, generator=gen), dim=-1)
    draft = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(k)], dim=1)
    rs = RejectionSampler(Sampler(0, device))
    out = rs(target_logits.repeat(n, 1).to(device), rows_of(n, temperature=1.0), draft.tolist(),
             q.expand(n, k, V).to(device) if full_draft else None)
    tokens, num = out.tokens.cpu(), out.num_tokens.cpu()
    check_distribution(tokens[:, 0], p[0])
    for j in (1, 2):  # given positions before j accepted, position j is distributed as p_j
        reached = num > j
        assert reached.sum() > 1000
        check_distribution(tokens[reached, j], p[j])
    # The acceptance rate is sum_x min(p, q) per position (one-hot: E_q[p(d)]).
    rate = (num > 1).double().mean().item()
    expected = torch.minimum(p[0], q[0]).sum() if full_draft else (q[0] * p[0]).sum()
    assert rate == pytest.approx(expected.item(), abs=0.02)


def test_rejection_sampling_applies_temperature_and_top_k(device):
    n = 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]] * 2)
    rs = RejectionSampler(Sampler(0, device))
    draft = [[1]] * n
    out = rs(logits.repeat(n, 1).to(device), rows_of(n, temperature=0.7, top_k=3), draft)
    filtered = torch.softmax(logits[0] / 0.7, dim=-1)
    filtered[3:] = 0
    check_distribution(out.tokens[:, 0].cpu(), filtered / filtered.sum())


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_grammar_row_the_processors_empty_samples_from_the_grammar(device, temperature):
    """As the sampler: a grammar row (logits already masked to its end, EOS id 2) whose
    min_tokens hides EOS keeps the grammar's EOS at every verified position, instead of a token
    the grammar refuses."""
    logits = torch.full((2, V), float("-inf"))
    logits[:, 2] = 1.0  # the grammar allows only its end, at both of the row's positions
    row = Request("g", [1, 2, 3], SamplingParams(temperature=temperature, seed=1, max_tokens=8, min_tokens=4),
                  eos_token_id=2)
    row.structured_output = object()  # any grammar: only its presence is read here
    out = RejectionSampler(Sampler(0, device))(logits.to(device), [row], [[2]])
    assert out.tokens[0, :out.num_tokens[0]].tolist() == [2, 2]  # the proposal accepted, then the bonus


def test_greedy_verification_rule(device):
    logits = torch.full((7, V), -5.0)
    argmax = [3, 1, 4, 0, 2, 2, 5]
    logits[torch.arange(7), torch.tensor(argmax)] = 5.0
    rs = RejectionSampler(Sampler(0, device))
    # Row 0 (logits rows 0-3): proposals 3, 1, 5, the third wrong -> 3, 1, then the target's 4.
    # Row 1 (rows 4-5): proposal 2 right -> 2, then the bonus 2. Row 2 (row 6): no proposals -> 5.
    out = rs(logits.to(device), rows_of(3, temperature=0.0), [[3, 1, 5], [2], []])
    runs = [row[:n] for row, n in zip(out.tokens.tolist(), out.num_tokens.tolist())]
    assert runs == [[3, 1, 4], [2, 2], [5]]
    out = rs(logits.to(device), rows_of(2, temperature=0.0), [[3, 1, 4], [2, 2]])
    assert [row[:n] for row, n in zip(out.tokens.tolist(), out.num_tokens.tolist())] == [[3, 1, 4, 0], [2, 2, 5]]


def test_seeded_speculative_sampling_is_reproducible(tiny_llama, device):
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12] * 3]
    params = SamplingParams(temperature=0.8, max_tokens=16, seed=7, ignore_eos=True)
    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3}
    runs = []
    for _ in range(2):
        llm = LLM(tiny_llama, device=device, speculative_config=spec)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert llm.engine.stats()["spec_decode_num_drafts"] > 0
    assert runs[0] == runs[1]


# -- whole engines: greedy speculative == greedy plain ------------------------------------------------

def cyclic_prompts(rng, n):
    """Prompts with repeats (n-gram lookup finds them) and without."""
    out = []
    for i in range(n):
        period = rng.randrange(2, 6)
        base = [rng.randrange(3, 500) for _ in range(period)]
        out.append(base * rng.randrange(2, 6) if i % 2 == 0 else [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))])
    return out


def generate(path, prompts, params, **kwargs):
    llm = LLM(path, **kwargs)
    outs = llm.generate(prompts, params)
    llm.engine.check_integrity(expect_all_free=True)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], llm.engine.stats()


MODES = {
    "plain": {},
    "chunked-prefill": {"max_num_batched_tokens": 16},
    "preempted": {"num_blocks": 24, "block_size": 4},
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_speculation_is_token_exact(tiny_llama, device, method, mode):
    rng = random.Random(3)
    prompts = cyclic_prompts(rng, 6)
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(8, 40), ignore_eos=i % 3 != 0,
                             stop_token_ids=(rng.randrange(3, 500),) if i == 1 else ())
              for i in range(len(prompts))]
    kwargs = dict(device=device, **MODES[mode])
    expected, _ = generate(tiny_llama, prompts, params, **kwargs)
    spec = dict(NGRAM) if method == "ngram" else {"method": "draft_model", "model": tiny_llama,
                                                  "num_speculative_tokens": 3}
    got, stats = generate(tiny_llama, prompts, params, speculative_config=spec, **kwargs)
    assert got == expected
    assert stats["spec_decode_num_drafts"] > 0
    if method == "draft_model":  # the draft is the target: every proposal is right
        assert stats["spec_decode_acceptance_rate"] == 1.0
        assert stats["spec_decode_mean_accepted_length"] > 2.5
    if mode == "preempted":
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_speculation_with_prefix_cache_hits(tiny_llama, method):
    prompts = [[7, 8, 9, 10] * 6 + [i] for i in range(3, 7)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected, _ = generate(tiny_llama, prompts, params)
    spec = dict(NGRAM) if method == "ngram" else {"method": "draft_model", "model": tiny_llama,
                                                  "num_speculative_tokens": 2}
    llm = LLM(tiny_llama, speculative_config=spec, block_size=4)
    for _ in range(2):  # the second round hits the blocks the first one published
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == [t for t, _ in expected]
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["spec_decode_num_drafts"] > 0
    llm.engine.check_integrity(expect_all_free=True)


def test_logprobs_of_accepted_tokens_match_plain_decoding(tiny_llama):
    prompts = [[5, 6, 7] * 5]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    plain = LLM(tiny_llama).generate(prompts, params)[0].outputs[0]
    spec = LLM(tiny_llama, speculative_config={"method": "draft_model", "model": tiny_llama,
                                               "num_speculative_tokens": 3}).generate(prompts, params)[0].outputs[0]
    assert spec.token_ids == plain.token_ids
    for a, b in zip(plain.logprobs, spec.logprobs, strict=True):
        assert list(a) == list(b) and list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)


# -- configuration --------------------------------------------------------------------------------

@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "missing"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft": "x"}, "unknown keys"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ("{not json", "not valid JSON"),
])
def test_bad_speculative_configs_are_refused(tiny_llama, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(tiny_llama, speculative_config=value)


def test_speculation_refuses_async_scheduling(tiny_llama):
    with pytest.raises(ValueError, match="async scheduling"):
        EngineConfig.create(tiny_llama, speculative_config=NGRAM, async_scheduling=True)


def test_draft_model_must_share_the_vocabulary(tiny_llama, tiny_model_factory):
    other = tiny_model_factory("llama", vocab_size=1500)
    with pytest.raises(ValueError, match="vocabulary"):
        EngineCore(EngineConfig.create(tiny_llama, speculative_config={
            "method": "draft_model", "model": other, "num_speculative_tokens": 2}))


def test_a_draft_models_cache_is_sized_and_stored_as_the_targets(tiny_llama, tiny_model_factory):
    """vLLM's rule: a draft model's layers are KV cache layers. In the same KV memory a draft
    engine has fewer blocks (a block's bytes are the target's and the draft's together: both
    caches fit the memory given), the draft's cache takes the target's dtype (an fp8 cache's one
    byte a value), and greedy speculation over fp8 caches answers as plain decoding does."""
    mib = 1 << 20
    draft = tiny_model_factory("llama", num_layers=1, num_kv_heads=1)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    prompts = cyclic_prompts(random.Random(5), 4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def cache_bytes(caches):
        return sum(c.numel() * c.element_size() for c in caches)

    for kv in ("auto", "fp8"):
        plain = LLM(tiny_llama, kv_cache_dtype=kv, kv_cache_memory_bytes=mib)
        spec_llm = LLM(tiny_llama, kv_cache_dtype=kv, kv_cache_memory_bytes=mib, speculative_config=spec)
        runner, alone = spec_llm.engine.runner, plain.engine.runner
        assert alone.num_blocks == mib // alone.bytes_per_block()
        assert all(c.dtype == alone.kv_caches[0].dtype and c.shape[1] == runner.num_blocks
                   for c in runner.draft.kv_caches)
        held = cache_bytes(runner.kv_caches) + cache_bytes(runner.draft.kv_caches)
        per_block = held // runner.num_blocks
        assert per_block == runner.bytes_per_block() > alone.bytes_per_block()
        assert held <= mib < held + per_block  # as many blocks as the memory holds, both caches counted
        assert runner.num_blocks < alone.num_blocks
        assert spec_llm.engine.stats()["num_blocks"] == runner.num_blocks  # the scheduler's pool
        got = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)]
        assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
        assert spec_llm.engine.stats()["spec_decode_num_drafts"] > 0


def test_a_draft_catches_up_in_forwards_of_the_step_budget(tiny_llama, monkeypatch):
    """A draft's first proposal runs it over the whole prompt (after a long chunked prefill, or a
    P/D pull): in forwards of max_num_batched_tokens tokens at most (the memory the profiled step
    measured), each a chunk after the last, so the draft's KV is what one forward would write:
    the draft being the target, every proposal is accepted, and the tokens are plain decoding's."""
    from engine.spec_decode.draft_model import DraftModel

    sizes = []
    forward = DraftModel.forward
    monkeypatch.setattr(DraftModel, "forward", lambda self, tokens, *a, **k: (
        sizes.append(len(tokens) if isinstance(tokens, torch.Tensor) else sum(map(len, tokens))),
        forward(self, tokens, *a, **k))[1])
    prompts = [list(range(3, 3 + n)) for n in (70, 5, 41)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3}
    got, stats = generate(tiny_llama, prompts, params, speculative_config=spec, max_num_batched_tokens=16)
    assert max(sizes) == 16 and sum(sizes) > 116  # the prompts' 116 tokens, 16 at a time, then proposals
    assert stats["spec_decode_acceptance_rate"] == 1.0
    want, _ = generate(tiny_llama, prompts, params, max_num_batched_tokens=16)
    assert got == want


def test_rows_the_token_budget_left_out_propose_again(tiny_llama):
    """More running rows x (k + 1) than the step's token budget: a row not scheduled in a step
    has no new token when proposals are made for it again (its last token runs through the draft
    again); the engine goes on, token-exact, every proposal right (the draft is the target)."""
    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3}
    prompts = [[5 + i, 6, 7] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got, stats = generate(tiny_llama, prompts, params, speculative_config=spec, max_num_batched_tokens=8,
                          max_num_seqs=8)
    want, _ = generate(tiny_llama, prompts, params, max_num_batched_tokens=8, max_num_seqs=8)
    assert got == want and stats["spec_decode_acceptance_rate"] == 1.0


def test_acceptance_metrics_reach_prometheus(tiny_llama):
    from prometheus_client import generate_latest

    from services.common.metrics import ServiceMetrics

    llm = LLM(tiny_llama, speculative_config={"method": "draft_model", "model": tiny_llama,
                                              "num_speculative_tokens": 2})
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    stats = llm.engine.stats()
    # The prefill's token, then two steps of 2 proposals accepted + the target's token.
    assert (stats["spec_decode_num_drafts"], stats["spec_decode_num_draft_tokens"],
            stats["spec_decode_num_accepted_tokens"]) == (2, 4, 4)
    text = generate_latest(ServiceMetrics(llm.engine.stats, "m", "decode", "d-0").registry).decode()
    assert 'pdserve:spec_decode_num_drafts_total{engine_id="d-0",model_name="m",role="decode"} 2.0' in text
    assert 'pdserve:spec_decode_num_accepted_tokens_total{engine_id="d-0",model_name="m",role="decode"} 4.0' in text
    assert 'pdserve:spec_decode_acceptance_rate{engine_id="d-0",model_name="m",role="decode"} 1.0' in text
    assert 'pdserve:spec_decode_mean_accepted_length{engine_id="d-0",model_name="m",role="decode"} 3.0' in text
    assert 'pdserve:spec_decode_num_accepted_tokens_per_pos_total{engine_id="d-0",model_name="m",position="1",' \
           'role="decode"} 2.0' in text


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_structured_outputs_under_speculation(tiny_llama, method):
    """Proposals are cut where the grammar refuses them and every verified position is masked:
    greedy output equals non-speculative guided decoding, sampled output always validates."""
    import json

    import jsonschema

    from engine.structured_output.params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"enum": ["xy", "xyz"]}, "b": {"type": "integer",
              "minimum": 0, "maximum": 99}, "c": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 4}},
              "required": ["a", "b", "c"], "additionalProperties": False}

    def params(seed, temperature):
        return SamplingParams(max_tokens=80, temperature=temperature, seed=seed, structured_outputs=
                              StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True))

    prompts = ["A JSON object please"] * 3
    spec = dict(NGRAM) if method == "ngram" else {"method": "draft_model", "model": tiny_llama,
                                                  "num_speculative_tokens": 3}
    greedy = [params(None, 0.0)] * 3
    expected = [o.outputs[0].token_ids for o in LLM(tiny_llama).generate(prompts, greedy)]
    llm = LLM(tiny_llama, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == expected
    for out in llm.generate(prompts, [params(s, 1.0) for s in range(3)]):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert llm.engine.stats()["spec_decode_num_drafts"] > 0
    llm.engine.check_integrity(expect_all_free=True)


def test_penalties_and_logit_bias_score_each_position_with_its_history(tiny_llama):
    """Each verified position's penalties count the proposals before it as output: greedy tokens
    equal non-speculative decoding with the same penalties (a draft equal to the target proposes
    the unpenalised argmax, so rejections happen and must be right)."""
    prompts = [[5, 6, 7] * 4, [9, 10, 11, 12] * 3]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.4),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=0.8,
                             logit_bias={5: 3.0}, bad_words_token_ids=[[9, 10]])]
    expected, _ = generate(tiny_llama, prompts, params)
    for spec in (NGRAM, {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3}):
        got, stats = generate(tiny_llama, prompts, params, speculative_config=spec)
        assert got == expected
        assert stats["spec_decode_num_drafts"] > 0


def test_service_flags(capsys):
    """--speculative-config is parsed (and refused with a clear error) at the command line; a
    prefill instance refuses it before starting anything."""
    from services.cli import build_parser, main

    args = build_parser().parse_args(["decode", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["colocated", "--speculative-config", '{"method": "ngram"}'])
    assert "missing ['num_speculative_tokens']" in capsys.readouterr().err
    assert main(["prefill", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']) == 2
    assert "a prefill instance produces only the first token" in capsys.readouterr().err
